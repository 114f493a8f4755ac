"""``vcap-sidecar``: run the sidecar next to an engine, or with a simulated one (``--simulate``).

Arguments after ``--`` go to the simulated engine (``vcap-sim --help``).
"""

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys

from .app import Sidecar, SidecarConfig
from .controller import add_controller_arguments, config_from_args
from .history import default_history_path
from .version import version_text

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcap-sidecar", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment", default="vcap-0",
                        help="segment name in /dev/shm, created by the engine (default: vcap-0)")
    parser.add_argument("--dp-size", type=int, default=1, metavar="N",
                        help="attention-DP ranks of the engine: attach to all N segments, SEGMENT for rank 0 and "
                             "SEGMENT-dp<r> for rank r, and write the one policy into each (default: 1)")
    parser.add_argument("--dp-first-rank", type=int, default=0, metavar="R",
                        help="the first of this node's attention-DP ranks when the engine spans nodes: serve "
                             "ranks R..R+N-1 (default: 0)")
    parser.add_argument("--dispatch-row-bytes", type=int, default=None, metavar="BYTES",
                        help="bytes one verify row sends in the MoE's all-to-all dispatch, for "
                             "vcap_dispatch_*_saved_total (default: what the engine states in its segment; 0: "
                             "count nothing)")
    parser.add_argument("--grpc", default="127.0.0.1:50061",
                        help="gRPC address, HOST:PORT or unix:PATH (default: 127.0.0.1:50061)")
    parser.add_argument("--metrics", default="127.0.0.1:9461",
                        help="Prometheus HOST:PORT, '' to disable (default: 127.0.0.1:9461)")
    parser.add_argument("--policy-file", help="YAML/JSON policy file to watch (e.g. a ConfigMap)")
    parser.add_argument("--health", default="", metavar="HOST:PORT",
                        help="also serve gRPC health alone, in plaintext, on HOST:PORT (for the kubelet's "
                             "probes, which speak neither TLS nor tokens; default: none)")
    parser.add_argument("--auth-token-file",
                        help="bearer token required by changes; beyond loopback by every call but health "
                             "(the file must not be world-readable)")
    parser.add_argument("--tls-cert", help="server certificate (TLS; required with a token beyond loopback)")
    parser.add_argument("--tls-key", help="server key (TLS)")
    parser.add_argument("--tls-client-ca", help="CA that signs client certificates (mutual TLS)")
    parser.add_argument("--allow-cleartext-token", action="store_true",
                        help="accept a token beyond loopback without TLS (it travels in clear; logged loudly)")
    parser.add_argument("--max-watch-streams", type=int, default=256,
                        help="WatchStats streams open at once (default: %(default)s)")
    parser.add_argument("--max-watch-streams-per-peer", type=int, default=128,
                        help="WatchStats streams open at once from one address (default: %(default)s)")
    parser.add_argument("--record", metavar="FILE",
                        help="append every telemetry record to FILE (for vcapctl tune)")
    parser.add_argument("--record-max-bytes", type=int, metavar="BYTES",
                        help="rotate the --record file past BYTES (default: the recorder's)")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="keep the policy history (vcapctl history/rollback) in DIR/<segment>.history; "
                             "'' keeps it in memory only (default: beside the segment, /dev/shm/<segment>.history)")
    parser.add_argument("--history-entries", type=int, default=100,
                        help="policies kept in the history (default: %(default)s)")
    add_controller_arguments(parser.add_argument_group("automatic controller (vcapctl set --mode auto)"))
    parser.add_argument("--simulate", action="store_true",
                        help="also start a simulated engine (SYNTHETIC workload) that creates the segment")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="Python logging level (default: %(default)s)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version_text()}")
    return parser


def _history_file(args) -> str | None:
    if args.state_dir is None:
        return default_history_path(args.segment)
    if not args.state_dir:
        return None
    if not os.path.isdir(args.state_dir):   # else the first change finds out, and keeps it in memory only
        raise ValueError(f"--state-dir {args.state_dir}: not a directory (create it, or '' for memory only)")
    return os.path.join(args.state_dir, os.path.basename(args.segment) + ".history")


try:   # resolved here: between fork and exec the child only calls it
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):   # not Linux: the sidecar still stops the engine on a clean exit
    _PRCTL = None


def _terminated_with_parent() -> None:
    """In the simulated engine's process, before it runs: SIGTERM when the sidecar dies, even of
    SIGKILL (Linux's PR_SET_PDEATHSIG), so no orphan keeps stepping and a restart does not run two."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sim_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, sim_args = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if sim_args and not args.simulate:
        parser.error(f"arguments after -- go to the simulated engine, and there is none without --simulate: "
                     f"{' '.join(sim_args)}")
    for flag in ("--segment", "--dp-size", "--dp-first-rank"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in sim_args):
            parser.error(f"{flag} after -- would give the simulated engine another one than the sidecar's: "
                         f"give it before --")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = SidecarConfig(segment=args.segment, grpc_address=args.grpc,
                               metrics_address=args.metrics, policy_file=args.policy_file,
                               auth_token_file=args.auth_token_file, tls_cert=args.tls_cert,
                               tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                               record_file=args.record, record_max_bytes=args.record_max_bytes,
                               controller=config_from_args(args), health_address=args.health,
                               allow_cleartext_token=args.allow_cleartext_token,
                               max_watch_streams=args.max_watch_streams,
                               max_watch_streams_per_peer=args.max_watch_streams_per_peer,
                               history_file=_history_file(args), history_entries=args.history_entries,
                               dp_size=args.dp_size, dp_first_rank=args.dp_first_rank,
                               dispatch_row_bytes=args.dispatch_row_bytes)
        sidecar = Sidecar(config)
    except (ValueError, OSError) as error:
        print(f"vcap-sidecar: {error}", file=sys.stderr)
        return 2
    engine = None
    if args.simulate:
        engine = subprocess.Popen(
            [sys.executable, "-m", "vcap.engine_hook.sim", "--segment", args.segment,
             "--dp-size", str(args.dp_size), "--dp-first-rank", str(args.dp_first_rank), *sim_args],
            preexec_fn=_terminated_with_parent)
    try:
        asyncio.run(_serve(sidecar, engine))
    except OSError as error:  # a port taken: one line naming the flag, no traceback
        print(f"vcap-sidecar: {error}", file=sys.stderr)
        return 2
    return 0


async def _serve(sidecar: Sidecar, engine: subprocess.Popen | None) -> None:
    loop = asyncio.get_running_loop()
    serving = asyncio.ensure_future(sidecar.run())
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, sidecar.stop)
    try:
        while not serving.done():
            if engine is not None and engine.poll() is not None:
                logging.getLogger("vcap.sidecar").error(
                    "simulated engine exited with %s; stopping", engine.returncode)
                sidecar.stop()
            await asyncio.wait({serving}, timeout=0.5)
        serving.result()
    finally:
        if engine is not None and engine.poll() is None:
            engine.terminate()
            try:
                engine.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.kill()


if __name__ == "__main__":
    sys.exit(main())
