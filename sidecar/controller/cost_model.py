"""The cost side of goodput: distinct experts as a function of live rows, and step time as a
function of distinct experts and batch size, both fitted from sampled telemetry records.

Expert union. The records carry, on sampled steps, the distinct experts of every layer over all
rows (``experts_all``, ``stride * bs`` rows) and over the live rows (``experts_live``). Per layer
the router's popularity is modelled as Zipf of exponent ``s`` over the ``E`` routed experts; a
row picks ``top_k`` distinct experts (without replacement), expert ``e`` with inclusion
probability ``q_e = 1 - (1 - p_e)^t``, ``t`` solved so that ``sum_e q_e = top_k``. Rows of one
request route alike, so ``n`` rows count as ``n / rho`` independent ones:

    D(n) = sum_e (1 - (1 - q_e)^(n / rho)),   1 <= rho <= stride

``E`` and ``top_k`` are known, so one operating point (a steady batch size) fixes ``s`` per layer:
the curve is then known at every number of rows. ``rho`` (one for the engine) needs points at
several row counts (a policy that caps gives them: live rows vary from step to step); until it
is identified it stays at its prior, 1 (independent rows). Samples are weighted by recency.

Step time: ``step_ns = alpha + beta * sum_l D_l + delta * live_rows + gamma * bs`` by weighted
least squares on sampled steps. ``live_rows`` are the rows through the MoE's grouped GEMM (the
sum of the live lengths): at a large batch the distinct experts saturate (every expert is read
whatever the cap) and the MoE cost follows the rows instead (measured on the H200 loop, bs 256,
uniform routing: 768 experts at every k, step 279 ms at ``off``, 203 ms at k=1). Each extra term
is kept only when it explains enough more variance. ``delta`` is identified only where the live
rows per request vary (a capping policy and its exploration steps); under a policy that verifies
every row they are ``stride * bs`` and the term is collinear with ``bs``. ``D`` is identified
where it spreads. A term that is not identified is split from the measured step as the modelled
cost splits it (``MODELLED_COST``, ``MODELLED_ROW_US``) until a change of policy shows it.
"""

import numpy as np

__all__ = ["ExpertCurve", "StepCostFit", "union_curves", "inclusion", "MODELLED_COST", "MODELLED_ROW_US"]

SKEW_GRID = np.round(np.arange(0.0, 3.0001, 0.025), 3)
# MODELLED (not measured) H200 cost of a verify step, per MoE layer and for the rest of the step:
# the prior split between fixed and per-expert time (microseconds, microseconds, milliseconds)
MODELLED_COST = (22.9, 11.05, 2.0)
# MODELLED per live row and MoE layer (microseconds): the compute-bound part of the grouped GEMM.
# Order of magnitude from the H200 loop (bf16 fused MoE, bs 256, uniform routing: 76 ms of a
# 279 ms step between 1536 and 512 live rows over 43 layers, 1.7 us) scaled down for MXFP4;
# not measured on the production engine. It matters only where nothing else identifies the term.
MODELLED_ROW_US = 1.0
_SMALL_ROWS = 48   # the row grid is every integer below this, then geometric


def inclusion(popularity: np.ndarray, top_k: int) -> np.ndarray:
    """Probability that a row's ``top_k`` distinct experts include each expert (``sum = top_k``)."""
    popularity = np.minimum(np.asarray(popularity, dtype=np.float64), 1 - 1e-12)
    log_miss = np.log1p(-popularity)
    low, high = float(top_k), 1e7
    for _ in range(80):   # bisection on t: sum_e 1 - (1 - p_e)^t is increasing in t
        middle = (low * high) ** 0.5
        if -np.expm1(middle * log_miss).sum() < top_k:
            low = middle
        else:
            high = middle
    return np.minimum(-np.expm1(low * log_miss), 1.0)


def _row_grid(max_rows: int) -> np.ndarray:
    small = np.arange(min(_SMALL_ROWS, max_rows + 1), dtype=np.float64)
    large = np.geomspace(_SMALL_ROWS, max(max_rows, _SMALL_ROWS), 160) if max_rows >= _SMALL_ROWS else []
    return np.unique(np.concatenate([small, large, [float(max_rows)]]))


