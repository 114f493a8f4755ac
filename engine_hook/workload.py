"""The SYNTHETIC side of the simulated engine: load, requests, acceptance, confidence, router.

Nothing here is measured from a model; every number is a knob of ``vcap-sim``. The shapes are
chosen to look like DeepSeek-V4 MoE with a DSpark drafter (conditional acceptance decaying along
the block of drafts, Zipf-skewed expert popularity) so the sidecar has something realistic to
control, not to predict real throughput.
"""

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["LOAD_PATTERNS", "LoadPattern", "RequestPool", "PairedRequestDraws", "PairedTokenDraws", "AcceptanceModel",
           "Router"]

LOAD_PATTERNS = ("steady", "bursty", "shift", "ramp", "sine")

# Time constant of the load noise (an Ornstein-Uhlenbeck process on log demand): slow enough
# that the batch size wanders rather than jitters step to step.
_NOISE_TIME_CONSTANT_S = 5.0
# Redraw rounds for duplicate experts within a row; whatever is left after them is kept.
_DEDUPE_ROUNDS = 4
# 2^16 entries (128 KiB of int16) stay in cache; probabilities are rounded to 2^-16.
_TABLE_SIZE = 1 << 16


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warnings for very negative logits
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@dataclass(frozen=True, slots=True)
class LoadPattern:
    """How many requests the SYNTHETIC clients keep in one engine, over engine time.

    ``steady``: ``mean_bs``. ``shift``: ``mean_bs``, then ``shift_bs`` after ``shift_after_s``.
    ``bursty``: ``mean_bs`` with bursts of ``peak_bs`` for ``burst_duty`` of every ``period_s``.
    ``ramp``: a sawtooth from 1 to ``max_bs`` every ``period_s``. ``sine``: between ``mean_bs``
    and ``peak_bs`` with period ``period_s``.
    """

    kind: str
    mean_bs: int
    max_bs: int
    shift_bs: int
    shift_after_s: float
    peak_bs: int
    period_s: float
    burst_duty: float = 0.2

    def demand(self, time_s: float) -> float:
        """Requests wanted in the engine at engine time ``time_s`` (before noise)."""
        phase = (time_s % self.period_s) / self.period_s
        if self.kind == "steady":
            return float(self.mean_bs)
        if self.kind == "shift":
            return float(self.mean_bs if time_s < self.shift_after_s else self.shift_bs)
        if self.kind == "bursty":
            # the burst closes each period, so a run starts at the base load
            return float(self.peak_bs if phase >= 1.0 - self.burst_duty else self.mean_bs)
        if self.kind == "ramp":
            return 1.0 + (self.max_bs - 1) * phase
        if self.kind == "sine":
            return self.mean_bs + (self.peak_bs - self.mean_bs) * 0.5 * (1.0 - math.cos(2 * math.pi * phase))
        raise ValueError(f"load must be one of {', '.join(LOAD_PATTERNS)}, got {self.kind!r}")


