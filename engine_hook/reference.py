"""The reference rule: what the engine does each verify step with a policy, in plain numpy.

The GPU kernels must match it exactly; the simulated engine uses it as is. Shapes: ``bs``
requests, ``stride = drafts + 1`` verify rows per request (the anchor, then drafts 1..D),
rows request-major (row ``r`` is request ``r // stride``, position ``r % stride``).

The confidence of draft ``i`` is the draft head's per-position conditional survival (computed
from drafts before ``i`` only), so cutting on its running product is a stopping rule: it never
looks at the token it drops, and the committed tokens are exactly those of a verify with
``k`` drafts.
"""

import numpy as np

from vcap.policy import Policy

__all__ = [
    "live_lengths", "dead_row_mask", "remap_dead_rows", "cap_accepted", "distinct_experts",
]


def live_lengths(confidence: np.ndarray | None, policy: Policy, bs: int, stride: int,
                 explore: bool = False) -> np.ndarray:
    """``L[b] = 1 + k[b]`` for the ``bs`` real requests of a step.

    ``off``, an exploration step or a missing confidence: every row live (``L = stride``).
    ``fixed``: ``k = fixed_k``. ``conf``: ``k`` = the leading drafts whose running product of
    survival is >= their threshold, clamped to ``[k_min, k_max]`` of the step's bucket. Every
    policy value is clamped to ``1..stride-1`` so a corrupt policy costs speed, not correctness.
    """
    num_drafts = stride - 1
    if policy.mode == "fixed" and not explore:
        k = np.full(bs, int(np.clip(policy.fixed_k, 1, num_drafts)), dtype=np.int64)
        return k + 1
    if policy.mode != "conf" or explore or confidence is None or not policy.buckets:
        return np.full(bs, stride, dtype=np.int64)
    bucket = policy.bucket_for(bs)
    k_min = int(np.clip(bucket.k_min, 1, num_drafts))
    k_max = int(np.clip(bucket.k_max, k_min, num_drafts))
    thresholds = np.asarray(bucket.thresholds, dtype=np.float32)[:num_drafts]
    survival = np.nan_to_num(np.asarray(confidence[:bs, :num_drafts], dtype=np.float32), nan=0.0)
    # float32 like the kernels, accumulated left to right like torch.cumprod
    running = np.cumprod(np.clip(survival, 0.0, 1.0), axis=1, dtype=np.float32)
    passes = running >= thresholds[None, :]
    k = np.cumprod(passes, axis=1).sum(axis=1)
    return np.clip(k, k_min, k_max).astype(np.int64) + 1


def dead_row_mask(live: np.ndarray, stride: int, num_rows: int | None = None) -> np.ndarray:
    """True for verify rows past their request's live length. Rows of requests beyond
    ``len(live)`` (padding) are dead except their anchor (``L = 1``)."""
    num_rows = len(live) * stride if num_rows is None else num_rows
    rows = np.arange(num_rows)
    request, position = rows // stride, rows % stride
    padded_live = np.ones(max(num_rows // stride + 1, len(live)), dtype=np.int64)
    padded_live[:len(live)] = live
    return position >= padded_live[request]


def remap_dead_rows(ids: np.ndarray, weights: np.ndarray, live: np.ndarray, stride: int,
                    strategy: str = "drop") -> tuple[np.ndarray, np.ndarray]:
    """Router output with dead rows adding no experts of their own (returns copies).

    ``drop``: id -1 and weight 0, as SGLang's router does for padded rows (not computed, not
    dispatched). ``anchor``: the anchor row's ids and weights (the original adapter's way;
    works with every backend).
    """
    if strategy not in ("drop", "anchor"):
        raise ValueError(f"strategy must be 'drop' or 'anchor', got {strategy!r}")
    dead = dead_row_mask(live, stride, ids.shape[0])
    ids, weights = ids.copy(), weights.copy()
    if strategy == "drop":
        ids[dead] = -1
        weights[dead] = 0
    else:
        anchor = (np.nonzero(dead)[0] // stride) * stride
        ids[dead] = ids[anchor]
        weights[dead] = weights[anchor]
    return ids, weights


def cap_accepted(accepted: np.ndarray, live: np.ndarray) -> np.ndarray:
    """The engine's cutoff: at most ``L - 1`` drafts accepted."""
    return np.minimum(accepted, live - 1)


def distinct_experts(ids: np.ndarray, rows: np.ndarray | None = None) -> int:
    """Distinct expert ids (ignoring -1) over ``ids [M, top_k]``, optionally only ``rows``."""
    chosen = ids if rows is None else ids[rows]
    values = np.unique(chosen)
    return int((values >= 0).sum())