def union_curves(num_experts: int, top_k: int, rows: np.ndarray, skews=SKEW_GRID) -> np.ndarray:
    """``[len(skews), len(rows)]`` expected distinct experts of ``rows`` independent rows."""
    rows = np.asarray(rows, dtype=np.float64)
    curves = np.empty((len(skews), len(rows)))
    for i, skew in enumerate(skews):
        popularity = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(skew)
        log_miss = np.log1p(-np.minimum(inclusion(popularity / popularity.sum(), top_k), 1 - 1e-12))
        curves[i] = num_experts - np.exp(np.outer(rows, log_miss)).sum(axis=1)
    return curves


def _r2(target: np.ndarray, predicted: np.ndarray, weights: np.ndarray | None = None) -> float:
    weights = np.ones_like(target) if weights is None else weights
    mean = np.average(target, weights=weights)
    spread = float((weights * (target - mean) ** 2).sum())
    if spread <= 1e-12 * float((weights * target ** 2).sum()):   # nothing to explain (saturated experts)
        return float("nan")
    return 1.0 - float((weights * (target - predicted) ** 2).sum()) / spread


def _weights(weights, count: int) -> np.ndarray:
    return np.ones(count) if weights is None else np.asarray(weights, dtype=np.float64)


class ExpertCurve:
    """Per-layer distinct experts of ``n`` live rows, fitted from sampled records."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, max_rows: int, max_rho: float = 1.0,
                 min_row_spread: float = 1.3):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.max_rows, self.min_row_spread = max_rows, min_row_spread
        self.grid = _row_grid(max_rows)
        self.curves = union_curves(num_experts, top_k, self.grid)
        self.rho_grid = np.round(np.arange(1.0, max(max_rho, 1.0) + 1e-9, 0.25), 2)
        # prior: uniform routing, independent rows, until data says otherwise
        self.skew_index = np.zeros(num_layers, dtype=np.int64)
        self.rho = 1.0
        self.rho_identified = False
        self.fitted = False
        self.r2 = float("nan")
        self._refresh()

    @property
    def skew(self) -> np.ndarray:
        return SKEW_GRID[self.skew_index]

    def _refresh(self) -> None:
        self.total_curve = self.curves[self.skew_index].sum(axis=0)

    def assume_skew(self, skew: float) -> None:
        """Every layer routes with Zipf exponent ``skew`` (nearest on the grid): a modelled router
        where no expert counts were recorded."""
        self.skew_index[:] = int(np.abs(SKEW_GRID - skew).argmin())
        self._refresh()

    def _basis(self, rows: np.ndarray, rho: float) -> np.ndarray:
        """``[skews, len(rows)]`` the curves at ``rows / rho``."""
        x = np.clip(rows / rho, 0, self.grid[-1])
        index = np.clip(np.searchsorted(self.grid, x, side="right") - 1, 0, len(self.grid) - 2)
        low, high = self.grid[index], self.grid[index + 1]
        fraction = (x - low) / (high - low)
        return self.curves[:, index] * (1 - fraction) + self.curves[:, index + 1] * fraction

    def fit(self, rows: np.ndarray, experts: np.ndarray, weights: np.ndarray | None = None) -> None:
        """``rows [samples]`` routed rows, ``experts [samples, layers]`` distinct experts each,
        ``weights [samples]`` (recency; default equal)."""
        rows = np.clip(np.asarray(rows, dtype=np.int64), 0, self.max_rows)
        experts = np.asarray(experts, dtype=np.float64)
        weights = _weights(weights, len(rows))
        keep = (rows > 0) & (weights > 0)
        if keep.sum() < 4 or experts.shape[1] != self.num_layers:
            return
        rows, experts, weights = rows[keep], experts[keep], weights[keep]
        # sufficient statistics per distinct row count: relative errors sum_i w (y / B - 1)^2
        values, group = np.unique(rows, return_inverse=True)
        w = np.bincount(group, weights=weights)
        y1 = np.stack([np.bincount(group, weights=weights * experts[:, l], minlength=len(values))
                       for l in range(self.num_layers)], axis=1)
        y2 = np.stack([np.bincount(group, weights=weights * experts[:, l] ** 2, minlength=len(values))
                       for l in range(self.num_layers)], axis=1)
        low, high = np.quantile(rows, [0.05, 0.95])
        self.rho_identified = len(self.rho_grid) > 1 and high >= self.min_row_spread * max(low, 1)
        best = None
        for rho in (self.rho_grid if self.rho_identified else [self.rho]):
            inverse = 1.0 / np.maximum(self._basis(values.astype(np.float64), rho), 1e-9)   # [skews, groups]
            residual = inverse ** 2 @ y2 - 2 * inverse @ y1 + w.sum()                       # [skews, layers]
            index = residual.argmin(axis=0)
            total = float(residual[index, np.arange(self.num_layers)].sum())
            if best is None or total < best[0] - 1e-9:
                best = (total, rho, index)
        _, self.rho, self.skew_index = best
        self._refresh()
        self.r2 = _r2(experts.sum(axis=1), self.total(rows), weights)
        self.fitted = True

    def total(self, rows) -> np.ndarray:
        """Distinct experts summed over layers for ``rows`` live rows (fractional rows interpolated)."""
        rows = np.clip(np.asarray(rows, dtype=np.float64), 0, self.max_rows) / self.rho
        return np.interp(rows, self.grid, self.total_curve)


def _spread(values: np.ndarray, weights: np.ndarray) -> float:
    """Weighted relative spread (sd / mean) of ``values``."""
    mean = np.average(values, weights=weights)
    return float(np.sqrt(np.average((values - mean) ** 2, weights=weights)) / max(abs(mean), 1e-12))


EXTRA_TERM_SHARE = 0.25    # of the unexplained variance an extra cost term must explain
EXTRA_TERM_MIN_R2 = 0.001  # and at least this much R^2


class StepCostFit:
    """``step_ns = alpha + beta * experts + delta * live_rows + gamma * bs`` fitted on sampled steps."""

    # ``min_samples`` sampled steps before a slope is fitted; from ``min_point_samples`` on, the
    # measured mean step split as the modelled cost splits it (one operating point), so a first
    # decision does not wait for 20 steps where a step takes a third of a second (bs 128 on the
    # H200 loop: 7 s, a cold start the telemetry's first steps already answer)
    def __init__(self, min_samples: int = 20, min_relative_spread: float = 0.02, num_layers: int | None = None,
                 min_point_samples: int = 5):
        self.min_samples, self.min_relative_spread = min_samples, min_relative_spread
        self.min_point_samples = min(min_point_samples, min_samples)
        self.num_layers = num_layers
        self.alpha = self.beta = self.gamma = self.delta = 0.0
        self.r2 = float("nan")
        self.samples = 0
        self.ready = self.identified = False
        self.rows_identified = False   # delta measured (live rows per request varied), not modelled

    def set_prior(self, alpha_ns: float, beta_ns: float, gamma_ns: float = 0.0, delta_ns: float = 0.0) -> None:
        """A modelled cost (no measurement): used by the offline tuner for the seed log."""
        self.alpha, self.beta, self.gamma, self.delta, self.ready = alpha_ns, beta_ns, gamma_ns, delta_ns, True
        self.identified = self.rows_identified = False

    def _modelled_shares(self, experts: float, rows: float) -> tuple[float, float]:
        """Fractions of a step the modelled cost gives the experts and the live rows."""
        per_layer_us, per_expert_us, other_ms = MODELLED_COST
        if not self.num_layers:
            return 1.0, 0.0   # no geometry: all MoE (overstates savings; the next fit corrects it)
        expert_us, row_us = per_expert_us * experts, MODELLED_ROW_US * self.num_layers * rows
        total = per_layer_us * self.num_layers + expert_us + row_us + other_ms * 1e3
        return expert_us / total, row_us / total

    def _assume_split(self, experts: float, rows: float, step_ns: float) -> None:
        """One operating point: split the measured step as the modelled cost splits it there."""
        expert_share, row_share = self._modelled_shares(experts, rows)
        self.beta = float(expert_share * step_ns / max(experts, 1.0))
        self.delta = float(row_share * step_ns / max(rows, 1.0)) if rows > 0 else 0.0
        self.alpha, self.gamma = float(step_ns - self.beta * experts - self.delta * rows), 0.0
        self.r2, self.identified, self.rows_identified = 0.0, False, False
        self.ready = self.beta > 0

    def fit(self, experts: np.ndarray, bs: np.ndarray, step_ns: np.ndarray, weights: np.ndarray | None = None,
            live_rows: np.ndarray | None = None) -> None:
        """Experts summed over layers, batch size, measured step time and (optionally) live rows
        of each sampled step."""
        weights = _weights(weights, len(step_ns))
        keep = (np.asarray(step_ns) > 0) & (weights > 0)
        experts = np.asarray(experts, dtype=np.float64)[keep]
        bs = np.asarray(bs, dtype=np.float64)[keep]
        step_ns = np.asarray(step_ns, dtype=np.float64)[keep]
        rows = None if live_rows is None else np.asarray(live_rows, dtype=np.float64)[keep]
        weights = weights[keep]
        self.samples = len(step_ns)
        if self.samples < self.min_point_samples:
            return
        mean_rows = float(np.average(rows, weights=weights)) if rows is not None else 0.0
        experts_vary = _spread(experts, weights) >= self.min_relative_spread
        # the rows term is told apart from bs only where the live rows per request vary
        rows_vary = rows is not None and mean_rows > 0 and \
            _spread(rows / np.maximum(bs, 1.0), weights) >= self.min_relative_spread
        if self.samples < self.min_samples or not (experts_vary or rows_vary):   # one operating point
            self._assume_split(float(np.average(experts, weights=weights)), mean_rows,
                               float(np.average(step_ns, weights=weights)))
            return
        root = np.sqrt(weights)
        ones = np.ones_like(experts)
        # candidate designs: (name of each column, columns); the first that identifies the slope
        # of every varying term is the base; an extra term must be positive and explain
        # EXTRA_TERM_SHARE of what the design without it left unexplained (at least
        # EXTRA_TERM_MIN_R2 of R^2). Over a drain the experts and the live rows move together: a
        # rows term then adds little R^2 but removes most of the error, and without it the
        # experts' slope takes the rows' cost and extrapolates to small batches with a negative
        # intercept (H200 loop, bs 150 -> 35: bs 8 predicted 1.42x the step at 3 rows a request
        # as at 2, measured 1.20x)
        base = [("alpha", ones)] + ([("beta", experts)] if experts_vary else []) + \
            ([("delta", rows)] if rows_vary and not experts_vary else [])
        extras = ([("delta", rows)] if rows_vary and experts_vary else []) + [("gamma", bs)]
        best = None
        for chosen in _subsets(extras):
            names, columns = zip(*(base + chosen))
            design = np.stack(columns, axis=1)
            coefficients, *_ = np.linalg.lstsq(design * root[:, None], step_ns * root, rcond=None)
            r2 = _r2(step_ns, design @ coefficients, weights)
            terms = dict(zip(names, coefficients))
            if any(terms[name] <= 0 for name in names[1:]):
                continue
            if best is None or r2 - best[1] > (len(chosen) - len(best[2])) * max(
                    EXTRA_TERM_MIN_R2, EXTRA_TERM_SHARE * (1.0 - best[1])):
                best = (terms, r2, chosen)
        if best is None:
            self._assume_split(float(np.average(experts, weights=weights)), mean_rows,
                               float(np.average(step_ns, weights=weights)))
            return
        terms, self.r2, _ = best
        self.alpha, self.gamma = float(terms["alpha"]), float(terms.get("gamma", 0.0))
        self.delta = float(terms.get("delta", 0.0))
        self.rows_identified = rows_vary
        if experts_vary:
            self.beta = float(terms["beta"])
        else:
            # the experts stayed put (saturated): their share of the intercept is the modelled one
            mean_experts = float(np.average(experts, weights=weights))
            expert_share, _ = self._modelled_shares(mean_experts, mean_rows)
            self.beta = float(expert_share * np.average(step_ns, weights=weights) / max(mean_experts, 1.0))
            self.alpha -= self.beta * mean_experts
        self.ready, self.identified = self.beta > 0 or self.delta > 0, True

    def predict(self, experts, bs, live_rows=None) -> np.ndarray:
        experts = np.asarray(experts, dtype=np.float64)
        rows = 0.0 if live_rows is None else np.asarray(live_rows, dtype=np.float64)
        return np.maximum(self.alpha + self.beta * experts + self.delta * rows
                          + self.gamma * np.asarray(bs, dtype=np.float64), 1.0)


def _subsets(items: list) -> list[list]:
    """Every subset of ``items``, smallest first."""
    subsets = [[]]
    for item in items:
        subsets += [subset + [item] for subset in subsets]
    return sorted(subsets, key=len)