class RequestPool:
    """The SYNTHETIC requests of one data-parallel group: at most ``max_bs`` running, the rest
    queued. Each request has a latent logit shift (positive: easier to draft) and an output
    length (geometric); it finishes once it has committed that many tokens. ``request_id`` counts
    admissions (the n-th request admitted has id n) and ``position`` the tokens each has committed."""

    def __init__(self, max_bs: int, mean_output_tokens: float, request_spread: float,
                 load_noise: float, rng: np.random.Generator):
        self.max_bs, self.rng = max_bs, rng
        self.mean_output_tokens, self.request_spread, self.load_noise = mean_output_tokens, request_spread, load_noise
        self.logit_shift = np.zeros(max_bs)
        self.remaining_tokens = np.zeros(max_bs, dtype=np.int64)
        self.request_id = np.zeros(max_bs, dtype=np.int64)
        self.position = np.zeros(max_bs, dtype=np.int64)
        self.num_admitted = 0
        self.num_running = 0
        self.num_queued = 0
        self._log_noise = 0.0
        self.token_draws: PairedTokenDraws | None = None   # set for paired runs

    def step_draws(self, drafts: int, fallback: np.random.Generator):
        """Where this step's acceptance and confidence draws come from: each running request's
        next tokens (``token_draws``, paired runs), else the engine's generator ``fallback``."""
        if self.token_draws is None:
            return fallback
        bs = self.num_running
        return self.token_draws.at(self.request_id[:bs], self.position[:bs], drafts)

    def admit(self, demand: float, elapsed_s: float) -> int:
        """Arrivals up to the noisy demand, then admission from the queue; returns bs (>= 1)."""
        decay = min(elapsed_s / _NOISE_TIME_CONSTANT_S, 1.0)
        self._log_noise += -self._log_noise * decay + self.load_noise * math.sqrt(2 * decay) * self.rng.standard_normal()
        wanted = max(1, round(demand * math.exp(self._log_noise)))
        # clients only add requests; a drop in demand shows as requests finishing
        self.num_queued += max(0, wanted - self.num_running - self.num_queued)
        admitted = min(self.max_bs - self.num_running, self.num_queued)
        new = slice(self.num_running, self.num_running + admitted)
        self.logit_shift[new] = self.rng.normal(0.0, self.request_spread, admitted) if self.request_spread > 0 else 0.0
        self.remaining_tokens[new] = self.rng.geometric(1.0 / self.mean_output_tokens, admitted)
        self.request_id[new] = np.arange(self.num_admitted, self.num_admitted + admitted)
        self.position[new] = 0
        self.num_admitted += admitted
        self.num_running += admitted
        self.num_queued -= admitted
        return self.num_running

    def commit(self, tokens: np.ndarray) -> int:
        """Count ``tokens`` committed per running request, retire finished ones; returns how many."""
        bs = self.num_running
        self.remaining_tokens[:bs] -= tokens
        self.position[:bs] += tokens
        keep = self.remaining_tokens[:bs] > 0
        kept = int(keep.sum())
        for values in (self.logit_shift, self.remaining_tokens, self.request_id, self.position):
            values[:kept] = values[:bs][keep]
        self.num_running = kept
        return bs - kept


