"""``vcapctl``: read and change the policy of a running sidecar, and watch its statistics.

    vcapctl get
    vcapctl set --threshold 0.3                  # conf mode, one threshold for every draft
    vcapctl set --thresholds 0,0.5,0.3,0.2,0.1   # drafts 1..5
    vcapctl set --k 3                            # fixed k
    vcapctl set --spec conf:0.25,0.25,0.03,0.06  # the original adapter's syntax
    vcapctl set --bucket 1:0.1 --bucket 32:0.4:1-2
    vcapctl set --mode auto                      # hand control to the automatic controller
    vcapctl watch
    vcapctl history                              # the last policies applied, newest first
    vcapctl rollback [GENERATION]                # apply one again (default: the one before)
    vcapctl tune trace.vcaprec                   # offline: recommend a policy from a recording
    vcapctl -o json get                          # the reply as JSON (watch: one object per line)

Beyond loopback the sidecar wants its token on every call and TLS:
    vcapctl --target vcap.example:50061 --tls-ca ca.pem --token-file token get

Flags that contradict each other (``--bucket`` with ``--threshold``, ``--mode auto`` with a
policy flag...) are refused, naming both; nothing is written. Any change but ``--mode auto`` ends
automatic control, and says so.
"""

import argparse
import datetime
import os
import sys
from typing import NamedTuple

import grpc
from google.protobuf import json_format

from vcap.policy import InvalidPolicy, default_policy, describe, validated
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from . import tune
from .convert import policy_from_proto, policy_to_proto
from .policy_control import audit_text
from .policy_edit import (SPEC_SYNTAX, FlagConflict, changes_policy, check_flags, edit_policy, merge_buckets,
                          parse_spec)
from .server import MIN_WATCH_INTERVAL_MS
from .version import version_text

__all__ = ["main", "parse_spec", "edit_policy", "merge_buckets", "check_flags", "FlagConflict",
           "UsageError", "DEFAULT_PORT", "normalized_target", "WATCH_COLUMNS"]

DEFAULT_PORT = 50061
_METRICS_PORT = 9461
WATCH_COLUMNS = """columns of `vcapctl watch`; L, acc, tok/step and saved cover the steps since
the line before (the first line, and every line with --totals: since the sidecar started), so a
policy change shows on the next line; "-" where no step came in between:
  steps N (R/s)   verify steps read from the engine since the sidecar started, and per second lately
  gen G (seen S)  policy generation written by the sidecar; the newest generation the engine
                  reported in a telemetry record (equal once the engine applies it)
  L               mean live length per request: 1 + drafts verified
  acc             mean accepted drafts per request (without the bonus token)
  tok/step        committed tokens per verify step, whole batch (accepted + 1 per request)
  saved           share of experts per layer that only dead rows would have streamed, on the
                  steps whose expert counts are sampled
  accept/pos      per draft position 1..N, since the sidecar started: accepted / verified with
                  every earlier draft accepted
  drops           telemetry records lost because the ring was overrun
  FALLBACK        the engine runs its own fallback policy (sidecar lease expired)
  (no engine)     no engine segment attached
  REJECTED T via S (gen G kept)
                  the last policy refused (at time T, from source S; `vcapctl get` says why);
                  generation G, in force then, stayed in force"""


def normalized_target(target: str) -> str:
    """``HOST`` -> ``HOST:50061``; ``HOST:PORT``, ``[v6]:PORT`` and gRPC URIs (``unix:``...) as given."""
    if "://" in target or target.split(":", 1)[0] in ("unix", "unix-abstract", "dns", "ipv4", "ipv6", "vsock"):
        return target
    if target.startswith("["):
        host, _, port = target.partition("]:")
        return _with_port(host + "]", port) if port else f"{target}:{DEFAULT_PORT}"
    if target.count(":") > 1:  # a bare IPv6 address
        return f"[{target}]:{DEFAULT_PORT}"
    host, _, port = target.partition(":")
    return _with_port(host, port) if port else f"{target}:{DEFAULT_PORT}"


def _with_port(host: str, port: str) -> str:
    """``HOST:PORT``, the port checked: grpc would wrap 99999 to another port without a word."""
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port {port!r} is not a number in 1..65535")
    return f"{host}:{port}"


