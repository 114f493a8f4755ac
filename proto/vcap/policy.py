"""The verify policy: what the control block carries and how it is validated.

A policy tells the engine how many drafts each request verifies this step:

- ``off``: every row live (exactly the engine's own behaviour);
- ``fixed``: ``k = fixed_k`` drafts for every request;
- ``conf``: per request, ``k`` = the number of leading drafts whose running product of the
  draft head's per-position survival stays >= the threshold of that position, clamped to
  ``[k_min, k_max]``. Thresholds, ``k_min`` and ``k_max`` come from the batch-size bucket
  of the step's real (unpadded) batch size: the last bucket whose ``min_bs <= bs``.

Validation raises :class:`InvalidPolicy` (a ``ValueError``) naming the first problem found;
nothing is written by a caller that validates first.
"""

import math
from dataclasses import dataclass

__all__ = [
    "MODES", "MAX_DRAFTS", "Bucket", "Policy", "InvalidPolicy", "default_policy", "resolve",
    "rule_at", "validate", "validated",
]

MODES = ("off", "fixed", "conf")
# Upper bound on drafts per request a policy may describe before the engine's stride is known.
MAX_DRAFTS = 32
# Largest batch size a bucket may name (the segment's max_bs is at most this).
MAX_BATCH_SIZE = 65536


