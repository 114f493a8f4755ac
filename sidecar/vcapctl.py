"""``vcapctl``: read and change the policy of a running sidecar, and watch its statistics.

    vcapctl get
    vcapctl set --threshold 0.3                  # conf mode, one threshold for every draft
    vcapctl set --thresholds 0,0.5,0.3,0.2,0.1   # drafts 1..5
    vcapctl set --k 3                            # fixed k
    vcapctl set --spec conf:0.25,0.25,0.03,0.06  # the original adapter's syntax
    vcapctl set --bucket 1:0.1 --bucket 32:0.4:1-2
    vcapctl set --mode auto                      # hand control to the automatic controller
    vcapctl watch
    vcapctl tune trace.vcaprec                   # offline: recommend a policy from a recording
"""

import argparse
import sys

import grpc

from vcap.policy import Bucket, InvalidPolicy, Policy, default_policy, validated
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from . import tune
from .convert import policy_from_proto, policy_to_proto

__all__ = ["main", "parse_spec", "edit_policy"]


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise InvalidPolicy(f"{what}: expected comma-separated numbers, got {text!r}") from None


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidPolicy(f"{what}: expected an integer, got {text!r}") from None


def parse_spec(spec: str, num_drafts: int | None) -> dict:
    """The original adapter's ``DSV41_VERIFY_CAP`` syntax: ``N`` (fixed k), ``conf:T`` (one
    threshold), ``conf:a,b,c,d`` (drafts 2..5; draft 1 always verified, i.e. ``0,a,b,c,d``,
    padded with the last value to the engine's draft count)."""
    spec = spec.strip()
    if spec in ("off", "0", ""):
        return {"mode": "off"}
    if not spec.startswith("conf:"):
        return {"mode": "fixed", "fixed_k": _int(spec, "--spec")}
    values = _floats(spec.split(":", 1)[1], "--spec")
    if len(values) == 1:
        return {"mode": "conf", "thresholds": values}
    thresholds = (0.0,) + values
    if num_drafts:
        thresholds = (thresholds + (thresholds[-1],) * num_drafts)[:num_drafts]
    return {"mode": "conf", "thresholds": thresholds}


def _parse_bucket(text: str) -> Bucket:
    """``MIN_BS:THRESHOLDS[:KMIN-KMAX]``."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise InvalidPolicy(f"--bucket expects MIN_BS:THRESHOLDS[:KMIN-KMAX], got {text!r}")
    k_min, k_max = 1, 0
    if len(parts) == 3:
        low, _, high = parts[2].partition("-")
        k_min, k_max = _int(low, "--bucket k_min"), _int(high or low, "--bucket k_max")
    return Bucket(_int(parts[0], "--bucket min_bs"), k_min, k_max, _floats(parts[1], "--bucket thresholds"))


def edit_policy(current: Policy, args, num_drafts: int | None) -> Policy:
    """The current policy with the command line's changes applied."""
    changes = parse_spec(args.spec, num_drafts) if args.spec is not None else {}
    mode = args.mode or changes.get("mode")
    fixed_k = args.k if args.k is not None else changes.get("fixed_k", current.fixed_k)
    thresholds = changes.get("thresholds")
    if args.threshold is not None:
        thresholds = (args.threshold,)
    if args.thresholds is not None:
        thresholds = _floats(args.thresholds, "--thresholds")
    if mode is None:
        mode = "fixed" if args.k is not None else "conf" if thresholds else current.mode
    buckets = tuple(_parse_bucket(b) for b in args.bucket) if args.bucket else current.buckets
    if not args.bucket:
        buckets = tuple(
            Bucket(b.min_bs,
                   args.k_min if args.k_min is not None else b.k_min,
                   args.k_max if args.k_max is not None else b.k_max,
                   thresholds if thresholds is not None else b.thresholds)
            for b in buckets)
    explore = args.explore_period if args.explore_period is not None else current.explore_period
    return Policy(mode=mode, fixed_k=fixed_k, buckets=buckets, explore_period=explore)


def _channel(args) -> grpc.Channel:
    if args.tls_ca:
        def read(path):
            with open(path, "rb") as file:
                return file.read()
        credentials = grpc.ssl_channel_credentials(
            read(args.tls_ca), read(args.tls_key) if args.tls_key else None,
            read(args.tls_cert) if args.tls_cert else None)
        return grpc.secure_channel(args.target, credentials)
    return grpc.insecure_channel(args.target)


def _metadata(args):
    if not args.token_file:
        return None
    with open(args.token_file, encoding="utf-8") as file:
        return (("authorization", f"Bearer {file.read().strip()}"),)