def _rpc_error_text(error: grpc.RpcError, target: str) -> str:
    details = error.details() or ""
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        if "HTTP/2" in details or target.endswith(f":{_METRICS_PORT}"):
            return (f"{target} looks like vcap's metrics endpoint (HTTP/1, not gRPC); "
                    f"the gRPC port is {DEFAULT_PORT} by default (--target)")
        lowered = details.lower()
        if any(word in lowered for word in ("ssl", "handshake", "certificate", "tls", "verification")):
            return (f"the TLS handshake with {target} failed: does --tls-ca sign the sidecar's certificate, "
                    f"and does it name the target (--tls-server-name)? Without TLS the sidecar must "
                    f"listen in plaintext\n  ({details})")
        if "socket closed" in lowered or "connection reset" in lowered:
            return (f"{target} closed the connection: a sidecar started with --tls-cert needs --tls-ca "
                    f"(and its --token-file); else, is `vcap-sidecar` running there? (--target)\n  ({details})")
        return f"no vcap sidecar answers at {target}: is `vcap-sidecar` running? (--target)\n  ({details})"
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{target} did not answer within the timeout (--timeout): is it a vcap sidecar?"
    if error.code() == grpc.StatusCode.UNAUTHENTICATED:
        return f"UNAUTHENTICATED: {details} (--token-file)"
    return f"{error.code().name}: {details}"


class UsageError(ValueError):
    """Connection flags that cannot work together, or a file they name that cannot be read."""


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise UsageError(f"{flag} {path}: {error.strerror or error}") from None


def _channel(args) -> grpc.Channel:
    """TLS with ``--tls-ca`` (mutual with ``--tls-cert/--tls-key``), else plaintext."""
    tls_flags = [flag for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                          ("--tls-server-name", args.tls_server_name)) if value]
    if not args.tls_ca:
        if tls_flags:
            raise UsageError(f"{tls_flags[0]} needs --tls-ca (the CA of the sidecar's certificate)")
        return grpc.insecure_channel(args.target)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("mutual TLS needs both --tls-cert and --tls-key")
    credentials = grpc.ssl_channel_credentials(
        _read(args.tls_ca, "--tls-ca"), _read(args.tls_key, "--tls-key") if args.tls_key else None,
        _read(args.tls_cert, "--tls-cert") if args.tls_cert else None)
    options = (("grpc.ssl_target_name_override", args.tls_server_name),) if args.tls_server_name else None
    return grpc.secure_channel(args.target, credentials, options=options)


def _metadata(args):
    """The bearer token for every call (beyond loopback the sidecar wants it for reads too)."""
    if not args.token_file:
        return None
    token = _read(args.token_file, "--token-file").decode("utf-8", errors="replace").strip()
    return (("authorization", f"Bearer {token}"),)


def _number(value: float) -> str:
    """A float32 threshold as written (0.3, not 0.30000001192092896)."""
    return f"{value:.6g}"


def _json(message) -> str:
    """One line of JSON: the proto's field names, enums by name, defaults included."""
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None,
                                     always_print_fields_with_no_presence=True)


def _print_state(state: pb.PolicyState, args) -> None:
    if args.output == "json":
        print(_json(state))
        return
    policy = policy_from_proto(state.policy) if state.policy.mode else None
    source = pb.PolicySource.Name(state.source).removeprefix("POLICY_SOURCE_").lower()
    control = pb.ControlMode.Name(state.control_mode).removeprefix("CONTROL_MODE_").lower()
    # num_drafts without engine_attached: some attention-DP ranks' segments are attached, not all
    attached = "attached" if state.engine_attached else \
        "not every DP rank's segment attached" if state.num_drafts else "no engine attached"
    geometry = f", drafts per request {state.num_drafts}, max bs {state.max_bs}" if state.num_drafts else ""
    print(f"segment:    {state.segment} ({attached}{geometry})")
    print(f"generation: {state.generation}{'  (pending: written when the engine segments attach)' if state.pending else ''}")
    print(f"source:     {source}    control: {control}")
    if state.HasField("last_rejected"):
        print(f"rejected:   {_rejection_text(state.last_rejected)}")
    if policy is None:
        return
    print(f"mode:       {policy.mode}" + (f"  k={policy.fixed_k}" if policy.mode == "fixed" else ""))
    if policy.explore_period:
        print(f"explore:    every {policy.explore_period} steps")
    for bucket in policy.buckets:
        thresholds = ",".join(_number(t) for t in bucket.thresholds)
        print(f"bucket bs>={bucket.min_bs:<5} k {bucket.k_min}..{bucket.k_max or 'all'}  thresholds {thresholds}")


