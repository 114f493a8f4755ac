"""vcap-sim: the engine side of the shared segment without a GPU, for developing and testing the
sidecar. The workload, acceptance, confidence, router and timings are all SYNTHETIC
(:mod:`vcap.engine_hook.workload`); the policy handling is the real one
(:class:`vcap.segment.ControlReader` and :mod:`vcap.engine_hook.reference`).

Drive it in-process without sleeping::

    engine = SimulatedEngine(SimConfig(max_bs=64))           # pure trace: engine time only
    engine.set_policy(policy, generation=1)
    records = engine.step()                                    # one record per ring

or against a segment (``SimulatedEngine(config, segment)``), as ``vcap-sim`` does.
"""

import math
import sys
from dataclasses import dataclass, fields, replace

import numpy as np

from vcap.engine_hook import reference
from vcap.engine_hook.workload import (LOAD_PATTERNS, AcceptanceModel, LoadPattern, PairedRequestDraws, PairedTokenDraws,
                                      RequestPool, Router)
from vcap.policy import MODES, Policy, default_policy
from vcap.segment import (CONTROL_FALLBACK, CONTROL_STATES, FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, FLAG_FALLBACK,
                          MODE_CODES, MODE_OFF,
                          ControlReader, ControlSnapshot, Layout, RingWriter, Segment, SegmentConfig, record_dtype)

__all__ = ["SimConfig", "SimulatedEngine", "create_segment", "main"]

# MXFP4 DeepSeek-V4.1-Flash: about 18.8 MB per routed expert, split over TP4.
DEFAULT_EXPERT_BYTES = int(18.8e6 / 4)
_FALLBACK = CONTROL_STATES[CONTROL_FALLBACK]
# The simulated engine's dimensions unless told otherwise (a DeepSeek-V4.1-like engine).
_DEFAULT_SEGMENT = SegmentConfig(stride=6, max_bs=256, num_moe_layers=43, expert_bytes=DEFAULT_EXPERT_BYTES)
_SEGMENT_FIELDS = frozenset(f.name for f in fields(SegmentConfig))