def _print_state(state: pb.PolicyState) -> None:
    policy = policy_from_proto(state.policy) if state.policy.mode else None
    source = pb.PolicySource.Name(state.source).removeprefix("POLICY_SOURCE_").lower()
    control = pb.ControlMode.Name(state.control_mode).removeprefix("CONTROL_MODE_").lower()
    print(f"segment:    {state.segment} ({'attached' if state.engine_attached else 'no engine attached'}"
          f"{', drafts per request ' + str(state.num_drafts) + ', max bs ' + str(state.max_bs) if state.engine_attached else ''})")
    print(f"generation: {state.generation}{'  (pending: written when an engine attaches)' if state.pending else ''}")
    print(f"source:     {source}    control: {control}")
    if policy is None:
        return
    print(f"mode:       {policy.mode}" + (f"  k={policy.fixed_k}" if policy.mode == "fixed" else ""))
    if policy.explore_period:
        print(f"explore:    every {policy.explore_period} steps")
    for bucket in policy.buckets:
        thresholds = ",".join(f"{t:g}" for t in bucket.thresholds)
        print(f"bucket bs>={bucket.min_bs:<5} k {bucket.k_min}..{bucket.k_max or 'all'}  thresholds {thresholds}")


def _format_stats(stats: pb.Stats) -> str:
    saved = stats.experts_saved / max(stats.experts_saved + stats.experts_streamed, 1)
    tokens_per_step = stats.committed_tokens / max(stats.verify_steps, 1)
    acceptance = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
    return (f"steps {stats.verify_steps:>8} ({stats.steps_per_second:6.1f}/s)  gen {stats.policy_generation:>4}"
            f" (seen {stats.last_generation_seen})  L {stats.mean_live_length:4.2f}"
            f"  acc {stats.mean_accepted_drafts:4.2f}  tok/step {tokens_per_step:6.2f}"
            f"  saved {saved:6.1%}  accept/pos [{acceptance}]  drops {stats.telemetry_dropped}"
            f"{'  FALLBACK' if stats.engine_fallback_active else ''}"
            f"{'' if stats.engine_attached else '  (no engine)'}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vcapctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50061", help="sidecar HOST:PORT or unix:PATH")
    parser.add_argument("--token-file", help="bearer token for changes (when the sidecar requires one)")
    parser.add_argument("--tls-ca", help="CA of the sidecar's certificate (enables TLS)")
    parser.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="client key (mutual TLS)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("get", help="show the policy in force")
    edit = commands.add_parser("set", help="change the policy (manual control)")
    edit.add_argument("--mode", choices=("off", "fixed", "conf", "auto", "manual"))
    edit.add_argument("--threshold", type=float, help="one threshold for every draft (conf mode)")
    edit.add_argument("--thresholds", help="thresholds of drafts 1..N, comma-separated")
    edit.add_argument("--k", type=int, help="fixed number of drafts verified (fixed mode)")
    edit.add_argument("--k-min", type=int)
    edit.add_argument("--k-max", type=int)
    edit.add_argument("--bucket", action="append", default=[],
                      help="MIN_BS:THRESHOLDS[:KMIN-KMAX], repeatable; replaces every bucket")
    edit.add_argument("--explore-period", type=int, help="every Nth step verifies every row (0: never)")
    edit.add_argument("--spec", help="the original adapter's syntax: N, conf:T or conf:a,b,c,d")
    edit.add_argument("--expected-generation", type=int,
                      help="apply only if this is still the current generation (default: the one just read)")
    edit.add_argument("--force", action="store_true", help="apply even if the policy changed meanwhile")
    edit.add_argument("--reason", default="", help="kept in the sidecar's audit log")
    tune.build_parser(commands.add_parser(
        "tune", help="recommend a policy from a recorded trace (--record file or the seed's log)"))
    watch = commands.add_parser("watch", help="live statistics")
    watch.add_argument("--interval-ms", type=int, default=1000)
    watch.add_argument("--count", type=int, default=0, help="stop after N updates (0: never)")
    return parser


def _set(stub, args) -> None:
    metadata = _metadata(args)
    if args.mode in ("auto", "manual"):
        control = pb.CONTROL_MODE_AUTO if args.mode == "auto" else pb.CONTROL_MODE_MANUAL
        _print_state(stub.SetControlMode(pb.SetControlModeRequest(control_mode=control),
                                         timeout=args.timeout, metadata=metadata))
        return
    state = stub.GetPolicy(pb.GetPolicyRequest(), timeout=args.timeout)
    num_drafts = state.num_drafts or None
    current = policy_from_proto(state.policy) if state.policy.mode else default_policy()
    policy = edit_policy(current, args, num_drafts)
    validated(policy, num_drafts)
    request = pb.SetPolicyRequest(policy=policy_to_proto(policy), reason=args.reason)
    if args.expected_generation is not None:
        request.expected_generation = args.expected_generation
    elif not args.force:
        request.expected_generation = state.generation
    _print_state(stub.SetPolicy(request, timeout=args.timeout, metadata=metadata))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "tune":  # offline: no sidecar involved
        return tune.report(args)
    try:
        with _channel(args) as channel:
            stub = pb_grpc.ControllerStub(channel)
            if args.command == "get":
                _print_state(stub.GetPolicy(pb.GetPolicyRequest(), timeout=args.timeout))
            elif args.command == "set":
                _set(stub, args)
            else:
                for i, stats in enumerate(stub.WatchStats(pb.WatchStatsRequest(interval_ms=args.interval_ms)), 1):
                    print(_format_stats(stats), flush=True)
                    if args.count and i >= args.count:
                        break
    except InvalidPolicy as error:
        print(f"vcapctl: invalid policy: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        print(f"vcapctl: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