class PairedRequestDraws:
    """Common random numbers for the simulator's request stream (stands in for a pool's generator;
    ``SimConfig.paired_requests``).

    The simulator draws the load noise (once per step), each request's logit shift and its output
    length from one generator per pool, so a policy that takes a different number of steps gets
    other requests. On the bursty trace the lengths of the ~100 requests of a burst set how long
    the batch stays large, and that alone moved off's goodput by several percent between seeds.
    Here the n-th request admitted has the same shift and length under every policy, and the
    load noise is driven by one Brownian path in engine time (each step's normal draw is the
    path's increment over that step, scaled to unit variance), so every policy sees the same
    demand. The comparison between policies is then paired."""

    _GRID_NS = 1_000_000  # the Brownian path's resolution: 1 ms of engine time

    def __init__(self, seed: int, pool: int, clock_ns):
        noise, shift, length = np.random.SeedSequence([seed, pool, 0x5EED]).spawn(3)
        self._noise, self._shift, self._length = (np.random.default_rng(s) for s in (noise, shift, length))
        self._clock_ns, self._path, self._last = clock_ns, np.zeros(1), 0

    def _brownian(self, index: int) -> float:
        if index >= len(self._path):  # extend the path by at least 10 s
            steps = self._noise.standard_normal(max(index + 1 - len(self._path), 10_000)) * (self._GRID_NS / 1e9) ** 0.5
            self._path = np.concatenate([self._path, self._path[-1] + np.cumsum(steps)])
        return float(self._path[index])

    def standard_normal(self):
        now = int(self._clock_ns()) // self._GRID_NS
        elapsed_s = (now - self._last) * self._GRID_NS / 1e9
        value = (self._brownian(now) - self._brownian(self._last)) / elapsed_s ** 0.5 if elapsed_s > 0 else 0.0
        self._last = now
        return value

    def normal(self, *args, **kwargs):
        return self._shift.normal(*args, **kwargs)

    def geometric(self, *args, **kwargs):
        return self._length.geometric(*args, **kwargs)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class PairedTokenDraws:
    """Common random numbers for acceptance and confidence (``SimConfig.paired_requests``).

    With :class:`PairedRequestDraws` every policy gets the same n-th request, but the draws of a
    step (each draft's acceptance, the confidence noise) came from one generator per engine, so
    they went to whichever request ran that step: two runs of one trace differed by the luck of
    their drafts, and a 10 s window of two rules 1% apart could rank them either way. Here the
    draws are a hash of (seed, pool, request, output token, stream): the draft proposing token
    ``t`` of the n-th request is accepted, and its confidence is noised, alike under every policy.
    Each draw is still uniform (normal) and independent of every other token's. A token drafted
    again in a later step (an earlier draft of that step was rejected) sees the same confidence
    noise again: its confidence is correlated across the steps that draft it."""

    _ACCEPT, _NOISE_A, _NOISE_B = 1, 2, 3   # streams

    def __init__(self, seed: int, pool: int):
        self._key = _mix64(np.array([(seed * 0x9E3779B97F4A7C15 + pool) % 2 ** 64], dtype=np.uint64))[0]

    def at(self, request_id: np.ndarray, position: np.ndarray, drafts: int) -> "_TokenDraws":
        """The draws of one step: ``[bs, drafts]``, draft j of row i proposing token ``position[i] + j``."""
        tokens = position.astype(np.uint64)[:, None] + np.arange(drafts, dtype=np.uint64)[None, :]
        request = _mix64(self._key ^ (request_id.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)))
        return _TokenDraws(request[:, None] ^ (tokens * np.uint64(0xAEF17502108EF2D9)))


def _uniform(keys: np.ndarray, stream: int) -> np.ndarray:
    """A uniform draw in [0, 1) per key and stream (53 bits of a hash)."""
    bits = _mix64(_mix64(keys + np.uint64(stream)))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class _TokenDraws:
    """The ``random`` and ``normal`` of a ``np.random.Generator``, keyed to one step's tokens."""

    def __init__(self, keys: np.ndarray):
        self._keys = keys

    def _check(self, shape) -> None:
        if tuple(np.atleast_1d(shape)) != self._keys.shape:
            raise ValueError(f"draws are keyed to {self._keys.shape}, asked for {shape}")

    def random(self, shape) -> np.ndarray:
        self._check(shape)
        return _uniform(self._keys, PairedTokenDraws._ACCEPT)

    def normal(self, loc: float, scale: float, shape) -> np.ndarray:
        self._check(shape)   # Box-Muller on two independent streams
        radius = np.sqrt(-2.0 * np.log1p(-_uniform(self._keys, PairedTokenDraws._NOISE_A)))
        return loc + scale * radius * np.cos(2 * np.pi * _uniform(self._keys, PairedTokenDraws._NOISE_B))


