"""The rules of ``vcapctl set``: which flags go together, and the policy they make.

Every flag combination is either applied as written or refused with :class:`FlagConflict`
naming both flags; :func:`edit_policy` applies the accepted ones to the policy in force.
"""

from vcap.policy import Bucket, InvalidPolicy, Policy, describe, resolve

__all__ = ["FlagConflict", "SPEC_SYNTAX", "check_flags", "given_flags", "changes_policy", "parse_spec",
           "merge_buckets", "edit_policy"]

SPEC_SYNTAX = ("N (fixed k = N; 0 or off: every draft), conf:T (one threshold for every draft) or "
               "conf:a,b,c,d (thresholds of drafts 2..5; draft 1 always verified)")


class FlagConflict(ValueError):
    """Two ``vcapctl set`` flags that cannot both be applied as written."""


# (flag, flags it cannot go with, why); "--mode X" stands for that mode.
_POLICY_FLAGS = ("--threshold", "--thresholds", "--k", "--k-min", "--k-max", "--bucket", "--spec")
_CONFLICTS = (
    ("--mode auto", _POLICY_FLAGS + ("--explore-period", "--expected-generation", "--force", "--reason"),
     "--mode auto hands the policy to the controller, which chooses it; set the policy without "
     "--mode auto, or hand over without other flags"),
    ("--mode off", _POLICY_FLAGS, "mode off verifies every draft: no thresholds, k or bounds act"),
    ("--mode fixed", ("--threshold", "--thresholds", "--k-min", "--k-max", "--bucket", "--spec"),
     "mode fixed verifies exactly --k drafts: thresholds and bounds do not act"),
    ("--mode conf", ("--k", "--spec"), "--k selects fixed mode and --spec its own mode"),
    ("--spec", ("--threshold", "--thresholds", "--k", "--bucket"),
     "--spec gives the mode and thresholds itself"),
    ("--k", ("--threshold", "--thresholds", "--k-min", "--k-max", "--bucket"),
     "--k selects fixed mode, where thresholds and bounds do not act"),
    ("--threshold", ("--thresholds",), "give one threshold or one per draft, not both"),
    ("--bucket", ("--threshold", "--thresholds", "--k-min", "--k-max"),
     "--bucket replaces every bucket with its own thresholds and bounds: write them inside it "
     "(MIN_BS:THRESHOLDS[:KMIN-KMAX])"),
    ("--expected-generation", ("--force",), "--force skips the generation check --expected-generation asks for"),
)


def given_flags(args) -> list[str]:
    flags = [flag for flag, value in (
        ("--threshold", args.threshold), ("--thresholds", args.thresholds), ("--k", args.k),
        ("--k-min", args.k_min), ("--k-max", args.k_max), ("--bucket", args.bucket or None),
        ("--spec", args.spec), ("--explore-period", args.explore_period),
        ("--expected-generation", args.expected_generation), ("--force", args.force or None),
        ("--reason", args.reason or None)) if value is not None]
    return ([f"--mode {args.mode}"] if args.mode else []) + flags


def check_flags(args) -> None:
    """Refuse ``set`` flags that cannot all be applied as written.

    Raises:
        FlagConflict: naming the two flags and why.
    """
    given = given_flags(args)
    for flag, others, why in _CONFLICTS:
        if flag in given:
            for other in others:
                if other in given:
                    raise FlagConflict(f"{flag} conflicts with {other}: {why}")
    changes = [flag for flag in given if flag in _POLICY_FLAGS + ("--explore-period",)]
    if args.mode == "manual" and not changes:
        for other in ("--expected-generation", "--force", "--reason"):
            if other in given:
                raise FlagConflict(f"--mode manual conflicts with {other}: taking control back writes no "
                                   "policy (add the policy flags to change it as well)")
    if args.spec is not None and (args.k_min is not None or args.k_max is not None):
        if parse_spec(args.spec, None)["mode"] != "conf":
            raise FlagConflict(f"--spec {args.spec} conflicts with --k-min/--k-max: only conf:... has bounds")


