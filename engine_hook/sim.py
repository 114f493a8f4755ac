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

import argparse
import math
import signal
import sys
import time
from dataclasses import dataclass, fields

import numpy as np

from vcap.engine_hook import reference
from vcap.engine_hook.workload import LOAD_PATTERNS, AcceptanceModel, LoadPattern, RequestPool, Router
from vcap.policy import MODES, Policy, default_policy
from vcap.segment import (FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, FLAG_FALLBACK, MODE_CODES, ControlReader,
                          ControlSnapshot, Layout, RingWriter, Segment, SegmentConfig, record_dtype,
                          segment_path)

__all__ = ["SimConfig", "SimulatedEngine", "create_segment", "main"]

# MXFP4 DeepSeek-V4.1-Flash: about 18.8 MB per routed expert, split over TP4.
DEFAULT_EXPERT_BYTES = int(18.8e6 / 4)


@dataclass(slots=True)
class SimConfig:
    """Dimensions of the simulated engine and every SYNTHETIC knob."""

    stride: int = 6
    max_bs: int = 256
    num_moe_layers: int = 43
    num_experts: int = 384
    top_k: int = 6
    num_rings: int = 1
    ring_slots: int = 1024
    lease_ms: int = 500
    expert_bytes: int = DEFAULT_EXPERT_BYTES
    expert_sample_period: int = 1
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
    conf_scale: float = 1.0
    conf_bias: float = 0.0
    conf_noise: float = 0.5
    # router and cost
    router_skew: float = 1.0
    moe_a_us: float = 22.9
    moe_b_us: float = 11.05
    other_ms: float = 2.0

    def __post_init__(self):
        self.segment_config()  # the engine's dimensions, checked where the segment defines them
        checks = [
            (self.num_moe_layers >= 1, f"the simulated engine needs MoE layers, got {self.num_moe_layers}"),
            (1 <= self.top_k <= self.num_experts, f"need 1 <= top_k <= num_experts, got {self.top_k}, {self.num_experts}"),
            (self.expert_bytes >= 0, "expert_bytes must be >= 0"),
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
            (min(self.moe_a_us, self.moe_b_us, self.other_ms) >= 0, "timings must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def num_drafts(self) -> int:
        return self.stride - 1

    def segment_config(self) -> SegmentConfig:
        return SegmentConfig(stride=self.stride, max_bs=self.max_bs, num_moe_layers=self.num_moe_layers,
                             num_rings=self.num_rings, ring_slots=self.ring_slots, lease_ms=self.lease_ms,
                             num_experts=self.num_experts, top_k=self.top_k, expert_bytes=self.expert_bytes,
                             expert_sample_period=self.expert_sample_period)

    def fallback_policy(self) -> Policy:
        return default_policy(self.num_drafts, mode=self.fallback_mode)


def create_segment(name: str, config: SimConfig, group: int | None = None) -> Segment:
    """The engine's segment for ``config``, with its fallback policy (the caller unlinks it)."""
    return Segment.create(name, config.segment_config(), fallback=config.fallback_policy(), group=group)


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
        if segment is not None and segment.config != config.segment_config():
            raise ValueError(f"segment {segment.path} has dimensions {segment.config}, "
                             f"the simulation needs {config.segment_config()}")
        self.segment = segment
        self.layout = segment.layout if segment else Layout(config.segment_config())
        self.record_dtype = record_dtype(self.layout)
        self._writers = [RingWriter(segment, ring) for ring in range(config.num_rings)] if segment else []
        self._reader = ControlReader(segment, clock=lambda: self.clock_ns() / 1e9) if segment else None
        self._policy = ControlSnapshot(config.fallback_policy(), 0, "engine", "live")

        streams = np.random.SeedSequence(config.seed).spawn(3 + config.num_rings)
        self._router_rng, self._accept_rng, router_table_rng = (np.random.default_rng(s) for s in streams[:3])
        self.load = LoadPattern(config.load, config.mean_bs, config.max_bs, config.shift_bs,
                                config.shift_after_s, config.peak_bs, config.period_s)
        self.pools = [RequestPool(config.max_bs, config.mean_output_tokens, config.request_spread,
                                  config.load_noise, np.random.default_rng(s)) for s in streams[3:]]
        self.acceptance = AcceptanceModel(config.num_drafts, config.accept_first, config.accept_last,
                                          config.conf_scale, config.conf_bias, config.conf_noise)
        self.router = Router(config.num_moe_layers, config.num_experts, config.top_k,
                             config.router_skew, router_table_rng)
        self.last_step_ns = 0

    def set_policy(self, policy: Policy, generation: int = 1, source: str = "manual") -> None:
        """Pure-trace mode only: the policy every following step uses."""
        if self.segment is not None:
            raise ValueError("this engine reads its policy from the segment; write it there")
        self._policy = ControlSnapshot(policy, generation, source, "live")

    def snapshot(self) -> ControlSnapshot:
        return self._reader.snapshot() if self._reader else self._policy

    def step_time_ns(self, experts_live: np.ndarray) -> int:
        """Modelled duration: ``a + b * D_live`` per MoE layer plus the rest of the step."""
        c = self.config
        moe_us = c.num_moe_layers * c.moe_a_us + c.moe_b_us * float(np.sum(experts_live))
        return int(round(moe_us * 1e3 + c.other_ms * 1e6))

    def step(self) -> np.ndarray:
        """One verify step of every group; returns its records (``[num_rings]`` of record_dtype)."""
        c, step = self.config, self.steps
        snapshot = self.snapshot()
        policy = snapshot.policy
        explore = policy.explore_period > 0 and step % policy.explore_period == 0
        sampled = c.expert_sample_period > 0 and step % c.expert_sample_period == 0
        flags = ((FLAG_FALLBACK if snapshot.state == "fallback" else 0) | (FLAG_EXPLORE if explore else 0)
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
        records["mode"] = MODE_CODES.get(policy.mode, MODE_CODES["off"])
        if self.segment is not None:
            for writer, record in zip(self._writers, records):
                writer.publish(record)
            self.segment.status_u64[0] = self.steps
            self.segment.status_u64[3] += 1
            self.segment.status_u32[2] = 1 if snapshot.state == "fallback" else 0
        return records

    def _step_group(self, pool: RequestPool, record: np.ndarray, demand: float,
                    snapshot: ControlSnapshot, explore: bool, sampled: bool) -> None:
        c = self.config
        bs = pool.admit(demand, self.last_step_ns / 1e9)
        true_accept = self.acceptance.true_accept(pool.logit_shift[:bs])
        confidence = self.acceptance.confidence(true_accept, self._accept_rng)
        live = reference.live_lengths(confidence, snapshot.policy, bs, c.stride, explore)
        ids = self.router.route(bs * c.stride, self._router_rng)
        live_rows = ~reference.dead_row_mask(live, c.stride)  # dead rows: no experts ("drop")
        experts_live = self.router.distinct_per_layer(ids, live_rows)
        accepted = reference.cap_accepted(self.acceptance.accepted_drafts(true_accept, self._accept_rng), live)
        pool.commit(accepted + 1)  # accepted drafts plus the bonus token
        record["bs"], record["num_queued"] = bs, pool.num_queued
        record["step_ns"] = self.step_time_ns(experts_live)
        record["confidence"][:bs] = confidence
        record["live"][:bs] = live
        record["accepted"][:bs] = accepted
        if sampled:
            record["experts_all"] = self.router.distinct_per_layer(ids)
            record["experts_live"] = experts_live


class _IntervalLog:
    """Totals between two log lines."""

    def __init__(self):
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.started, self.steps, self.bs, self.live_sum, self.requests = now, 0, 0, 0, 0
        self.tokens, self.experts_all, self.experts_live = 0, 0, 0

    def add(self, records: np.ndarray) -> None:
        self.steps += 1
        for record in records:
            bs = int(record["bs"])
            self.bs += bs
            self.requests += bs
            self.live_sum += int(record["live"][:bs].sum())
            self.tokens += int(record["accepted"][:bs].sum()) + bs
            self.experts_all += int(record["experts_all"].sum())
            self.experts_live += int(record["experts_live"].sum())

    def line(self, records: np.ndarray, now: float) -> str:
        steps = max(self.steps, 1)
        saved = 1 - self.experts_live / self.experts_all if self.experts_all else 0.0
        last = records[0]
        mode = {code: name for name, code in MODE_CODES.items()}.get(int(last["mode"]), "?")
        state = " FALLBACK" if int(last["flags"]) & FLAG_FALLBACK else ""
        return (f"steps/s {self.steps / max(now - self.started, 1e-9):.1f}  bs {self.bs / steps:.1f}  "
                f"generation {int(last['generation'])}  mode {mode}{state}  "
                f"mean L {self.live_sum / max(self.requests, 1):.2f}  tokens/step {self.tokens / steps:.1f}  "
                f"experts saved {100 * saved:.1f}%")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vcap-sim", description="Simulated engine for the vcap sidecar: creates the shared segment, "
        "follows its policy and publishes telemetry. Workload, acceptance, confidence, router and timings "
        "are SYNTHETIC.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--segment", default="vcap-0", help="segment name in /dev/shm (or a path)")
    add("--group", type=int, default=None, help="GID that may also open the segment (mode 0660)")
    add("--stride", type=int, default=6, help="verify rows per request: anchor + drafts")
    add("--max-bs", type=int, default=256)
    add("--layers", type=int, default=43, help="MoE layers")
    add("--experts", type=int, default=384, help="routed experts per layer")
    add("--top-k", type=int, default=6)
    add("--expert-bytes", type=int, default=DEFAULT_EXPERT_BYTES,
        help="bytes of one routed expert (MXFP4 V4.1-Flash, 18.8 MB per expert over TP4)")
    add("--rings", type=int, default=1, help="data-parallel groups, each with its own batch and ring")
    add("--ring-slots", type=int, default=1024)
    add("--lease-ms", type=int, default=500)
    add("--fallback-mode", choices=MODES, default="off")
    add("--sample-period", type=int, default=1, help="count experts every N steps (0: never)")
    add("--seed", type=int, default=0)
    add("--steps", type=int, default=None, help="stop after N steps (default: run until signalled)")
    add("--time-scale", type=float, default=1.0, help="sleep X times the modelled step time (0: flat out)")
    add("--log-every", type=float, default=10.0, help="seconds between status lines (0: never)")
    add("--load", choices=LOAD_PATTERNS, default="steady")
    add("--mean-bs", type=int, default=32, help="base load (steady, shift, bursty, sine)")
    add("--load-noise", type=float, default=0.1, help="std of the log-normal load noise")
    add("--shift-bs", type=int, default=128)
    add("--shift-after", type=float, default=60.0, help="seconds of engine time before the shift")
    add("--peak-bs", type=int, default=128, help="bursts (bursty) and crest (sine)")
    add("--period", type=float, default=60.0, help="seconds of engine time (bursty, ramp, sine)")
    add("--mean-output-tokens", type=float, default=512.0)
    add("--accept-first", type=float, default=0.75, help="conditional acceptance of draft 1")
    add("--accept-last", type=float, default=0.08, help="conditional acceptance of the last draft")
    add("--request-spread", type=float, default=0.5, help="std of a request's acceptance logit shift")
    add("--conf-scale", type=float, default=1.0)
    add("--conf-bias", type=float, default=0.0)
    add("--conf-noise", type=float, default=0.5)
    add("--router-skew", type=float, default=1.0, help="Zipf exponent of expert popularity (0: uniform)")
    add("--moe-a-us", type=float, default=22.9, help="MoE layer time: a + b * distinct experts")
    add("--moe-b-us", type=float, default=11.05)
    add("--other-ms", type=float, default=2.0, help="rest of the step (attention etc.)")
    return p


def _config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        stride=args.stride, max_bs=args.max_bs, num_moe_layers=args.layers, num_experts=args.experts,
        top_k=args.top_k, num_rings=args.rings, ring_slots=args.ring_slots, lease_ms=args.lease_ms,
        expert_bytes=args.expert_bytes, expert_sample_period=args.sample_period,
        fallback_mode=args.fallback_mode, seed=args.seed, load=args.load, mean_bs=args.mean_bs,
        load_noise=args.load_noise, shift_bs=args.shift_bs, shift_after_s=args.shift_after,
        peak_bs=args.peak_bs, period_s=args.period, mean_output_tokens=args.mean_output_tokens,
        accept_first=args.accept_first, accept_last=args.accept_last, request_spread=args.request_spread,
        conf_scale=args.conf_scale, conf_bias=args.conf_bias, conf_noise=args.conf_noise,
        router_skew=args.router_skew, moe_a_us=args.moe_a_us, moe_b_us=args.moe_b_us, other_ms=args.other_ms)


def _sleep_unless(stop: list, seconds: float) -> None:
    # short naps so a signal ends the run within one of them
    deadline = time.monotonic() + seconds
    while not stop and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = _config_from_args(args)
        if args.time_scale < 0 or args.log_every < 0 or (args.steps is not None and args.steps < 0):
            raise ValueError("time-scale, log-every and steps must be >= 0")
    except ValueError as error:
        parser.error(str(error))
    stop: list = []

    def request_stop(signum, _frame):
        stop.append(signum)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    segment = create_segment(args.segment, config, args.group)
    try:
        engine = SimulatedEngine(config, segment, clock_ns=time.monotonic_ns)
        print("vcap-sim: workload, acceptance, confidence, router and timings are SYNTHETIC", flush=True)
        settings = " ".join(f"{f.name}={getattr(config, f.name)}" for f in fields(config))
        print(f"vcap-sim: segment {segment_path(args.segment)} time_scale={args.time_scale} {settings}", flush=True)
        interval = _IntervalLog()
        while not stop and (args.steps is None or engine.steps < args.steps):
            started = time.monotonic()
            records = engine.step()
            interval.add(records)
            now = time.monotonic()
            if args.log_every and now - interval.started >= args.log_every:
                print(f"vcap-sim: {interval.line(records, now)}", flush=True)
                interval.reset(now)
            if args.time_scale:
                _sleep_unless(stop, engine.last_step_ns / 1e9 * args.time_scale - (now - started))
        print(f"vcap-sim: stopped after {engine.steps} steps", flush=True)
    finally:
        segment.unlink()
        segment.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
