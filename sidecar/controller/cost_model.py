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

Step time: ``step_ns = alpha + beta * sum_l D_l + gamma * bs`` by weighted least squares on sampled
steps; the ``bs`` term is kept only when it explains enough more variance (it is collinear with
``D`` under a steady policy). At one operating point the slope is not identified: the step is
split as the modelled H200 cost splits it (``MODELLED_COST``) until a change of policy shows it.
"""

import numpy as np

__all__ = ["ExpertCurve", "StepCostFit", "union_curves", "inclusion", "MODELLED_COST"]

SKEW_GRID = np.round(np.arange(0.0, 3.0001, 0.025), 3)
# MODELLED (not measured) H200 cost of a verify step, per MoE layer and for the rest of the step:
# the prior split between fixed and per-expert time (microseconds, microseconds, milliseconds)
MODELLED_COST = (22.9, 11.05, 2.0)
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
    if spread <= 0:
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


class StepCostFit:
    """``step_ns = alpha + beta * experts + gamma * bs`` fitted on sampled steps."""

    def __init__(self, min_samples: int = 20, min_relative_spread: float = 0.02, num_layers: int | None = None):
        self.min_samples, self.min_relative_spread = min_samples, min_relative_spread
        self.num_layers = num_layers
        self.alpha = self.beta = self.gamma = 0.0
        self.r2 = float("nan")
        self.samples = 0
        self.ready = self.identified = False

    def set_prior(self, alpha_ns: float, beta_ns: float, gamma_ns: float = 0.0) -> None:
        """A modelled cost (no measurement): used by the offline tuner for the seed log."""
        self.alpha, self.beta, self.gamma, self.ready = alpha_ns, beta_ns, gamma_ns, True
        self.identified = False

    def _assume_split(self, experts: float, step_ns: float) -> None:
        """One operating point: split the measured step as the modelled cost splits it there."""
        per_layer_us, per_expert_us, other_ms = MODELLED_COST
        if self.num_layers:
            variable = per_expert_us * experts / (per_layer_us * self.num_layers + per_expert_us * experts + other_ms * 1e3)
        else:
            variable = 1.0   # no geometry: all MoE (overstates savings; the next fit corrects it)
        self.beta = float(variable * step_ns / max(experts, 1.0))
        self.alpha, self.gamma = float(step_ns - self.beta * experts), 0.0
        self.r2, self.identified = 0.0, False
        self.ready = self.beta > 0

    def fit(self, experts: np.ndarray, bs: np.ndarray, step_ns: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Experts summed over layers, batch size and measured step time of each sampled step."""
        weights = _weights(weights, len(step_ns))
        keep = (np.asarray(step_ns) > 0) & (weights > 0)
        experts = np.asarray(experts, dtype=np.float64)[keep]
        bs = np.asarray(bs, dtype=np.float64)[keep]
        step_ns = np.asarray(step_ns, dtype=np.float64)[keep]
        weights = weights[keep]
        self.samples = len(step_ns)
        if self.samples < self.min_samples:
            return
        mean = np.average(experts, weights=weights)
        spread = np.sqrt(np.average((experts - mean) ** 2, weights=weights))
        if spread < self.min_relative_spread * max(mean, 1.0):
            self._assume_split(mean, float(np.average(step_ns, weights=weights)))
            return
        root = np.sqrt(weights)
        ones = np.ones_like(experts)
        fits = []
        for columns in ((ones, experts), (ones, experts, bs)):
            design = np.stack(columns, axis=1)
            coefficients, *_ = np.linalg.lstsq(design * root[:, None], step_ns * root, rcond=None)
            fits.append((coefficients, _r2(step_ns, design @ coefficients, weights)))
        (plain, plain_r2), (with_bs, with_bs_r2) = fits
        if with_bs_r2 - plain_r2 > 0.01 and with_bs[1] > 0:
            self.alpha, self.beta, self.gamma, self.r2 = with_bs[0], with_bs[1], with_bs[2], with_bs_r2
        else:
            self.alpha, self.beta, self.gamma, self.r2 = plain[0], plain[1], 0.0, plain_r2
        self.ready, self.identified = self.beta > 0, True

    def predict(self, experts, bs) -> np.ndarray:
        experts = np.asarray(experts, dtype=np.float64)
        return np.maximum(self.alpha + self.beta * experts + self.gamma * np.asarray(bs, dtype=np.float64), 1.0)
