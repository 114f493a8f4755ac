"""The static rules every benchmark judges auto against, and their labels.

``GRID`` is the full grid issue 12 asks for (fixed k 1-4 and ``off``, thresholds 0.05-0.9 on the
running product of draft confidence, thresholds with k bounds); ``SHORT`` the seven rules the H200
loop ran up to its run 22. A label spells its rule: ``off``, ``k=K``, ``conf<T>`` (threshold T,
k 1-5), ``conf<T>k<K>`` (k 1-K) and ``conf<T>k<A>-<B>`` (k A-B)."""

import re

from vcap.policy import Bucket, Policy, default_policy

__all__ = ["D", "GRID", "SHORT", "rule", "rules"]

D = 5   # drafts per request, as in every benchmark

_LABEL = re.compile(r"conf(?P<t>\d*\.?\d+)(?:k(?:(?P<k_min>\d)-)?(?P<k_max>\d))?")


def rule(label: str) -> Policy:
    """The one-bucket policy a label spells; ValueError for anything else."""
    if label == "off":
        return default_policy(D)
    if label.startswith("k=") and label[2:].isdigit() and 1 <= int(label[2:]) <= D:
        return Policy("fixed", int(label[2:]), (Bucket(1, 1, D, (0.0,) * D),))
    match = _LABEL.fullmatch(label)
    if match is None:
        raise ValueError(f"{label!r} is not a rule label (off, k=2, conf0.3, conf0.3k3, conf0.3k2-5)")
    threshold, k_min, k_max = float(match["t"]), int(match["k_min"] or 1), int(match["k_max"] or D)
    if not (0 < threshold < 1 and 1 <= k_min <= k_max <= D):
        raise ValueError(f"{label!r}: need a threshold in (0, 1) and 1 <= k_min <= k_max <= {D}")
    return Policy("conf", D, (Bucket(1, k_min, k_max, (threshold,) * D),))


def rules(labels) -> dict[str, Policy]:
    return {label: rule(label) for label in labels}


GRID = rules(["off", *(f"k={k}" for k in range(1, D)),
              *(f"conf{t:g}" for t in (0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)),
              *(f"conf{t:g}k{k}" for t in (0.1, 0.3) for k in (2, 3)),
              *(f"conf{t:g}k2-5" for t in (0.3, 0.6))])
SHORT = rules(["off", "k=1", "k=2", "k=3", "k=4", "conf0.1", "conf0.3"])