def _source_name(source: int) -> str:
    return pb.PolicySource.Name(source).removeprefix("POLICY_SOURCE_").lower()


def _time_text(time_unix: float) -> str:
    return datetime.datetime.fromtimestamp(time_unix).astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")


def _rejection_text(rejection: pb.PolicyRejection) -> str:
    # who and why are callers' text: escaped, so a newline or an escape sequence cannot forge a line
    return (f"{_time_text(rejection.time_unix)} via {_source_name(rejection.source)} by {audit_text(rejection.who)}: "
            f"{audit_text(rejection.reason)} (generation {rejection.generation} stayed in force)")


def _policy_text(policy: pb.Policy) -> str:
    return describe(policy_from_proto(policy)) if policy.mode else "?"


def _print_history(history: pb.PolicyHistory, current: int) -> None:
    kept = f"in {history.path}" if history.path else "in memory only (lost when the sidecar restarts)"
    print(f"policy history: {len(history.entries)} entr{'y' if len(history.entries) == 1 else 'ies'} shown, "
          f"the sidecar keeps {history.max_entries} {kept}")
    for entry in history.entries:
        mark = "*" if entry.generation == current else " "
        reason = audit_text(entry.reason) or (
            "" if not entry.rollback_of else f"rollback to generation {entry.rollback_of}")
        print(f"{mark}{entry.generation:>6}  {_time_text(entry.time_unix)}  {_source_name(entry.source):<6}  "
              f"{audit_text(entry.who)}{'  (' + reason + ')' if reason else ''}")
        print(f"        {_policy_text(entry.policy)}")


class _Counts(NamedTuple):
    """The totals of a Stats message that L, acc, tok/step and saved are ratios of."""

    steps: int
    requests: int
    rows_live: int
    drafts_accepted: int
    committed_tokens: int
    experts_saved: int
    experts_streamed: int

    @classmethod
    def of(cls, stats: pb.Stats) -> "_Counts":
        # request-steps are not sent: the server's mean live length is rows_live / requests
        requests = round(stats.rows_live / stats.mean_live_length) if stats.mean_live_length > 0 else 0
        return cls(stats.verify_steps, requests, stats.rows_live, stats.drafts_accepted,
                   stats.committed_tokens, stats.experts_saved, stats.experts_streamed)

    def since(self, earlier: "_Counts | None") -> "_Counts":
        """The counts since ``earlier``; all of them when there is none or a total went back
        (a restarted sidecar)."""
        if earlier is None or any(now < then for now, then in zip(self, earlier)):
            return self
        return _Counts(*(now - then for now, then in zip(self, earlier)))


def _ratio(text: str, numerator: int, denominator: int) -> str:
    return format(numerator / denominator, text) if denominator else "-"


def _format_stats(stats: pb.Stats, earlier: _Counts | None = None) -> str:
    """One line of `vcapctl watch`: L, acc, tok/step and saved over the steps since ``earlier``
    (the previous line's counts; None: since the sidecar started)."""
    counts = _Counts.of(stats).since(earlier)
    acceptance = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
    return (f"steps {stats.verify_steps:>8} ({stats.steps_per_second:6.1f}/s)  gen {stats.policy_generation:>4}"
            f" (seen {stats.last_generation_seen})  L {_ratio('4.2f', counts.rows_live, counts.requests):>4}"
            f"  acc {_ratio('4.2f', counts.drafts_accepted, counts.requests):>4}"
            f"  tok/step {_ratio('6.2f', counts.committed_tokens, counts.steps):>6}"
            f"  saved {_ratio('6.1%', counts.experts_saved, counts.experts_saved + counts.experts_streamed):>6}"
            f"  accept/pos [{acceptance}]  drops {stats.telemetry_dropped}"
            f"{'  FALLBACK' if stats.engine_fallback_active else ''}"
            f"{'' if stats.engine_attached else '  (no engine)'}"
            + (f"  REJECTED {_time_text(stats.last_rejected.time_unix)[11:19]} via "
               f"{_source_name(stats.last_rejected.source)} (gen {stats.last_rejected.generation} kept)"
               if stats.HasField("last_rejected") else ""))


_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