def changes_policy(args) -> bool:
    """Whether the ``set`` flags change the policy (not only the control mode)."""
    return args.mode in ("off", "fixed", "conf") or any(
        flag in _POLICY_FLAGS + ("--explore-period",) for flag in given_flags(args))


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
    try:
        if not spec.startswith("conf:"):
            return {"mode": "fixed", "fixed_k": int(spec)}
        values = tuple(float(v) for v in spec.split(":", 1)[1].split(","))
    except ValueError:
        raise InvalidPolicy(f"--spec {spec!r}: expected {SPEC_SYNTAX}") from None
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


def merge_buckets(buckets) -> tuple[Bucket, ...]:
    """Buckets sorted by ``min_bs``, each dropped when it repeats the rule of the one before."""
    merged = []
    for bucket in sorted(buckets, key=lambda b: b.min_bs):
        if merged and (merged[-1].k_min, merged[-1].k_max, merged[-1].thresholds) == \
                (bucket.k_min, bucket.k_max, bucket.thresholds):
            continue
        merged.append(bucket)
    return tuple(merged)


def edit_policy(current: Policy, args, num_drafts: int | None, current_source: str = "manual"
                ) -> tuple[Policy, list[str]]:
    """The current policy with the command line's changes applied, and notes on what else changed.

    A threshold set over bounds the controller wrote resets them to 1..all, so the threshold acts.
    """
    changes = parse_spec(args.spec, num_drafts) if args.spec is not None else {}
    notes = []
    mode = args.mode if args.mode in ("off", "fixed", "conf") else changes.get("mode")
    fixed_k = args.k if args.k is not None else changes.get("fixed_k", current.fixed_k)
    thresholds = changes.get("thresholds")
    if args.threshold is not None:
        thresholds = (args.threshold,)
    if args.thresholds is not None:
        thresholds = _floats(args.thresholds, "--thresholds")
    if mode is None:
        # a bucket carries thresholds: like --threshold, it selects conf mode
        mode = "fixed" if args.k is not None else "conf" if thresholds or args.bucket else current.mode
    if mode in ("off", "fixed") and (args.k_min is not None or args.k_max is not None):
        raise FlagConflict(f"--k-min and --k-max act only in conf mode, and the policy in force is "
                           f"{describe(current)}: give --mode conf (or --threshold) with them")
    if args.bucket:
        buckets = tuple(_parse_bucket(b) for b in args.bucket)
    else:
        bounds_given = args.k_min is not None or args.k_max is not None
        reset = thresholds is not None and not bounds_given and current_source == "auto"
        buckets = []
        for b in current.buckets:
            k_min = args.k_min if args.k_min is not None else 1 if reset else b.k_min
            k_max = args.k_max if args.k_max is not None else 0 if reset else b.k_max
            if reset and (b.k_min, b.k_max) != (1, 0) and (b.k_min, b.k_max) != (1, num_drafts):
                notes.append(f"bucket bs>={b.min_bs}: the controller's bounds k {b.k_min}..{b.k_max} reset to "
                             "1..all so the threshold acts (give --k-min/--k-max to set bounds)")
            buckets.append(Bucket(b.min_bs, k_min, k_max, thresholds if thresholds is not None else b.thresholds))
        buckets = merge_buckets(buckets) if reset else tuple(buckets)
    explore = args.explore_period if args.explore_period is not None else current.explore_period
    policy = Policy(mode=mode, fixed_k=fixed_k, buckets=buckets, explore_period=explore)
    if mode == "conf" and thresholds is not None and num_drafts:
        for b in resolve(policy, num_drafts).buckets:
            if b.k_min >= b.k_max:
                notes.append(f"bucket bs>={b.min_bs}: k {b.k_min}..{b.k_max} leaves the thresholds no room to "
                             "act (give --k-min 1 to let them)")
    return policy, notes
