"""``vcap-sidecar``: run the sidecar next to an engine, or with a simulated one (``--simulate``).

Arguments after ``--`` go to the simulated engine (``vcap-sim --help``).
"""

import argparse
import asyncio
import logging
import signal
import subprocess
import sys

from .app import Sidecar, SidecarConfig
from .controller import add_controller_arguments, config_from_args

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcap-sidecar", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment", default="vcap-0",
                        help="segment name in /dev/shm, created by the engine (default: vcap-0)")
    parser.add_argument("--grpc", default="127.0.0.1:50061",
                        help="gRPC address, HOST:PORT or unix:PATH (default: 127.0.0.1:50061)")
    parser.add_argument("--metrics", default="127.0.0.1:9461",
                        help="Prometheus HOST:PORT, '' to disable (default: 127.0.0.1:9461)")
    parser.add_argument("--policy-file", help="YAML/JSON policy file to watch (e.g. a ConfigMap)")
    parser.add_argument("--auth-token-file", help="bearer token required by mutating RPCs")
    parser.add_argument("--tls-cert", help="server certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="server key (mutual TLS)")
    parser.add_argument("--tls-client-ca", help="CA that signs client certificates (mutual TLS)")
    parser.add_argument("--record", metavar="FILE",
                        help="append every telemetry record to FILE (for vcapctl tune)")
    add_controller_arguments(parser.add_argument_group("automatic controller (vcapctl set --mode auto)"))
    parser.add_argument("--simulate", action="store_true",
                        help="also start a simulated engine (SYNTHETIC workload) that creates the segment")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sim_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, sim_args = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = SidecarConfig(segment=args.segment, grpc_address=args.grpc,
                               metrics_address=args.metrics, policy_file=args.policy_file,
                               auth_token_file=args.auth_token_file, tls_cert=args.tls_cert,
                               tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                               record_file=args.record, controller=config_from_args(args))
        sidecar = Sidecar(config)
    except (ValueError, OSError) as error:
        print(f"vcap-sidecar: {error}", file=sys.stderr)
        return 2
    engine = None
    if args.simulate:
        engine = subprocess.Popen(
            [sys.executable, "-m", "vcap.engine_hook.sim", "--segment", args.segment, *sim_args])
    asyncio.run(_serve(sidecar, engine))
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