class AcceptanceModel:
    """SYNTHETIC draft acceptance and confidence head.

    Base conditional acceptance of draft ``i`` falls geometrically from ``accept_first`` to
    ``accept_last`` (DSpark publishes > 70 % at draft 1, < 10 % at draft 5); a request's true
    probability is ``sigmoid(logit(base_i) + shift)``. The confidence is the per-position
    conditional survival ``sigmoid(conf_scale * logit(true_i) + conf_bias + N(0, conf_noise))``:
    informative, not exact.
    """

    def __init__(self, num_drafts: int, accept_first: float, accept_last: float,
                 conf_scale: float, conf_bias: float, conf_noise: float):
        position = np.arange(num_drafts) / max(num_drafts - 1, 1)
        self.base_accept = accept_first * (accept_last / accept_first) ** position
        self._base_logit = _logit(self.base_accept)
        self.conf_scale, self.conf_bias, self.conf_noise = conf_scale, conf_bias, conf_noise

    def true_accept(self, logit_shift: np.ndarray) -> np.ndarray:
        """``[bs, drafts]`` conditional acceptance of each draft given the ones before it."""
        return _sigmoid(self._base_logit[None, :] + logit_shift[:, None])

    def confidence(self, true_accept: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        logits = self.conf_scale * _logit(true_accept) + self.conf_bias
        if self.conf_noise > 0:
            logits = logits + rng.normal(0.0, self.conf_noise, true_accept.shape)
        return _sigmoid(logits).astype(np.float32)

    @staticmethod
    def accepted_drafts(true_accept: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Leading successes of independent Bernoulli draws (before any cap)."""
        success = rng.random(true_accept.shape) < true_accept
        return np.cumprod(success, axis=1).sum(axis=1)


class Router:
    """SYNTHETIC MoE router: ``top_k`` experts per verify row in each layer, drawn from a Zipf
    popularity (exponent ``skew``; 0 = uniform) whose ranking is a random permutation per layer.

    Simplifications: rows are independent (no correlation between a request's rows or steps);
    popularity ranks are drawn by inverse CDF from a 2^16-entry lookup table (probabilities
    rounded to 2^-16); the top-k is drawn with replacement, duplicates within a row being
    redrawn a few rounds, the rare leftovers counting once as if the router picked fewer experts.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, skew: float,
                 rng: np.random.Generator):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        popularity = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
        popularity /= popularity.sum()
        quantiles = (np.arange(_TABLE_SIZE) + 0.5) / _TABLE_SIZE
        rank_dtype = np.int16 if num_experts < 1 << 15 else np.int32
        self._rank_of_quantile = np.minimum(
            np.searchsorted(np.cumsum(popularity), quantiles), num_experts - 1).astype(rank_dtype)
        # expert id of popularity rank r in layer l, flattened as l * num_experts + r
        self._expert_of_rank = np.stack([rng.permutation(num_experts) for _ in range(num_layers)]).ravel().astype(rank_dtype)
        self._layer_base = (np.arange(num_layers) * num_experts).astype(np.int32)
        self.probability = np.empty((num_layers, num_experts))
        self.probability[np.arange(num_layers)[:, None], self._expert_of_rank.reshape(num_layers, -1)] = popularity

    def _draw_ranks(self, shape, rng: np.random.Generator) -> np.ndarray:
        return np.take(self._rank_of_quantile, rng.integers(0, _TABLE_SIZE, size=shape, dtype=np.uint16))

    def route(self, num_rows: int, rng: np.random.Generator) -> np.ndarray:
        """Expert ids ``[layers, num_rows, top_k]`` (a view of a top_k-major int array)."""
        # top_k-major so each duplicate test compares two contiguous planes
        ranks = self._draw_ranks((self.top_k, self.num_layers, num_rows), rng)
        for _ in range(_DEDUPE_ROUNDS):
            duplicate = np.zeros(ranks.shape, dtype=bool)
            for later in range(1, self.top_k):
                for earlier in range(later):
                    duplicate[later] |= ranks[later] == ranks[earlier]
            count = int(np.count_nonzero(duplicate))
            if count == 0:
                break
            ranks[duplicate] = self._draw_ranks(count, rng)
        ids = np.take(self._expert_of_rank, ranks + self._layer_base[:, None])
        return np.moveaxis(ids, 0, 2)

    def distinct_per_layer(self, ids: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Distinct experts per layer over all rows of ``ids``, or only the rows where ``rows``."""
        chosen = ids if rows is None else ids[:, rows]
        used = np.zeros(self.num_layers * self.num_experts, dtype=bool)
        used[chosen + self._layer_base[:, None, None]] = True
        return used.reshape(self.num_layers, self.num_experts).sum(axis=1)