class InvalidPolicy(ValueError):
    """A policy that must not reach the engine; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """Thresholds and bounds used when the step's batch size is >= ``min_bs``.

    Before an engine is known, ``k_max = 0`` stands for "every draft" and a single threshold
    for "the same for every draft"; :func:`resolve` fills both in from the engine's stride.
    """

    min_bs: int
    k_min: int
    k_max: int
    thresholds: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Policy:
    """A whole policy. ``buckets`` are sorted by ``min_bs``; the first starts at 1."""

    mode: str
    fixed_k: int
    buckets: tuple[Bucket, ...]
    # Every ``explore_period``-th engine step verifies every row (0: never), so the
    # controller sees what capped drafts would have done.
    explore_period: int = 0

    def bucket_for(self, bs: int) -> Bucket:
        """The bucket a step of real batch size ``bs`` uses."""
        chosen = self.buckets[0]
        for bucket in self.buckets:
            if bucket.min_bs <= bs:
                chosen = bucket
        return chosen


def describe(policy: Policy | None) -> str:
    """One line for logs and ``vcapctl``: ``conf explore 16 | bs>=1 k 1..all t 0,0.5 | bs>=32 ...``.
    Thresholds read as written (``0.3``, not the float32 ``0.30000001192092896``)."""
    if policy is None:
        return "none"
    head = policy.mode + (f" k={policy.fixed_k}" if policy.mode == "fixed" else "")
    head += f" explore {policy.explore_period}" if policy.explore_period else ""
    if policy.mode != "conf":
        return head
    return " | ".join([head] + [
        f"bs>={b.min_bs} k {b.k_min}..{b.k_max or 'all'} t {','.join(f'{t:.6g}' for t in b.thresholds)}"
        for b in policy.buckets])


def default_policy(num_drafts: int | None = None, mode: str = "off") -> Policy:
    """All drafts verified: the engine's own behaviour, and the usual fallback.

    ``num_drafts=None`` (no engine known yet) spells "every draft" as ``k_max = 0`` and one
    threshold, which :func:`resolve` fills in; its ``fixed_k`` is 1, the smallest valid one.
    """
    if num_drafts is None:
        return Policy(mode=mode, fixed_k=1, buckets=(Bucket(1, 1, 0, (0.0,)),))
    bucket = Bucket(1, 1, num_drafts, (0.0,) * num_drafts)
    return Policy(mode=mode, fixed_k=num_drafts, buckets=(bucket,))


def resolve(policy: Policy, num_drafts: int) -> Policy:
    """The policy spelled out for an engine verifying ``num_drafts`` drafts per request."""
    buckets = tuple(
        Bucket(b.min_bs, b.k_min, b.k_max or num_drafts,
               b.thresholds * num_drafts if len(b.thresholds) == 1 else b.thresholds)
        for b in policy.buckets)
    return Policy(policy.mode, policy.fixed_k, buckets, policy.explore_period)


def rule_at(policy: Policy, bs: int, num_drafts: int) -> Bucket:
    """The rule ``policy`` applies to a step of batch size ``bs``, spelled as a ``conf`` bucket
    from batch size 1: ``off`` verifies every draft, ``fixed`` exactly ``fixed_k``."""
    if policy.mode == "off":
        return Bucket(1, num_drafts, num_drafts, (0.0,) * num_drafts)
    if policy.mode == "fixed":
        k = min(max(policy.fixed_k, 1), num_drafts)
        return Bucket(1, k, k, (0.0,) * num_drafts)
    bucket = resolve(policy, num_drafts).bucket_for(bs)
    return Bucket(1, bucket.k_min, bucket.k_max, tuple(bucket.thresholds))


def validated(policy: Policy, num_drafts: int | None, max_buckets: int = 8) -> Policy:
    """``policy`` spelled out for the engine (:func:`resolve`, when ``num_drafts`` is known) and
    checked whole (:func:`validate`).

    Raises:
        InvalidPolicy: naming the first field that is wrong.
    """
    resolved = resolve(policy, num_drafts) if num_drafts else policy
    validate(resolved, num_drafts, max_buckets)
    return resolved


def validate(policy: Policy, num_drafts: int | None, max_buckets: int = 8) -> None:
    """Check a whole policy against the engine's drafts per request (``STRIDE - 1``).

    ``num_drafts=None`` (no engine attached yet) checks everything that does not depend on
    it; the policy is checked again when an engine attaches.

    Raises:
        InvalidPolicy: naming the first field that is wrong.
    """
    limit = MAX_DRAFTS if num_drafts is None else num_drafts
    if policy.mode not in MODES:
        raise InvalidPolicy(f"mode must be one of {', '.join(MODES)}, got {policy.mode!r}")
    if policy.mode == "fixed" and not 1 <= policy.fixed_k <= limit:
        raise InvalidPolicy(f"fixed k must be in 1..{limit}, got {policy.fixed_k}")
    if not 0 <= policy.fixed_k <= limit:  # unused outside fixed mode, but stored all the same
        raise InvalidPolicy(f"fixed k must be in 0..{limit}, got {policy.fixed_k}")
    if not 0 <= policy.explore_period <= 1_000_000:
        raise InvalidPolicy(f"explore period must be in 0..1000000, got {policy.explore_period}")
    if not 1 <= len(policy.buckets) <= max_buckets:
        raise InvalidPolicy(f"a policy needs 1..{max_buckets} buckets, got {len(policy.buckets)}")
    previous_min_bs = 0
    for i, bucket in enumerate(policy.buckets):
        where = f"bucket {i} (min_bs {bucket.min_bs})"
        if not 1 <= bucket.min_bs <= MAX_BATCH_SIZE:
            raise InvalidPolicy(f"{where}: min_bs must be in 1..{MAX_BATCH_SIZE}")
        if i == 0 and bucket.min_bs != 1:
            raise InvalidPolicy(f"{where}: the first bucket must start at batch size 1")
        if bucket.min_bs <= previous_min_bs:
            raise InvalidPolicy(
                f"{where}: buckets must be sorted by min_bs without overlap "
                f"(follows min_bs {previous_min_bs})")
        previous_min_bs = bucket.min_bs
        k_max = (bucket.k_max or limit) if num_drafts is None else bucket.k_max
        if not 1 <= bucket.k_min <= k_max <= limit:
            raise InvalidPolicy(
                f"{where}: need 1 <= k_min <= k_max <= {limit}, "
                f"got k_min {bucket.k_min}, k_max {bucket.k_max}")
        count = len(bucket.thresholds)
        if num_drafts is not None and count != num_drafts:
            raise InvalidPolicy(
                f"{where}: {count} thresholds given, the engine verifies {num_drafts} drafts")
        if not 1 <= count <= limit:
            raise InvalidPolicy(f"{where}: need 1..{limit} thresholds, got {count}")
        for position, value in enumerate(bucket.thresholds, start=1):
            if math.isnan(value) or not 0.0 <= value <= 1.0:
                raise InvalidPolicy(f"{where}: threshold of draft {position} must be in [0, 1], got {value}")