def _integer(minimum: int, maximum: int):
    """An argparse type: an integer in ``[minimum, maximum]`` (the range of its proto field), so
    a bad value is a usage error, not a traceback from the message's constructor."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be in [{minimum}, {maximum}], got {value}")
        return value
    return integer


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vcapctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", type=normalized_target,
                        help=f"the sidecar's gRPC address: HOST[:PORT] (port {DEFAULT_PORT} when left out) "
                             "or unix:PATH (default: %(default)s)")
    parser.add_argument("--token-file", help="file with the sidecar's bearer token, sent with every call "
                                             "(changes need it; beyond loopback every call does)")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA of the sidecar's certificate (enables TLS)")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS, with --tls-key)")
    parser.add_argument("--tls-key", metavar="FILE", help="client key (mutual TLS, with --tls-cert)")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="the name the sidecar's certificate must carry, when --target does not "
                             "(e.g. a Service's DNS name reached through a port-forward)")
    parser.add_argument("--timeout", type=_seconds, default=5.0, help="seconds per call (default: %(default)s)")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="text, or the sidecar's reply as one line of JSON (proto field names; "
                             "watch: one line per update; notes go to stderr) (default: %(default)s)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version_text()}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("get", help="show the policy in force")
    edit = commands.add_parser(
        "set", help="change the policy (manual control)", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read the policy, apply the changes and write it back with the generation read. "
                    "Contradicting flags are refused, naming both; nothing is written. Any change but "
                    "--mode auto ends automatic control.")
    edit.add_argument("--mode", choices=("off", "fixed", "conf", "auto", "manual"),
                      help="off: every draft; fixed: --k drafts; conf: thresholds; auto: hand the policy to "
                           "the sidecar's controller; manual: take it back (with other flags: apply them)")
    edit.add_argument("--threshold", type=float, help="one threshold for every draft (conf mode)")
    edit.add_argument("--thresholds", help="thresholds of drafts 1..N, comma-separated (conf mode)")
    edit.add_argument("--k", type=int, help="fixed number of drafts verified (fixed mode)")
    edit.add_argument("--k-min", type=int, help="conf mode: verify at least this many drafts, in every bucket")
    edit.add_argument("--k-max", type=int, help="conf mode: verify at most this many drafts, in every bucket")
    edit.add_argument("--bucket", action="append", default=[], metavar="MIN_BS:THRESHOLDS[:KMIN-KMAX]",
                      help="the rule from batch size MIN_BS up, repeatable; replaces every bucket "
                           "(THRESHOLDS one value or one per draft; bounds default to 1..all)")
    edit.add_argument("--explore-period", type=int, help="every Nth step verifies every row (0: never)")
    edit.add_argument("--spec", help=f"the original adapter's DSV41_VERIFY_CAP syntax: {SPEC_SYNTAX}; "
                                     "the last value repeats up to the engine's draft count")
    edit.add_argument("--expected-generation", type=_integer(0, _U64),
                      help="apply only if this is still the current generation (default: the one just read)")
    edit.add_argument("--force", action="store_true", help="apply even if the policy changed meanwhile")
    edit.add_argument("--reason", default="", help="kept in the sidecar's audit log")
    tune.build_parser(commands.add_parser(
        "tune", help="recommend a policy from a recorded trace (--record file or the seed's log)"))
    watch = commands.add_parser("watch", help="live statistics, one line per update",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=WATCH_COLUMNS)
    watch.add_argument("--interval-ms", type=_integer(MIN_WATCH_INTERVAL_MS, _U32), default=1000,
                       help=f"milliseconds between updates, at least {MIN_WATCH_INTERVAL_MS} (default: %(default)s)")
    watch.add_argument("--count", type=_integer(0, _U64), default=0, help="stop after N updates (0: never)")
    watch.add_argument("--totals", action="store_true",
                       help="every line since the sidecar started, not since the line before")
    history = commands.add_parser("history", help="the last policies applied, newest first (* in force)")
    history.add_argument("--limit", type=_integer(0, _U32), default=20, help="entries shown, 0: all kept (default: %(default)s)")
    rollback = commands.add_parser(
        "rollback", help="apply a policy of the history again (a manual change, validated and audited)")
    rollback.add_argument("generation", type=_integer(0, _U64), nargs="?", default=0,
                          help="its generation (`vcapctl history`); default: the policy before the one in force")
    rollback.add_argument("--expected-generation", type=_integer(0, _U64),
                          help="apply only if this is still the current generation (default: the one just read)")
    rollback.add_argument("--force", action="store_true", help="apply even if the policy changed meanwhile")
    rollback.add_argument("--reason", default="", help="kept in the sidecar's audit log and history")
    return parser


def _set(stub, args) -> int:
    check_flags(args)
    metadata = _metadata(args)
    if not changes_policy(args):
        if args.mode is None:
            print("vcapctl set: nothing to change (give --mode, --threshold, --k, --bucket...; see "
                  "`vcapctl set --help`); nothing written", file=sys.stderr)
            return 2
        control = pb.CONTROL_MODE_AUTO if args.mode == "auto" else pb.CONTROL_MODE_MANUAL
        _print_state(stub.SetControlMode(pb.SetControlModeRequest(control_mode=control),
                                         timeout=args.timeout, metadata=metadata), args)
        return 0
    state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=args.timeout, metadata=metadata)
    num_drafts = state.num_drafts or None
    current = policy_from_proto(state.policy) if state.policy.mode else default_policy()
    source = pb.PolicySource.Name(state.source).removeprefix("POLICY_SOURCE_").lower()
    policy, notes = edit_policy(current, args, num_drafts, source)
    validated(policy, num_drafts)
    request = pb.SetPolicyRequest(policy=policy_to_proto(policy), reason=args.reason)
    _print_state(stub.SetPolicy(_guarded(request, args, state), timeout=args.timeout, metadata=metadata), args)
    for note in notes:
        print(f"note: {note}", file=_notes(args))
    _say_if_auto_ended(state, args)
    return 0


def _rollback(stub, args) -> int:
    metadata = _metadata(args)
    state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=args.timeout, metadata=metadata)
    request = pb.RollbackRequest(generation=args.generation, reason=args.reason)
    _print_state(stub.Rollback(_guarded(request, args, state), timeout=args.timeout, metadata=metadata), args)
    _say_if_auto_ended(state, args)
    return 0


def _guarded(request, args, state: pb.PolicyState):
    """A write applies only over the generation it was computed from (--expected-generation,
    else the one just read), unless --force."""
    if args.expected_generation is not None:
        request.expected_generation = args.expected_generation
    elif not args.force:
        request.expected_generation = state.generation
    return request


def _notes(args):
    """Where notes go: stdout beside text, stderr beside JSON (which stays parseable)."""
    return sys.stderr if args.output == "json" else sys.stdout


def _say_if_auto_ended(state: pb.PolicyState, args) -> None:
    if state.control_mode == pb.CONTROL_MODE_AUTO:
        print("control: auto -> manual (the controller no longer changes the policy; "
              "`vcapctl set --mode auto` hands it back)", file=_notes(args))


def _run(stub, args) -> int:
    metadata = _metadata(args)
    if args.command == "get":
        _print_state(stub.GetPolicy(pb.GetPolicyRequest(), timeout=args.timeout, metadata=metadata), args)
    elif args.command == "set":
        return _set(stub, args)
    elif args.command == "history":
        state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=args.timeout, metadata=metadata)
        # the engine's own policy (after an engine restart) is no entry of the history
        current = state.generation if state.source != pb.POLICY_SOURCE_ENGINE else 0
        history = stub.ListPolicyHistory(pb.ListPolicyHistoryRequest(limit=max(args.limit, 0)),
                                         timeout=args.timeout, metadata=metadata)
        if args.output == "json":
            print(_json(history))
        else:
            _print_history(history, current)
    elif args.command == "rollback":
        return _rollback(stub, args)
    else:
        stream = stub.WatchStats(pb.WatchStatsRequest(interval_ms=args.interval_ms), metadata=metadata)
        earlier = None
        for i, stats in enumerate(stream, 1):
            print(_json(stats) if args.output == "json" else _format_stats(stats, earlier), flush=True)
            if not args.totals:
                earlier = _Counts.of(stats)
            if args.count and i >= args.count:
                break
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "tune":  # offline: no sidecar involved
        return tune.report(args)
    try:
        with _channel(args) as channel:
            status = _run(pb_grpc.ControllerStub(channel), args)
        sys.stdout.flush()   # here, where a reader gone away is caught below
        return status
    except UsageError as error:
        print(f"vcapctl: {error}", file=sys.stderr)
        return 2
    except FlagConflict as error:
        print(f"vcapctl set: {error}; nothing written", file=sys.stderr)
        return 2
    except InvalidPolicy as error:
        print(f"vcapctl: invalid policy: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        print(f"vcapctl: {_rpc_error_text(error, args.target)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `vcapctl watch | head`: the reader is gone (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