@dataclass(slots=True, init=False)
class SimConfig:
    """The simulated engine's dimensions (``segment``) and every SYNTHETIC knob.

    Built from flat keywords: those naming a :class:`SegmentConfig` field go to ``segment``, the
    rest are the knobs below; the dimensions read through (``config.max_bs``).

    >>> SimConfig(max_bs=64, mean_bs=16).segment.max_bs
    64
    """

    segment: SegmentConfig
    fallback_mode: str = "off"
    seed: int = 0
    # load (engine time)
    load: str = "steady"
    mean_bs: int = 32
    load_noise: float = 0.1
    shift_bs: int = 128
    shift_after_s: float = 60.0
    peak_bs: int = 128
    period_s: float = 60.0
    mean_output_tokens: float = 512.0
    # acceptance and confidence
    accept_first: float = 0.75
    accept_last: float = 0.08
    request_spread: float = 0.5
    # common random numbers: the n-th request admitted, the demand (PairedRequestDraws) and the
    # draws of each request's tokens (PairedTokenDraws) are the same under every policy, so two
    # runs with one seed compare policies, not draws
    paired_requests: bool = False
    conf_scale: float = 1.0
    conf_bias: float = 0.0
    conf_noise: float = 0.5
    # router and cost
    router_skew: float = 1.0
    moe_a_us: float = 22.9
    moe_b_us: float = 11.05
    other_ms: float = 2.0
    # SYNTHETIC attention: step time that grows with the batch, per request (0: none)
    attention_us_per_request: float = 0.0
    # SYNTHETIC compute-bound MoE: step time per live row and MoE layer, on top of the experts
    # (0: none; the H200 loop measured ~1.7 us with bf16 kernels at bs 256)
    moe_row_us: float = 0.0
    # SYNTHETIC fused-MoE tiles: with moe_row_tile T > 0 the per-row cost is paid per tile of T
    # (row, expert) pairs of each expert, ceil(n_e / T) * T of them instead of n_e, so it is not
    # linear in the live rows (the H200 loop, bs 256 uniform: k=1 199.6 ms, k=2 207.3 ms);
    # moe_row_us stays the cost per row when every tile is full
    moe_row_tile: int = 0
    # SYNTHETIC step-time jitter: each modelled step time times exp(N(0, step_noise)) (0: none;
    # a GPU's measured steps vary around what their experts and rows predict)
    step_noise: float = 0.0
    # the jitter's own draw (0: from ``seed``): runs of one seed that differ only in their noise,
    # as runs on a GPU each measure their own step times
    jitter_seed: int = 0

    def __init__(self, segment: SegmentConfig | None = None, **settings):
        dimensions = {name: settings.pop(name) for name in _SEGMENT_FIELDS & settings.keys()}
        if segment is not None and dimensions:
            raise TypeError("give the segment or its fields, not both")
        self.segment = segment or replace(_DEFAULT_SEGMENT, **dimensions)
        for knob in fields(self):
            if knob.name != "segment":
                setattr(self, knob.name, settings.pop(knob.name, knob.default))
        if settings:
            raise TypeError(f"SimConfig has no setting {', '.join(sorted(settings))}")
        self._check()

    def __getattr__(self, name):
        if name in _SEGMENT_FIELDS or name == "num_drafts":
            return getattr(self.segment, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _check(self) -> None:
        checks = [
            (self.num_moe_layers >= 1, f"the simulated engine needs MoE layers, got {self.num_moe_layers}"),
            (1 <= self.top_k <= self.num_experts, f"need 1 <= top_k <= num_experts, got {self.top_k}, {self.num_experts}"),
            (self.fallback_mode in MODES, f"fallback_mode must be one of {', '.join(MODES)}, got {self.fallback_mode!r}"),
            (self.load in LOAD_PATTERNS, f"load must be one of {', '.join(LOAD_PATTERNS)}, got {self.load!r}"),
            # above max_bs is allowed: the excess waits in the queue
            (min(self.mean_bs, self.shift_bs, self.peak_bs) >= 1, "mean_bs, shift_bs and peak_bs must be >= 1"),
            (self.load_noise >= 0, "load_noise must be >= 0"),
            (self.shift_after_s >= 0 and self.period_s > 0, "need shift_after_s >= 0 and period_s > 0"),
            (self.mean_output_tokens >= 1, "mean_output_tokens must be >= 1"),
            (0 < self.accept_last <= self.accept_first < 1,
             f"need 0 < accept_last <= accept_first < 1, got {self.accept_last}, {self.accept_first}"),
            (self.request_spread >= 0 and self.conf_noise >= 0, "request_spread and conf_noise must be >= 0"),
            (math.isfinite(self.conf_scale) and math.isfinite(self.conf_bias), "conf_scale and conf_bias must be finite"),
            (self.router_skew >= 0, "router_skew must be >= 0"),
            (self.moe_row_tile >= 0, "moe_row_tile must be >= 0"),
            (0 <= self.step_noise < 10, f"step_noise must be in [0, 10), got {self.step_noise}"),
            (self.jitter_seed >= 0, f"jitter_seed must be >= 0, got {self.jitter_seed}"),
            (min(self.moe_a_us, self.moe_b_us, self.other_ms, self.attention_us_per_request, self.moe_row_us) >= 0,
             "timings must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def segment_config(self) -> SegmentConfig:
        return self.segment

    def fallback_policy(self) -> Policy:
        return default_policy(self.num_drafts, mode=self.fallback_mode)


def create_segment(name: str, config: SimConfig, group: int | None = None) -> Segment:
    """The engine's segment for ``config``, with its fallback policy (the caller unlinks it)."""
    return Segment.create(name, config.segment, fallback=config.fallback_policy(), group=group)


class SimulatedEngine:
    """One SYNTHETIC engine: ``num_rings`` data-parallel groups stepping in lock step.

    With a ``segment``, each step reads the policy through a :class:`ControlReader`, publishes
    one record per ring and updates the engine status words; without one (pure trace) the
    policy is whatever :meth:`set_policy` gave. ``clock_ns`` stamps records and judges the lease;
    by default it is the engine time (the sum of modelled step times), so runs are reproducible.
    """

    def __init__(self, config: SimConfig, segment: Segment | None = None, clock_ns=None):
        self.config = config
        self.engine_time_ns = 0
        self.steps = 0
        self.clock_ns = clock_ns or (lambda: self.engine_time_ns)
        if segment is not None and segment.config != config.segment:
            raise ValueError(f"segment {segment.path} has dimensions {segment.config}, "
                             f"the simulation needs {config.segment}")
        self.segment = segment
        self.layout = segment.layout if segment else Layout(config.segment)
        self.record_dtype = record_dtype(self.layout)
        self._writers = [RingWriter(segment, ring) for ring in range(config.num_rings)] if segment else []
        self._reader = ControlReader(segment, clock=lambda: self.clock_ns()) if segment else None
        self._policy = ControlSnapshot(config.fallback_policy(), 0, "engine", "live")

        # the jitter's stream comes last: the others are the same with or without it
        streams = np.random.SeedSequence(config.seed).spawn(4 + config.num_rings)
        self._router_rng, self._accept_rng, router_table_rng = (np.random.default_rng(s) for s in streams[:3])
        jitter = np.random.SeedSequence([config.seed, config.jitter_seed]) if config.jitter_seed else streams[-1]
        self._jitter_rng = np.random.default_rng(jitter)
        self.load = LoadPattern(config.load, config.mean_bs, config.max_bs, config.shift_bs,
                                config.shift_after_s, config.peak_bs, config.period_s)
        self.pools = [RequestPool(config.max_bs, config.mean_output_tokens, config.request_spread,
                                  config.load_noise, np.random.default_rng(s)) for s in streams[3:-1]]
        if config.paired_requests:
            for index, pool in enumerate(self.pools):
                pool.rng = PairedRequestDraws(config.seed, index, lambda: self.engine_time_ns)
                pool.token_draws = PairedTokenDraws(config.seed, index)
        self.acceptance = AcceptanceModel(config.num_drafts, config.accept_first, config.accept_last,
                                          config.conf_scale, config.conf_bias, config.conf_noise)
        self.router = Router(config.num_moe_layers, config.num_experts, config.top_k,
                             config.router_skew, router_table_rng)
        self.last_step_ns = 0
        self.restores = 0  # times the segment was found truncated and restored

    def set_policy(self, policy: Policy, generation: int = 1, source: str = "manual") -> None:
        """Pure-trace mode only: the policy every following step uses."""
        if self.segment is not None:
            raise ValueError("this engine reads its policy from the segment; write it there")
        self._policy = ControlSnapshot(policy, generation, source, "live")

    def snapshot(self) -> ControlSnapshot:
        return self._reader.snapshot() if self._reader else self._policy

    def step_time_ns(self, experts_live: np.ndarray, bs: int = 0, live_rows: int = 0) -> int:
        """Modelled duration: ``a + b * D_live + r * live rows`` per MoE layer, attention ``c * bs``
        and the rest of the step."""
        c = self.config
        moe_us = c.num_moe_layers * (c.moe_a_us + c.moe_row_us * live_rows) + c.moe_b_us * float(np.sum(experts_live))
        return int(round((moe_us + c.attention_us_per_request * bs) * 1e3 + c.other_ms * 1e6))

    def step(self) -> np.ndarray:
        """One verify step of every group; returns its records (``[num_rings]`` of record_dtype)."""
        c, step = self.config, self.steps
        if self.segment is not None and not self.segment.intact():
            self._restore()
        snapshot = self.snapshot()
        policy = snapshot.policy
        explore = policy.explore_period > 0 and step % policy.explore_period == 0
        sampled = c.expert_sample_period > 0 and step % c.expert_sample_period == 0
        flags = ((FLAG_FALLBACK if snapshot.state == _FALLBACK else 0) | (FLAG_EXPLORE if explore else 0)
                 | (FLAG_EXPERTS_SAMPLED if sampled else 0))
        demand = self.load.demand(self.engine_time_ns / 1e9)
        records = np.zeros(c.num_rings, dtype=self.record_dtype)
        for pool, record in zip(self.pools, records):
            self._step_group(pool, record, demand, snapshot, explore, sampled)
        # groups meet at the MoE all-to-all every layer: the slowest one sets the pace
        self.last_step_ns = int(records["step_ns"].max())
        self.engine_time_ns += self.last_step_ns
        self.steps += 1
        records["step"], records["flags"], records["time_ns"] = step, flags, self.clock_ns()
        records["generation"] = snapshot.generation
        # the reference treats an unknown mode as off, so the record says off
        records["mode"] = MODE_CODES.get(policy.mode, MODE_OFF)
        if self.segment is not None:
            # through the file: a truncation from here on costs these writes, never SIGBUS
            for writer, record in zip(self._writers, records):
                writer.publish(record)
            self.segment.write_status(self.steps, self.steps, snapshot.state == _FALLBACK)
        return records

    def _restore(self) -> None:
        # Someone truncated our file: touching its pages now would raise SIGBUS. Give it back its
        # size and header; the sidecar notices, detaches and attaches again.
        size = self.segment.size()
        self.segment.restore()
        self.restores += 1
        print(f"vcap-sim: segment {self.segment.path} was truncated to {size} bytes by another process; "
              f"restored to {self.layout.total_size} (policy back to the fallback until the sidecar "
              "writes it again)", file=sys.stderr, flush=True)

    def _step_group(self, pool: RequestPool, record: np.ndarray, demand: float,
                    snapshot: ControlSnapshot, explore: bool, sampled: bool) -> None:
        c = self.config
        bs = pool.admit(demand, self.last_step_ns / 1e9)
        true_accept = self.acceptance.true_accept(pool.logit_shift[:bs])
        draws = pool.step_draws(c.num_drafts, self._accept_rng)
        confidence = self.acceptance.confidence(true_accept, draws)
        live = reference.live_lengths(confidence, snapshot.policy, bs, c.stride, explore)
        ids = self.router.route(bs * c.stride, self._router_rng)
        live_rows = ~reference.dead_row_mask(live, c.stride)  # dead rows: no experts ("drop")
        experts_live = self.router.distinct_per_layer(ids, live_rows)
        accepted = reference.cap_accepted(self.acceptance.accepted_drafts(true_accept, draws), live)
        pool.commit(accepted + 1)  # accepted drafts plus the bonus token
        record["bs"], record["num_queued"] = bs, pool.num_queued
        row_cost = int(live.sum()) if not (c.moe_row_tile and c.moe_row_us) else \
            self._tiled_rows(ids, live_rows)
        record["step_ns"] = self.step_time_ns(experts_live, bs, row_cost)
        if c.step_noise > 0:
            record["step_ns"] = int(record["step_ns"] * np.exp(self._jitter_rng.normal(0.0, c.step_noise)))
        record["confidence"][:bs] = confidence
        record["live"][:bs] = live
        record["accepted"][:bs] = accepted
        if sampled:
            record["experts_all"] = self.router.distinct_per_layer(ids)
            record["experts_live"] = experts_live


    def _tiled_rows(self, ids: np.ndarray, live_rows: np.ndarray) -> float:
        """Live rows as the tiled per-row cost counts them: per layer and expert the live
        (row, expert) pairs rounded up to a whole tile, over ``top_k`` pairs a row, mean over layers."""
        c, tile = self.config, self.config.moe_row_tile
        chosen = ids[:, live_rows]                                     # [layers, live rows, top_k]
        base = (np.arange(c.num_moe_layers) * c.num_experts)[:, None, None]
        pairs = np.bincount((chosen + base).ravel(), minlength=c.num_moe_layers * c.num_experts)
        return float(np.ceil(pairs / tile).sum() * tile / c.top_k / c.num_moe_layers)


def main(argv=None) -> int:
    """``vcap-sim``; the command line is :mod:`vcap.engine_hook.sim_cli`."""
    from .sim_cli import main as run
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
