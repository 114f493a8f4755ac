"""The cost side of goodput: distinct experts as a function of live rows, and step time as a
function of distinct experts and batch size, both fitted from sampled telemetry records.

Expert union: per layer, ``D(n) = c * sum_e (1 - (1 - q_e)^n)`` for ``n`` routed rows, with
``q_e = 1 - (1 - pop_e)^top_k`` and ``pop_e`` a Zipf popularity of exponent ``s`` over the
engine's routed experts. ``s = 0`` is the uniform expected-union curve ``E * (1 - (1 - p)^n)``;
``s`` and the scale ``c`` are fitted per layer by grid search and least squares on relative errors. Every sampled step
gives two points: all rows (``stride * bs``) with ``experts_all`` and live rows with
``experts_live``.

Step time: ``step_ns = alpha + beta * sum_l D_l + gamma * bs`` by least squares on sampled
steps; the ``bs`` term is kept only when it explains enough more variance (it is collinear with
``D`` under a steady policy).
"""

import numpy as np

__all__ = ["ExpertCurve", "StepCostFit", "union_curves"]

SKEW_GRID = np.round(np.arange(0.0, 2.51, 0.1), 2)


def union_curves(num_experts: int, top_k: int, max_rows: int, skews=SKEW_GRID) -> np.ndarray:
    """``[len(skews), max_rows + 1]`` expected distinct experts of ``n`` rows, per Zipf exponent."""
    rows = np.arange(max_rows + 1, dtype=np.float64)
    curves = np.empty((len(skews), max_rows + 1))
    for i, skew in enumerate(skews):
        popularity = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(skew)
        popularity /= popularity.sum()
        included = -np.expm1(top_k * np.log1p(-np.minimum(popularity, 1 - 1e-12)))
        log_miss = np.log1p(-np.minimum(included, 1 - 1e-12))
        curves[i] = num_experts - np.exp(np.outer(rows, log_miss)).sum(axis=1)
    return curves


def _r2(target: np.ndarray, predicted: np.ndarray) -> float:
    spread = float(((target - target.mean()) ** 2).sum())
    if spread <= 0:
        return float("nan")
    return 1.0 - float(((target - predicted) ** 2).sum()) / spread


class ExpertCurve:
    """Per-layer distinct experts of ``n`` live rows, fitted from sampled records."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, max_rows: int):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.max_rows = max_rows
        self.curves = union_curves(num_experts, top_k, max_rows)
        # default: uniform routing, unit scale, until data says otherwise
        self.skew_index = np.zeros(num_layers, dtype=np.int64)
        self.scale = np.ones(num_layers)
        self.fitted = False
        self.r2 = float("nan")
        self.total_curve = self._total_curve()

    def _total_curve(self) -> np.ndarray:
        return (self.scale[:, None] * self.curves[self.skew_index]).sum(axis=0)

    def assume_skew(self, skew: float) -> None:
        """Every layer routes with Zipf exponent ``skew`` (nearest on the grid), unit scale: a
        modelled router where no expert counts were recorded."""
        self.skew_index[:] = int(np.abs(SKEW_GRID - skew).argmin())
        self.scale[:] = 1.0
        self.total_curve = self._total_curve()

    def fit(self, rows: np.ndarray, experts: np.ndarray) -> None:
        """``rows [samples]`` routed rows, ``experts [samples, layers]`` distinct experts each."""
        rows = np.clip(np.asarray(rows, dtype=np.int64), 0, self.max_rows)
        experts = np.asarray(experts, dtype=np.float64)
        if len(rows) < 4 or experts.shape[1] != self.num_layers:
            return
        basis = np.maximum(self.curves[:, rows], 1e-9)                # [skews, samples]
        # relative errors, so small batches (few rows) weigh as much as large ones
        ratio = experts[None, :, :] / basis[:, :, None]               # [skews, samples, layers]
        scale = ratio.mean(axis=1)                                    # [skews, layers]
        residual = ((ratio - scale[:, None, :]) ** 2).sum(axis=1)
        self.skew_index = residual.argmin(axis=0)
        self.scale = np.clip(scale[self.skew_index, np.arange(self.num_layers)], 0.05, 20.0)
        self.total_curve = self._total_curve()
        self.r2 = _r2(experts.sum(axis=1), self.total(rows))
        self.fitted = True

    def total(self, rows) -> np.ndarray:
        """Distinct experts summed over layers for ``rows`` live rows (fractional rows interpolated)."""
        rows = np.clip(np.asarray(rows, dtype=np.float64), 0, self.max_rows)
        return np.interp(rows, np.arange(self.max_rows + 1), self.total_curve)


class StepCostFit:
    """``step_ns = alpha + beta * experts + gamma * bs`` fitted on sampled steps."""

    def __init__(self, min_samples: int = 20, min_relative_spread: float = 0.02):
        self.min_samples, self.min_relative_spread = min_samples, min_relative_spread
        self.alpha = self.beta = self.gamma = 0.0
        self.r2 = float("nan")
        self.samples = 0
        self.ready = self.identified = False

    def set_prior(self, alpha_ns: float, beta_ns: float, gamma_ns: float = 0.0) -> None:
        """A modelled cost (no measurement): used by the offline tuner for the seed log."""
        self.alpha, self.beta, self.gamma, self.ready = alpha_ns, beta_ns, gamma_ns, True
        self.identified = False

    def fit(self, experts: np.ndarray, bs: np.ndarray, step_ns: np.ndarray) -> None:
        """Experts summed over layers, batch size and measured step time of each sampled step."""
        keep = np.asarray(step_ns) > 0
        experts = np.asarray(experts, dtype=np.float64)[keep]
        bs = np.asarray(bs, dtype=np.float64)[keep]
        step_ns = np.asarray(step_ns, dtype=np.float64)[keep]
        self.samples = len(step_ns)
        if self.samples < self.min_samples:
            return
        if experts.std() < self.min_relative_spread * max(experts.mean(), 1.0):
            # one operating point: the slope is not identified. Until a change of policy shows
            # it, assume the step is all MoE (it overstates savings; the next fit corrects it).
            self.alpha, self.gamma = 0.0, 0.0
            self.beta = float(step_ns.mean() / max(experts.mean(), 1.0))
            self.r2, self.identified = 0.0, False
            self.ready = self.beta > 0
            return
        ones = np.ones_like(experts)
        fits = []
        for columns in ((ones, experts), (ones, experts, bs)):
            design = np.stack(columns, axis=1)
            coefficients, *_ = np.linalg.lstsq(design, step_ns, rcond=None)
            fits.append((coefficients, _r2(step_ns, design @ coefficients)))
        (plain, plain_r2), (with_bs, with_bs_r2) = fits
        if with_bs_r2 - plain_r2 > 0.01 and with_bs[1] > 0:
            self.alpha, self.beta, self.gamma, self.r2 = with_bs[0], with_bs[1], with_bs[2], with_bs_r2
        else:
            self.alpha, self.beta, self.gamma, self.r2 = plain[0], plain[1], 0.0, plain_r2
        self.ready, self.identified = self.beta > 0, True

    def predict(self, experts, bs) -> np.ndarray:
        experts = np.asarray(experts, dtype=np.float64)
        return np.maximum(self.alpha + self.beta * experts + self.gamma * np.asarray(bs, dtype=np.float64), 1.0)
