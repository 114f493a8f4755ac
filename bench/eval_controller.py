"""Evaluation of the automatic controller against static policies on SYNTHETIC traces.

Every trace is a run of the simulated engine in pure-trace mode (engine time, no sleeping; the
workload, acceptance, confidence head, router and timings are SYNTHETIC). For each trace:

- every static policy of a full grid runs the whole trace (fixed k 1-4, ``off``, confidence
  thresholds 0.05-0.9, thresholds with k bounds);
- the best static per-bucket policies in hindsight: per batch-size bucket (the controller's
  edges), the grid policy with the best committed tokens per second over that bucket's steps,
  once among all (unconstrained) and once among those within the guardrail (constrained); each
  combination then runs the trace;
- the auto controller starts from ``off`` (the engine's behaviour) and learns online, with its
  exploration steps included in its goodput; once with the defaults (``auto``: the goodput
  guardrail, no bound on tokens given up) and once with the operator's explicit bound of 0.1
  accepted drafts per request-step (``auto-bounded``).

Scoring, per window of engine time: *cold start* ``[0, 10 s)``; *transitions* ``[change, change +
30 s)`` after each load or acceptance change; *steady state* the rest. In each window the best is
the best candidate (static policy or hindsight combination) over that window; regret = 1 - auto /
best, against the unconstrained best and against the best within the guardrail (tokens given up
measured exactly over the window). Its *floor* is the regret, in the same window, of the one
candidate best over the whole segment between changes: what a rule that never changes scores by
chance, since the window's best is a maximum over ~24 noisy estimates. After a change: the first
time from which every 5 s window of auto is within 2% of that window's best until the next change ("settle"; also against the
candidate best over the whole segment after the change, "the new best", in the same windows), and the reversals
(writes after the change whose effect on the measured mean live length reverses the direction of
the previous one; also counted with the trials' writes left out, the choice's own reversals, since
a trial and the return from it are a measurement). The settle test's own noise: the static rule
next best to the new best after the transition (the "twin", a rule that never changes) judged by
the same test. Against the new best, settle is also scored in 10 s windows: in 5 s ones the twin
itself fails the test for up to 54 s after a change, so that test cannot tell settling from
noise. Writes per hour at steady load come from a long run (``--long``). ``--goals A.json,...``
prints each goal of the issue as read from stored result files, met or missed (:func:`goal_readings`).

Every run above starts at time 0, so at a change each is in its own state: after a drop in load a
rule that drained faster has fewer requests in flight, and a time window scores the laggard's
backlog as speed. So after each change every static rule also runs *from auto's state* there
(:func:`from_auto_state`: auto's writes replayed at the steps they took effect, then the rule from
the change's time on; on the simulated engine auto's run step for step until the change, on the
GPU nearly, as each run measures its own step times; ``--from-state N``: only the N best over the
segment from time 0, as on the GPU, where all of them double the runs). Against the best of those
over the segment: auto's regret over the transition window, its settle time in 5 s and 10 s
windows, and the next best's own (the test's noise, in auto's state and auto's time). Once
their speeds differ, two runs hold other requests in a window: at bs 8 a batch of 8, accepted
several percent apart. So the same regret and settle (10 s windows) are also given with each
run's goodput scaled to auto's requests in that window: by the ratio of the tokens the two runs'
rows would commit at that run's own depth (exact, from the simulator's draws, recorded per
second: :func:`_adjusted_goodput`).

Goodput = committed tokens (accepted drafts + 1 per request) / engine time. Every run of a trace
sees the same requests and demand, and each request's tokens the same acceptance and confidence
draws (``SimConfig.paired_requests``: the draft proposing token t of the n-th request is accepted
alike under every policy), so the policies are compared on paired traces.

    python bench/eval_controller.py [--quick] [--only NAME,...] [--jobs 2] [--long 600] [--json out.json]

``--device cuda`` (on the GPU machine, through ``bench/run_loop.sh``'s ``EVAL_TRACES``) runs every
run on the H200 loop's engine instead (``bench_loop.Loop``: vcap's hook, the router and SGLang's
fused-MoE kernels in CUDA graphs): the same workload, acceptance and changes, the router skew as
its Zipf routing, step times measured, not modelled (the modelled step-cost knobs, attention
included, do not apply); the controller reads the hook's ring records on the engine's clock.
"""

import argparse
import itertools
import json
import logging
import lzma
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Callable

import numpy as np

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.engine_hook.workload import AcceptanceModel
from vcap.policy import Bucket, Policy, default_policy, rule_at
from vcap.segment import RingReader
from vcap.sidecar.controller import AutoController, ControllerConfig
from vcap.sidecar.policy_control import PolicyControl
from vcap.sidecar.telemetry import unpack

from static_grid import D, GRID  # noqa: E402  (bench/: the script's own directory)

EDGES = ControllerConfig().bucket_edges
TICK_S = 0.5
CONTROLLER_FIELDS = ""   # --controller: ControllerConfig fields that auto and auto-bounded run with
CONTROLLER_LOG = logging.getLogger("vcap.controller")   # --controller-log: its decisions, at DEBUG
GUARDRAIL = 0.1       # the operator's explicit bound, for auto-bounded and the constrained best
LOOSE = float("inf")  # no explicit bound: the default
COLD_S = 10
TRANSITION_S = 30
SETTLE_WINDOW_S = 5
SETTLE_LONG_WINDOW_S = 10    # against the new best: half the variance of 5 s windows


STATIC = GRID   # bench/static_grid.py: the full grid

# held-out simulator parameters (defaults: accept 0.75 -> 0.08, conf noise 0.5, scale 1, bias 0,
# skew 1, moe 22.9 us + 11.05 us x D per layer, other 2 ms, no attention term, no per-live-row term)
TRACES = {
    "sat-bs96-skew1.5": dict(load="steady", mean_bs=96, accept_first=0.8, accept_last=0.2, conf_noise=0.8,
                             router_skew=1.5, seconds=40),
    "sat-bs200-attn": dict(load="steady", mean_bs=200, accept_first=0.75, accept_last=0.15, conf_scale=0.7,
                           router_skew=1.2, attention_us_per_request=30.0, moe_b_us=9.0, other_ms=3.0, seconds=40),
    "steady-bs8-attn": dict(load="steady", mean_bs=8, accept_first=0.85, accept_last=0.3, conf_noise=1.0,
                            attention_us_per_request=100.0, moe_a_us=20.0, other_ms=1.5, seconds=40),
    # the H200 loop's finding: uniform routing at bs 256 saturates the experts (every one read at
    # any cap) and the MoE cost follows the live rows (1.7 us per row and layer, as measured there)
    "sat-bs256-rows-uniform": dict(load="steady", mean_bs=256, accept_first=0.75, accept_last=0.05, router_skew=0.0,
                                   moe_row_us=1.7, seconds=40),
    # fourth round, the H200 loop's misses: the per-row cost is paid per fused-MoE tile of 16
    # (row, expert) pairs (SYNTHETIC moe_row_tile; k=1 and k=2 then cost about the same at bs
    # 256, as measured there), with the steep and the high acceptance of the loop's profiles;
    # moe_b_us 7.4 makes the simulated steps at bs 256 uniform those of the loop's run 3 within 2%
    # (k=1..4, off: 200, 207, 229, 259, 274 ms against 200, 207, 231, 260, 278) and puts the
    # modelled prior (11.05 us per expert, 1 us per row, linear) off the truth, as on the GPU
    "sat-bs256-tiles-steep": dict(load="steady", mean_bs=256, accept_first=0.75, accept_last=0.05, router_skew=0.0,
                                  moe_row_us=1.7, moe_row_tile=16, moe_b_us=7.4, seconds=40),
    "sat-bs256-tiles-high": dict(load="steady", mean_bs=256, accept_first=0.92, accept_last=0.6, router_skew=0.0,
                                 moe_row_us=1.7, moe_row_tile=16, moe_b_us=7.4, seconds=40),
    # fifth round (designed with the change it tests, not held out): cheaper experts and dearer
    # rows put the best rule at the one-tile edge (about 4 live rows per request: 16 (row, expert)
    # pairs per expert), far in live length from the rules the linear fit ranks first; the H200
    # loop's bs-256 uniform high cell has its best rule (k=3) at the same edge
    "sat-bs256-tile-edge": dict(load="steady", mean_bs=256, accept_first=0.92, accept_last=0.6, router_skew=0.0,
                                moe_row_us=2.2, moe_row_tile=16, moe_b_us=5.0, seconds=40),
    "sat-bs64-zipf-high": dict(load="steady", mean_bs=64, accept_first=0.92, accept_last=0.6, router_skew=1.2,
                               moe_row_us=1.7, moe_row_tile=16, moe_b_us=7.4, seconds=40),
    # sixth round: the traces with a change run 90 s with the change at 30 s, so both steady windows
    # last 20-30 s (they were 5-10 s, where the best of ~24 candidates sits 1-2% above any one
    # fixed rule by chance alone: the floor column)
    "shift-4-96-skew1.5": dict(load="shift", mean_bs=4, shift_bs=96, shift_after_s=30.0, accept_first=0.8,
                               accept_last=0.2, conf_noise=0.8, router_skew=1.5, seconds=90),
    "shift-128-8-skew1.5": dict(load="shift", mean_bs=128, shift_bs=8, shift_after_s=30.0, accept_first=0.8,
                                accept_last=0.2, conf_bias=-0.5, router_skew=1.5, mean_output_tokens=256.0, seconds=90),
    "accept-rise-bs48": dict(load="steady", mean_bs=48, accept_first=0.6, accept_last=0.05, router_skew=1.2,
                             accept_change_s=30.0, accept_first_after=0.9, accept_last_after=0.4, seconds=90),
    "accept-fall-bs48": dict(load="steady", mean_bs=48, accept_first=0.9, accept_last=0.4, router_skew=1.2,
                             accept_change_s=30.0, accept_first_after=0.6, accept_last_after=0.05, seconds=90),
}
LONG_TRACE = "sat-bs96-skew1.5"
LONG_SETTLE_S = 60.0  # the long run's writes per hour count from here: the first minute is learning


def drawn_traces(count: int, seed: int) -> dict:
    """``count`` SYNTHETIC traces drawn at random over wide ranges of the simulator's knobs
    (``--drawn``): workloads nobody chose, so the controller was never tuned on them. They take
    turns: a steady load (40 s), a load shift at 30 s and an acceptance change at 30 s (90 s)."""
    rng = np.random.default_rng(seed)

    def batch_size() -> int:
        return int(round(math.exp(rng.uniform(math.log(2), math.log(192)))))

    def acceptance() -> tuple[float, float]:
        first = rng.uniform(0.55, 0.95)
        return round(first, 3), round(rng.uniform(0.02, first - 0.15), 3)

    traces = {}
    for index in range(count):
        kind = ("steady", "shift", "accept")[index % 3]
        accept_first, accept_last = acceptance()
        params = dict(load="steady", mean_bs=batch_size(), accept_first=accept_first, accept_last=accept_last,
                      conf_noise=round(rng.uniform(0.3, 1.2), 3), conf_bias=round(rng.uniform(-0.6, 0.6), 3),
                      conf_scale=round(rng.uniform(0.6, 1.3), 3), router_skew=round(rng.uniform(0.0, 1.6), 3),
                      moe_a_us=round(rng.uniform(15.0, 30.0), 2), moe_b_us=round(rng.uniform(5.0, 15.0), 2),
                      other_ms=round(rng.uniform(1.0, 4.0), 2), mean_output_tokens=round(rng.uniform(128, 1024)),
                      seconds=40 if kind == "steady" else 90)
        if rng.random() < 0.5:   # a cost that grows with the batch
            params["attention_us_per_request"] = round(rng.uniform(10.0, 120.0), 1)
        if rng.random() < 0.5:   # a compute-bound grouped GEMM, half the time paid per tile of 16
            params["moe_row_us"] = round(rng.uniform(0.5, 2.5), 2)
            params["moe_row_tile"] = int(rng.choice([0, 16]))
        if rng.random() < 0.5:   # a GPU's step-time jitter
            params["step_noise"] = round(rng.uniform(0.005, 0.02), 4)
        if kind == "shift":
            while max(params["mean_bs"], shift := batch_size()) < 3 * min(params["mean_bs"], shift):
                pass
            params.update(load="shift", shift_bs=shift, shift_after_s=30.0)
        if kind == "accept":
            while abs((after := acceptance())[0] - accept_first) < 0.15:
                pass
            params.update(accept_change_s=30.0, accept_first_after=after[0], accept_last_after=after[1])
        traces[f"drawn{seed}-{index}-{kind}"] = params
    return traces


def _bucket_of(bs: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(EDGES), bs, side="right") - 1


def changes_of(params: dict) -> list[float]:
    """Engine times of the trace's load and acceptance changes."""
    keys = [key for key in ("shift_after_s", "accept_change_s") if key in params]
    return sorted(float(params[key]) for key in keys if params.get("load") == "shift" or key != "shift_after_s")


def run_trace(params: dict, policy: Policy | None, seed: int = 1, max_given_up: float = LOOSE, loop=None,
              schedule: list[tuple[int, Policy]] = (), switch: tuple[float, Policy] | None = None) -> dict:
    """One run; ``policy=None`` runs the auto controller. Returns totals, per bucket and per second.
    ``loop``: a ``bench_loop.Loop`` (the GPU engine: step times measured on the device, the
    controller fed the hook's own ring records), else the simulated engine's modelled steps.
    ``schedule``: (step, policy) pairs, each in force from that step on, no controller (from the
    policy auto starts with; ``policy`` None): auto's writes replayed (:func:`from_auto_state`).
    ``switch``: (engine s, policy), in force from the first step at or after that time, the
    schedule's later entries dropped."""
    scripted = bool(schedule) or switch is not None
    if scripted and policy is not None:
        raise ValueError("a scheduled run starts from auto's starting policy: pass policy=None")
    changes = changes_of(params)
    params = dict(params)
    seconds = params.pop("seconds")
    change_s = params.pop("accept_change_s", None)
    after = (params.pop("accept_first_after", None), params.pop("accept_last_after", None))
    if loop is None:
        config = SimConfig(max_bs=256, seed=seed, paired_requests=True, **params)
        engine = SimulatedEngine(config)
    else:
        engine, reader = _gpu_engine(loop, params, seed), RingReader(loop.segment, 0)
        reader.read()   # earlier runs' records
        config = engine.config
    uncapped = []  # the simulator's acceptance before the cap: measures tokens given up exactly

    def record_uncapped(acceptance):
        draw = acceptance.accepted_drafts

        def recording_draw(true_accept, rng):
            values = draw(true_accept, rng)
            uncapped.append(values)
            return values
        acceptance.accepted_drafts = recording_draw

    record_uncapped(engine.acceptance)
    controller = control = None
    schedule = list(schedule)

    def put_in_force(scheduled: Policy) -> None:
        if loop is None:
            engine.set_policy(scheduled, engine.steps + 1, "auto")
        else:
            loop.write(scheduled, "auto")

    if scripted:   # auto's starting policy: the loop's default, the simulated engine's own
        if loop is not None:
            loop.write(default_policy(D))
    elif policy is None:
        control = PolicyControl("eval")
        control.set_control_mode("auto")
        controller = AutoController(control, controller_config(CONTROLLER_FIELDS, max_tokens_given_up=max_given_up),
                                    engine_config=config.segment_config)
        if loop is not None:   # the segment's generations are the loop's, the records' the controller's
            loop.write(default_policy(D))
            to_control = {loop.generation: control.generation}
    elif loop is None:
        engine.set_policy(policy, 1, "manual")
    else:
        loop.write(policy)
    num_buckets, num_seconds = len(EDGES), int(seconds) + 1
    bucket_tokens, bucket_ns = np.zeros(num_buckets), np.zeros(num_buckets)
    bucket_given_up, bucket_requests = np.zeros(num_buckets), np.zeros(num_buckets)
    per_second = {key: np.zeros(num_seconds) for key in ("tokens", "ns", "given_up", "requests", "live")}
    # per second and k = 1..D: the drafts the rows would have accepted with k verified each
    per_second["accepted_within"] = np.zeros((num_seconds, D))
    # per second and exact batch size: what a drain leaves each run at its own batch sizes (runs
    # a bucket apart by one request differ by more than the rules do, thirtieth round); stored
    # sparse (:func:`_size_rows`). Files of the twenty-ninth round hold it per second and bucket
    size_tokens, size_ns = np.zeros((2, num_seconds, config.max_bs + 1))
    # and its steps and live rows: step time against live rows per request at one batch size,
    # the slope the cost model predicts (cost_probes, thirty-fifth round)
    size_steps, size_live = np.zeros((2, num_seconds, config.max_bs + 1))
    cost_probes = []
    depths = np.arange(1, D + 1)
    generation, writes, trial_writes, next_tick = 0, [], [], TICK_S
    # writes of every row right after a change of acceptance was detected: the stopgap (auto.py)
    stopgap_writes, changes_seen = [], 0
    held_ticks = ticks = 0   # ticks after which the busy buckets were judged on their recent rows (the hold)
    holds = []               # [from, until] of each hold, in ticks of engine time
    # per write, the buckets (edges) whose rule is on trial: a trial runs until it is measured,
    # and a bucket's trial rule rides in the writes made for other buckets meanwhile
    trial_buckets = []
    write_steps, change_steps = [], {}   # the step each write took effect at; each change's first step
    while engine.engine_time_ns < seconds * 1e9:
        while changes and engine.engine_time_ns >= changes[0] * 1e9:
            change_steps[f"{changes.pop(0):g}"] = engine.steps
        while schedule and engine.steps >= schedule[0][0]:
            put_in_force(schedule.pop(0)[1])
        if switch is not None and engine.engine_time_ns >= switch[0] * 1e9:
            put_in_force(switch[1])
            switch, schedule = None, []
        if change_s is not None and engine.engine_time_ns >= change_s * 1e9:
            change_s = None
            engine.acceptance = AcceptanceModel(D, after[0], after[1], config.conf_scale, config.conf_bias,
                                                config.conf_noise)
            record_uncapped(engine.acceptance)
        records = engine.step()
        record = records[0]
        if loop is not None and controller is not None:   # the hook's own records, on the engine's clock
            loop.segment.heartbeat[0] += 1
            records = engine.on_engine_clock(reader.read())
            records["generation"] = [to_control.get(int(g), 1 << 30) for g in records["generation"]]
        bs = int(record["bs"])
        tokens = int(record["accepted"][:bs].sum()) + bs
        drawn = np.asarray(uncapped.pop())
        given_up = int((drawn - record["accepted"][:bs]).sum())
        bucket = _bucket_of(np.array([bs]))[0]
        bucket_tokens[bucket] += tokens
        bucket_ns[bucket] += int(record["step_ns"])
        bucket_given_up[bucket] += given_up
        bucket_requests[bucket] += bs
        second = min(int(engine.engine_time_ns / 1e9), int(seconds))
        for key, value in (("tokens", tokens), ("ns", int(record["step_ns"])), ("given_up", given_up),
                           ("requests", bs), ("live", int(record["live"][:bs].sum()))):
            per_second[key][second] += value
        per_second["accepted_within"][second] += np.minimum(drawn[:, None], depths).sum(axis=0)
        size_tokens[second, bs] += tokens
        size_ns[second, bs] += int(record["step_ns"])
        size_steps[second, bs] += 1
        size_live[second, bs] += int(record["live"][:bs].sum())
        if controller is not None:
            if len(records):
                controller.observe(0, unpack(records))
            now = engine.engine_time_ns / 1e9
            if now >= next_tick:
                if CONTROLLER_LOG.isEnabledFor(logging.DEBUG):
                    CONTROLLER_LOG.debug("tick at %.2f s of engine time, bs %d", now, bs)
                trials = controller.readings().trials_total
                controller.tick(now)
                next_tick = now + TICK_S
                model = controller.model
                ticks += 1
                held = model is not None and model.moved_at_ns is not None
                if held and (not holds or holds[-1][1] is not None):
                    holds.append([round(now, 2), None])
                elif not held and holds and holds[-1][1] is None:
                    holds[-1][1] = round(now, 2)
                held_ticks += held
                if model is not None and model.cost.ready and model.curve.fitted:
                    live = np.arange(1, model.stride + 1, dtype=np.float64)
                    cost_probes.append([round(now, 2), bs, model.fitted_step_ns(bs, live).round().tolist()])
                if control.generation != generation:
                    generation = control.generation
                    if loop is None:
                        engine.set_policy(control.policy, generation, "auto")
                    else:
                        loop.write(control.policy, "auto")
                        to_control[loop.generation] = generation
                    writes.append((round(now, 2), _describe(control.policy)))
                    write_steps.append(engine.steps)
                    if controller.readings().trials_total > trials:   # this write put a trial in force
                        trial_writes.append(round(now, 2))
                    on_trial = [controller.model.edges[index] for index, state in controller.model.trials.items()
                                if state.active is not None]
                    if on_trial:
                        trial_buckets.append((round(now, 2), on_trial))
                    if controller.model.changes > changes_seen and _every_row(control.policy):
                        stopgap_writes.append(round(now, 2))
                    changes_seen = controller.model.changes
                    trials = controller.readings().trials_total
    result = {"tokens": float(bucket_tokens.sum()), "ns": float(bucket_ns.sum()),
              "bucket_tokens": bucket_tokens.tolist(), "bucket_ns": bucket_ns.tolist(),
              "bucket_given_up": bucket_given_up.tolist(), "bucket_requests": bucket_requests.tolist(),
              "given_up": float(bucket_given_up.sum() / max(bucket_requests.sum(), 1)),
              "second": {key: value.tolist() for key, value in per_second.items()},
              "writes": writes, "trial_writes": trial_writes, "stopgap_writes": stopgap_writes,
              "trial_buckets": trial_buckets, "steps": engine.steps,
              "tick_wall_s": controller.readings().tick_seconds_total if controller is not None else 0.0,
              "write_steps": write_steps, "change_steps": change_steps,
              "sizes": _size_rows(size_tokens, size_ns), "size_live": _size_rows(size_steps, size_live)}
    if controller is not None:
        result["cost_probes"] = cost_probes
        result["metrics"] = {f"vcap_controller_{k}": float(v) for k, v in asdict(controller.readings()).items()}
        result["acceptance_changes"] = controller.model.changes if controller.model else 0
        result["held_share"] = held_ticks / max(ticks, 1)
        result["held"] = holds    # [from, until] of each hold; until None if it held at the end
    result["goodput"] = result["tokens"] / result["ns"] * 1e9
    return result


def from_auto_state(params: dict, auto: dict, change: float, policy: Policy, seed: int = 1, loop=None) -> dict:
    """``policy`` run from the state auto's run was in at ``change``: auto's writes before the
    change replayed at the steps they took effect, then ``policy`` from the first step at or after
    the change (as the change itself: by engine time). On the simulated engine the run is auto's,
    step for step, until then: the same requests in flight, the same backlog. On the GPU each run
    measures its own step times, so the state is auto's only nearly. Runs started at time 0 reach
    a change each in its own state (a rule that drained faster has fewer requests in flight),
    which a time window then scores as speed."""
    at = auto["change_steps"][f"{change:g}"]
    replayed = [(step, policy_of_description(line)) for step, (_, line) in zip(auto["write_steps"], auto["writes"])
                if step < at]
    return run_trace(params, None, seed=seed, loop=loop, schedule=replayed, switch=(change, policy))


# the simulated engine's step-time knobs: on the GPU the step is measured instead
_MODELLED_STEP = ("moe_a_us", "moe_b_us", "moe_row_us", "moe_row_tile", "other_ms", "attention_us_per_request")


def _gpu_engine(loop, params: dict, seed: int):
    """The GPU engine for a trace: its workload, its router skew as the loop's SYNTHETIC routing
    (Zipf exponent, 0 uniform); the modelled step-time knobs (attention included) do not apply."""
    workload = {k: v for k, v in params.items() if k not in _MODELLED_STEP}
    skew = float(workload.pop("router_skew", SimConfig(max_bs=256).router_skew))
    loop.set_routing("uniform" if skew == 0 else f"zipf:{skew:g}")
    return loop.engine_of(seed=seed, **workload)


def _describe(policy: Policy) -> str:
    parts = [f"{b.min_bs}:{b.thresholds[0]:g}:{b.k_min}-{b.k_max}" for b in policy.buckets]
    return " ".join(parts) + f" explore/{policy.explore_period}"


def policy_of_description(text: str) -> Policy:
    """The conf policy a :func:`_describe` line spells (one threshold for every position)."""
    buckets, explore = [], 0
    for part in text.split():
        if part.startswith("explore/"):
            explore = int(part.removeprefix("explore/"))
            continue
        min_bs, threshold, bounds = part.split(":")
        k_min, _, k_max = bounds.partition("-")
        buckets.append(Bucket(int(min_bs), int(k_min), int(k_max or k_min), (float(threshold),) * D))
    if not buckets:
        raise ValueError(f"no bucket in {text!r}")
    return Policy("conf", D, tuple(buckets), explore)


_LOOP = None   # --device cuda: the one GPU loop (segment, MoE layers, graphs per bs) every run shares


def controller_config(fields: str = "", base: ControllerConfig | None = None, **settings) -> ControllerConfig:
    """``FIELD:VALUE,...`` -> ``base`` (default: the committed ``ControllerConfig``) with those
    fields (each value takes its default's type), then ``settings`` on top."""
    parsed, defaults = {}, ControllerConfig()
    for item in filter(None, fields.split(",")):
        key, value = item.split(":", 1)
        default = getattr(defaults, key)
        cast = str if default is None else type(default)
        parsed[key] = cast(float(value) if value in ("inf", "-inf") else value)
    return replace(base or defaults, **{**parsed, **settings})


def _job(args):
    name, params, label, policy, seed = args
    if policy is None:
        CONTROLLER_LOG.debug("=== %s %s seed %d", name, label, seed)
    started = time.perf_counter()
    result = run_trace(params, policy, seed=seed, max_given_up=GUARDRAIL if label == "auto-bounded" else LOOSE,
                       loop=_LOOP)
    result["wall_s"] = time.perf_counter() - started
    return name, label, result


def _ranked(runs: dict, start: float, end: float) -> list[str]:
    """The labels of ``runs`` by goodput over engine seconds ``[start, end)``, best first."""
    return sorted(runs, key=lambda label: _window(runs[label], start, end)[0], reverse=True)


def _best_after(static: dict, params: dict, change: float, auto: dict | None = None) -> list[str]:
    """The static rules by goodput over the segment after ``change`` (to the next change), best
    first; with ``auto``'s run, alternately at its batch sizes and requests
    (:func:`_matched_goodput`, the rules it can read) and as run. A drain leaves each run from
    time 0 its own batch: ranked as run alone, the six rules run from auto's state in drawn31-7-shift
    on the GPU were ones auto led by 2-15%, and k=4, the first at its batch sizes, was not among
    them (thirty-first round)."""
    end = min([c for c in changes_of(params) if c > change] + [float(params["seconds"])])
    as_run = _ranked(static, change, end)
    if auto is None or "sizes" not in auto:
        return as_run
    matched = {label: _matched_goodput(run, auto, change, end) for label, run in static.items()}
    read = sorted((label for label in static if matched[label] is not None), key=matched.get, reverse=True)
    return list(dict.fromkeys(label for pair in itertools.zip_longest(read, as_run) for label in pair if label))


def replica_jobs(traces: dict, replicas: int, seed: int, simulated: bool = True) -> list[tuple]:
    """``--replicas``: auto and off run again, ``replicas`` pairs per trace, each pair in the other
    order from the one before (the first runs had off first), so that a drift of the GPU over the
    call reads as spread, not as a lead."""
    return [(name, replica_params(params, i, simulated), label, STATIC.get(label), seed)
            for name, params in traces.items()
            for i in range(replicas) for label in (("auto", "off") if i % 2 == 0 else ("off", "auto"))]


def replica_params(params: dict, index: int, simulated: bool) -> dict:
    """The trace as the pair of replicas ``index`` (from 0) runs it. On the simulator each pair
    draws its own step-time jitter (``jitter_seed``; with ``--step-noise``), as each run on the GPU
    measures its own step times; without jitter the replicas repeat the first runs."""
    return {**params, "jitter_seed": index + 1} if simulated else params


def _from_state_job(args):
    name, params, label, auto, change, seed, slot = args
    return name, change, label, slot, from_auto_state(params, auto, change, STATIC[label], seed=seed, loop=_LOOP)


def _combine(static: dict, max_given_up: float) -> Policy:
    """Per bucket, the static policy with the best goodput over that bucket's steps among those
    that gave up at most ``max_given_up`` accepted drafts per request-step there."""
    buckets = []
    for i, edge in enumerate(EDGES):
        best, best_goodput = "off", -1.0
        for label, result in static.items():
            requests = max(result["bucket_requests"][i], 1)
            if result["bucket_ns"][i] > 0 and result["bucket_given_up"][i] / requests <= max_given_up:
                goodput = result["bucket_tokens"][i] / result["bucket_ns"][i]
                if goodput > best_goodput:
                    best, best_goodput = label, goodput
        policy = STATIC[best]
        if policy.mode == "off":
            rule = Bucket(edge, D, D, (0.0,) * D)
        elif policy.mode == "fixed":
            rule = Bucket(edge, policy.fixed_k, policy.fixed_k, (0.0,) * D)
        else:
            b = policy.buckets[0]
            rule = Bucket(edge, b.k_min, b.k_max, b.thresholds)
        buckets.append(rule)
    return Policy("conf", D, tuple(buckets))


def _window(result: dict, start: float, end: float) -> tuple[float, float]:
    """(goodput, tokens given up per request-step) over engine seconds ``[start, end)``."""
    second, lo, hi = result["second"], int(start), int(end)
    tokens, ns = sum(second["tokens"][lo:hi]), sum(second["ns"][lo:hi])
    given_up, requests = sum(second["given_up"][lo:hi]), sum(second["requests"][lo:hi])
    return (tokens / ns * 1e9 if ns else 0.0), (given_up / requests if requests else 0.0)


def _potential(result: dict, start: float, end: float, drafts: float) -> float | None:
    """Tokens per request-step the window's rows would commit with ``drafts`` drafts verified each
    (interpolated between whole numbers; exact, from the simulator's draws): how well the requests
    then in that run's batch are accepted at that depth, whatever its rule. None for a result
    file written before this was recorded."""
    second, lo, hi = result["second"], int(start), int(end)
    if "accepted_within" not in second:
        return None
    requests = sum(second["requests"][lo:hi])
    if not requests:
        return None
    within = np.asarray(second["accepted_within"][lo:hi], dtype=np.float64).sum(axis=0)   # k = 1..D
    return 1.0 + float(np.interp(drafts, np.arange(len(within) + 1), np.concatenate([[0.0], within]))) / requests


def _best(candidates: dict, start: float, end: float, limit: float) -> tuple[float, str]:
    scores = {label: _window(r, start, end) for label, r in candidates.items()}
    feasible = {label: g for label, (g, up) in scores.items() if up <= limit} or {"off": scores["off"][0]}
    label = max(feasible, key=feasible.get)
    return feasible[label], label


def windows_of(params: dict) -> list[tuple[str, float, float]]:
    """(kind, start, end) windows of a trace: cold, transition after each change, steady."""
    seconds, changes = float(params["seconds"]), changes_of(params)
    windows = [("cold", 0.0, float(COLD_S))]
    steady_start = float(COLD_S)
    for change in changes:
        if change > steady_start:
            windows.append(("steady", steady_start, change))
        windows.append(("transition", change, min(change + TRANSITION_S, seconds)))
        steady_start = change + TRANSITION_S
    if steady_start < seconds - 1:
        windows.append(("steady", steady_start, seconds))
    return windows


def _settle(auto: dict, candidates: dict, change: float, end: float, limit: float,
            reference: dict | None = None, window_s: int = SETTLE_WINDOW_S,
            scaled: Callable[[dict, dict, float, float], float | None] | None = None) -> float | None:
    """First time after ``change`` from which every ``window_s`` window of auto until ``end`` is
    within 2% of that window's best (or, with ``reference``, of that one run over the same window;
    ``scaled``: the reference's goodput as that function reads it against auto's window,
    :func:`_adjusted_goodput` at auto's requests or :func:`_batch_goodput` at its batch sizes).
    A window the reading cannot read counts as not settled, so the time is an upper bound: a run
    settles from the first time after which every window is read and within 2% (thirty-third
    round; before, one unread window anywhere gave None)."""
    return _first_settled(_settle_ratios(auto, candidates, change, end, limit, reference, window_s, scaled), change)


def _settle_ratios(auto: dict, candidates: dict, change: float, end: float, limit: float,
                   reference: dict | None = None, window_s: int = SETTLE_WINDOW_S,
                   scaled: Callable[[dict, dict, float, float], float | None] | None = None) -> list[float | None]:
    """:func:`_settle`'s reading of each window, one starting every second from ``change``: auto's
    goodput over the target's (None where the reading cannot read the window)."""
    def target(s):
        if scaled is not None:
            return scaled(reference, auto, s, s + window_s)
        if reference is not None:
            return _window(reference, s, s + window_s)[0]
        return _best(candidates, s, s + window_s, limit)[0]

    ratios = []
    for s in range(int(change), int(end) - window_s + 1):
        value = target(s)
        goodput = _window(auto, s, s + window_s)[0]
        ratios.append(None if value is None else goodput / value if value else math.inf)
    return ratios


def _first_settled(ratios: list[float | None], change: float) -> float | None:
    """Seconds from ``change`` to the first window from which every one is read and within 2%."""
    ok = [ratio is not None and ratio >= 0.98 for ratio in ratios]
    for index in range(len(ok)):
        if all(ok[index:]):
            return float(int(change) + index - change)
    return None


def pooled_settle(autos: list[dict], change: float, segment_end: float) -> tuple[float | None, float | None] | None:
    """Every auto run against the new best run from its own state at ``change``, by (f) in 10 s
    windows, read together: the geometric mean of the runs' ratios in each window, and the settle
    time of that mean; the same for each run's next best static rule. One run cannot resolve the
    2% margin on the GPU (a rule run twice from one state reads up to 3% apart in a window,
    thirty-third round); the mean of n runs has 1/sqrt(n) of that noise, and the next best's mean
    shows what is left. A window read by fewer than half of the runs counts as not settled.
    None where a run lacks the rules from its state or the per-size record."""
    series = {"auto": [], "twin": []}
    for run in autos:
        runs = run.get("from_state", {}).get(f"{change:g}")
        if not runs or len(runs) < 2 or not _sized(run, runs):
            return None
        best, twin = _ranked(runs, change, segment_end)[:2]
        for who, reader in (("auto", run), ("twin", runs[twin])):
            series[who].append(_settle_ratios(reader, {}, change, segment_end, LOOSE, reference=runs[best],
                                              window_s=SETTLE_LONG_WINDOW_S, scaled=_matched_goodput))

    def pooled(per_run: list[list]) -> list[float | None]:
        means = []
        for window in zip(*per_run):
            read = [math.log(ratio) if ratio > 0 else -math.inf for ratio in window if ratio is not None]
            means.append(math.exp(sum(read) / len(read)) if 2 * len(read) >= len(window) else None)
        return means

    return _first_settled(pooled(series["auto"]), change), _first_settled(pooled(series["twin"]), change)


def _batch_goodput(run: dict, at: dict, start: float, end: float) -> float | None:
    """``run``'s goodput over the window at ``at``'s batch sizes: ``at``'s goodput times the ratio
    of what the two runs make of ``at``'s engine time at each batch size they both served then
    (tokens per ns there, weighted by ``at``'s ns there). A drain leaves runs from one state with
    different batches tens of seconds on, and a larger batch is faster (twenty-ninth round). Exact
    batch sizes where both runs record them (since the thirtieth round), else batch-size buckets
    (since the twenty-ninth). None without either record, or where the sizes both served hold
    less than half of ``at``'s time."""
    served = _served(run, at, int(start), int(end))
    if served is None:
        return None
    (run_tokens, run_ns), (at_tokens, at_ns) = served
    both = (run_ns > 0) & (at_ns > 0)
    if at_ns[both].sum() < 0.5 * at_ns.sum():
        return None
    theirs = (at_ns[both] * run_tokens[both] / run_ns[both]).sum()
    own = at_tokens[both].sum()
    return _window(at, start, end)[0] * theirs / own


def _served(run: dict, at: dict, lo: int, hi: int) -> tuple | None:
    """Tokens and engine ns of each run over seconds ``[lo, hi)``, per exact batch size where both
    record it, else per batch-size bucket; None where either lacks both records."""
    if "sizes" in run and "sizes" in at:
        length = 1 + int(max(np.max(np.reshape(r["sizes"], (-1, 4))[:, 1], initial=0) for r in (run, at)))
        return _by_size(run["sizes"], lo, hi, length), _by_size(at["sizes"], lo, hi, length)
    if "bucket_ns" not in run["second"] or "bucket_ns" not in at["second"]:
        return None
    return tuple(tuple(np.sum(r["second"][key][lo:hi], axis=0) for key in ("bucket_tokens", "bucket_ns"))
                 for r in (run, at))


def _size_rows(tokens: np.ndarray, ns: np.ndarray) -> list:
    """``[second, batch size, tokens, ns]`` (or steps and live rows) for each (second, size) with
    steps: the sparse form of the per-second, per-size record (a run visits a few sizes a second)."""
    return [[int(s), int(b), float(tokens[s, b]), float(ns[s, b])] for s, b in zip(*np.nonzero(ns))]


def _by_size(rows: list, lo: int, hi: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and ns per batch size (``length`` of them) over seconds ``[lo, hi)`` of
    :func:`_size_rows`' rows."""
    table = np.asarray(rows, dtype=np.float64).reshape(-1, 4)
    table = table[(table[:, 0] >= lo) & (table[:, 0] < hi)]
    sizes = table[:, 1].astype(int)
    return (np.bincount(sizes, weights=table[:, 2], minlength=length),
            np.bincount(sizes, weights=table[:, 3], minlength=length))


def _adjusted_goodput(run: dict, at: dict, start: float, end: float) -> float | None:
    """``run``'s goodput over the window scaled to the requests in ``at``'s batch then: by the
    ratio of the tokens the two runs' rows would commit at ``run``'s own mean depth (its live rows
    per request less one, :func:`_potential`). At bs 8 the batch is 8 requests, and two runs'
    batches hold requests accepted several percent apart in a 10 s window (twenty-seventh round).
    None where a file lacks the per-depth record."""
    second, lo, hi = run["second"], int(start), int(end)
    requests = sum(second["requests"][lo:hi])
    if not requests or "accepted_within" not in second:
        return None
    drafts = sum(second["live"][lo:hi]) / requests - 1.0
    own, theirs = _potential(run, start, end, drafts), _potential(at, start, end, drafts)
    if own is None or theirs is None:
        return None
    return _window(run, start, end)[0] * theirs / own


def _matched_goodput(run: dict, at: dict, start: float, end: float) -> float | None:
    """``run``'s goodput over the window at ``at``'s batch sizes (:func:`_batch_goodput`) and
    with ``at``'s requests (the ratio of :func:`_adjusted_goodput`). In a drain both part: the
    runs from one state hold different numbers of requests, and different ones, tens of seconds on
    (a rule that commits more per step finishes the well-accepted requests sooner; thirtieth
    round). None where either reading is."""
    at_batch, adjusted = _batch_goodput(run, at, start, end), _adjusted_goodput(run, at, start, end)
    if at_batch is None or adjusted is None:
        return None
    own = _window(run, start, end)[0]
    return at_batch * adjusted / own if own else None


def _regret_read(auto: dict, runs, start: float, end: float,
                 reading: Callable[[dict, dict, float, float], float | None] | None = None) -> tuple[float | None, int]:
    """auto's regret over ``[start, end)`` against the best of ``runs``, each read against auto by
    ``reading`` (as run without one), and how many of them the reading cannot read (a regret of
    None where it reads none). Where some are not read, the regret is a lower bound."""
    goodputs = [_window(run, start, end)[0] if reading is None else reading(run, auto, start, end) for run in runs]
    read = [goodput for goodput in goodputs if goodput is not None]
    return (1 - _window(auto, start, end)[0] / max(read) if read else None), len(goodputs) - len(read)


def _mean_live(auto: dict, lo: int, hi: int) -> float:
    second = auto["second"]
    requests = sum(second["requests"][lo:hi])
    return sum(second["live"][lo:hi]) / requests if requests else 0.0


def _reversals(auto: dict, change: float, end: float) -> int:
    """Writes in ``[change, end)`` whose effect on the measured mean live length (the 2 s after
    the write against the 2 s before it) reverses the direction of the previous effective one."""
    directions = []
    for when, _ in auto["writes"]:
        if change <= when < end:
            delta = _mean_live(auto, int(when) + 1, int(when) + 3) - _mean_live(auto, max(int(when) - 2, 0), int(when))
            if abs(delta) > 0.05:
                directions.append(np.sign(delta))
    return int(sum(a != b for a, b in zip(directions, directions[1:])))


def _rows_direction(old: Bucket, new: Bucket) -> int:
    """+1 when rule ``new`` verifies at least the rows ``old`` does on every confidence row and is
    not the same rule, -1 when at most, 0 when the same or when neither holds. Exact without data:
    the engine's rule (``engine_hook/reference.live_lengths``) never verifies fewer rows for a
    lower threshold at any position or a higher ``k_min`` or ``k_max``."""
    more = (all(n <= o for n, o in zip(new.thresholds, old.thresholds))
            and new.k_min >= old.k_min and new.k_max >= old.k_max)
    fewer = (all(n >= o for n, o in zip(new.thresholds, old.thresholds))
             and new.k_min <= old.k_min and new.k_max <= old.k_max)
    return int(more) - int(fewer)


def _every_row(policy: Policy) -> bool:
    return all(bucket.k_min >= D for bucket in policy.buckets)


def _stopgaps(auto: dict) -> set:
    """The times of auto's stopgap writes (every row, after a change of acceptance): recorded
    since the thirty-first round; before, every write of every row (only the stopgap wrote one in
    those files' change traces)."""
    if "stopgap_writes" in auto:
        return set(auto["stopgap_writes"])
    return {when for when, text in auto["writes"] if _every_row(policy_of_description(text))}


def _bucket_reversals(auto: dict, change: float, end: float, reset_at_stopgap: bool = False) -> int:
    """Reversals of the choice read from the rules, bucket by bucket: the trials' writes left out,
    each other write in ``[change, end)`` against the rules in force before it, in every bucket
    the run's load reached; a reversal is a bucket's rule moving back the way its last move went
    (:func:`_rows_direction`). The most in any one bucket: a write moves the neighbouring buckets
    a load reaches now and then with the busy one, and that is one change of mind, not several.
    Unlike :func:`_choice_reversals` it does not read the measured live length, which in a drain
    moves with the load across buckets. ``reset_at_stopgap``: the stopgap after a change of
    acceptance (every row, :func:`_stopgaps`) is the start of a new approach, not a move: the
    moves after it are counted from it, as from the run's start. Files since the thirty-second
    round record which buckets are on trial at each write (a trial runs until measured, over
    writes made for other buckets): those buckets are left out of each write, and the others
    counted, trial writes included; in older files a trial's whole write is left out."""
    per_bucket = "trial_buckets" in auto
    on_trial = {when: set(edges) for when, edges in auto.get("trial_buckets", ())}
    trials = set() if per_bucket else set(auto.get("trial_writes", ()))
    stopgaps = _stopgaps(auto) if reset_at_stopgap else set()
    reached = [edge for edge, ns in zip(EDGES, auto["bucket_ns"]) if ns > 0]
    chosen = {edge: rule_at(default_policy(D), edge, D) for edge in reached}   # auto starts at every draft
    directions = {edge: [] for edge in reached}
    for when, text in auto["writes"]:
        if when >= end:
            break
        if when in trials:   # a trial and the return from it are a measurement
            continue
        written = policy_of_description(text)
        if when in stopgaps:
            directions = {edge: [] for edge in reached}
        for edge in reached:
            if edge in on_trial.get(when, ()):
                continue
            rule = rule_at(written, edge, D)
            step = _rows_direction(chosen[edge], rule)
            if step and when >= change and when not in stopgaps:
                directions[edge].append(step)
            chosen[edge] = rule
    return max((int(sum(a != b for a, b in zip(moves, moves[1:]))) for moves in directions.values()), default=0)


def _choice_reversals(auto: dict, change: float, end: float) -> int:
    """Reversals of the choice: the trials' writes left out, each other write's level (mean live
    length in the 2 s after it, up to the next write) against the previous choice's (or the 2 s
    before ``change``). A trial and the return from it are a measurement, not a change of mind."""
    trials = set(auto.get("trial_writes", ()))
    times = [when for when, _ in auto["writes"] if change <= when < end]
    levels = [_mean_live(auto, max(int(change) - 2, 0), int(change))]
    for index, when in enumerate(times):
        if when in trials:
            continue
        until = int(times[index + 1]) if index + 1 < len(times) else int(end)
        levels.append(_mean_live(auto, int(when) + 1, max(min(int(when) + 3, until), int(when) + 2)))
    directions = [np.sign(b - a) for a, b in zip(levels, levels[1:]) if abs(b - a) > 0.05]
    return int(sum(a != b for a, b in zip(directions, directions[1:])))


def _from_state_scores(auto: dict, runs: dict, change: float, end: float, segment_end: float) -> dict:
    """Auto after ``change`` against the static rules run from its state there (``runs``:
    :func:`from_auto_state`'s, by label): the new best (best over the segment) and the next best,
    auto's regret over the transition window against that window's best of them, and the settle
    time of auto and of the next best against the new best, in 5 s and 10 s windows."""
    best, twin = _ranked(runs, change, segment_end)[:2]
    row = {"from_state_best_label": best, "from_state_twin_label": twin,
           "auto_regret_from_state": _regret_read(auto, runs.values(), change, end)[0]}
    for who, run in (("auto", auto), ("twin", runs[twin])):
        for window_s in (SETTLE_WINDOW_S, SETTLE_LONG_WINDOW_S):
            row[f"{who}_settle_from_state_{window_s}s"] = _settle(run, {}, change, segment_end, LOOSE,
                                                                  reference=runs[best], window_s=window_s)
    adjusted, unread = _regret_read(auto, runs.values(), change, end, _adjusted_goodput)
    if not unread:
        row["auto_regret_from_state_adjusted"] = adjusted
    # the per-depth record since the twenty-seventh round, the per-bucket one since the twenty-ninth,
    # the per-size one since the thirtieth
    readings = {"adjusted": (not unread, _adjusted_goodput),
                "at_batch": ("bucket_ns" in auto["second"] or "sizes" in auto, _batch_goodput),
                "matched": (_sized(auto, runs), _matched_goodput)}
    for suffix, (recorded, reading) in readings.items():
        if recorded:
            for who, run in (("auto", auto), ("twin", runs[twin])):
                row[f"{who}_settle_from_state_{SETTLE_LONG_WINDOW_S}s_{suffix}"] = _settle(
                    run, {}, change, segment_end, LOOSE, reference=runs[best], window_s=SETTLE_LONG_WINDOW_S,
                    scaled=reading)
    return row


def _sized(auto: dict, runs: dict) -> bool:
    """Whether auto and every run from its state record exact batch sizes (files since the thirtieth
    round), which reading (f) needs."""
    return "sizes" in auto and all("sizes" in run for run in runs.values())


def _candidates(by_label: dict) -> dict:
    """The runs auto is scored against: every static rule and the hindsight combinations."""
    return {k: v for k, v in by_label.items() if k in STATIC or k.startswith("hindsight")}


def score(name: str, params: dict, by_label: dict) -> dict:
    """Per window: auto and auto-bounded against the unconstrained and the constrained best."""
    candidates = _candidates(by_label)
    off = by_label["off"]["goodput"]
    rows = []
    bounds = [0.0, *changes_of(params), float(params["seconds"])]
    for kind, start, end in windows_of(params):
        best_free, label_free = _best(candidates, start, end, LOOSE)
        best_held, label_held = _best(candidates, start, end, GUARDRAIL)
        # the segment between changes that holds this window, and the one candidate best over it
        # ("the new best" after a change). The floor: that candidate's regret in this window. The
        # window's best is a maximum over ~24 noisy estimates; a rule that never changes scores
        # this much regret by chance alone
        segment_end = min(b for b in bounds if b > start)
        _, segment_label = _best(candidates, max(b for b in bounds if b <= start), segment_end, LOOSE)
        row = {"trace": name, "window": kind, "start": start, "end": end,
               "off": _window(by_label["off"], start, end)[0],
               "best_free": best_free, "best_free_label": label_free,
               "best_held": best_held, "best_held_label": label_held,
               "floor_label": segment_label, "floor": 1 - _window(by_label[segment_label], start, end)[0] / best_free}
        # the same regret with every candidate at auto's batch sizes (a drain leaves each run its
        # own; recorded since the twenty-ninth round), and at its batch sizes and requests (since
        # the thirtieth): against the candidates each reading can read, and how many it cannot
        auto = by_label["auto"]
        regret, row["at_batch_unread"] = _regret_read(auto, candidates.values(), start, end, _batch_goodput)
        if regret is not None:
            row["auto_regret_free_at_batch"] = regret
        regret, row["matched_unread"] = _regret_read(auto, candidates.values(), start, end, _matched_goodput)
        if regret is not None and "sizes" in auto:
            row["auto_regret_free_matched"] = regret
        # the steady window after a change, against the rules run from auto's state at the change:
        # runs from time 0 reach the end of a drain each with its own batch
        from_state = auto.get("from_state", {}).get(f"{start - TRANSITION_S:g}") if kind == "steady" else None
        if from_state:
            row["auto_regret_from_state"], _ = _regret_read(auto, from_state.values(), start, end)
            if "sizes" in auto:
                row["auto_regret_from_state_matched"], row["from_state_matched_unread"] = _regret_read(
                    auto, from_state.values(), start, end, _matched_goodput)
        for auto_label in ("auto", "auto-bounded"):
            goodput, given_up = _window(by_label[auto_label], start, end)
            row[auto_label] = goodput
            row[f"{auto_label}_given_up"] = given_up
            row[f"{auto_label}_regret_free"] = 1 - goodput / best_free
            row[f"{auto_label}_regret_held"] = 1 - goodput / best_held
            row[f"{auto_label}_vs_off"] = goodput / row["off"] - 1 if row["off"] else 0.0
        if "replicas" in auto:
            row["auto_vs_off_pairs"] = vs_off_pairs(by_label, start, end)
            row["auto_vs_off_pairs_at_sizes"] = vs_off_pairs_at_sizes(by_label, start, end)
            row["own_spread"] = {label: own_spread(by_label, label, start, end) for label in ("auto", "off")}
            row["replica_regret"] = {label: [1 - _window(run, start, end)[0] / best_free
                                             for run in runs_of(by_label, label)] for label in ("auto", "off")}
            # the steady window after a change, from each auto run's own state there, by (f): the
            # first run's reading is the one above
            change = f"{start - TRANSITION_S:g}"
            replicas = _replicas_from_state(by_label, change)
            if kind == "steady" and replicas and "auto_regret_from_state_matched" in row:
                row["replica_regret_from_state"] = [
                    (row["auto_regret_from_state_matched"], row["from_state_matched_unread"]),
                    *(_regret_read(run, run["from_state"][change].values(), start, end, _matched_goodput)
                      for run in replicas)]
        if kind == "transition":
            # the per-window best is a maximum over ~20 noisy 5 s estimates, which the new best
            # itself does not stay within 2% of (its own settle time under that test is shown)
            new_best = segment_label
            row["segment_best_label"] = new_best
            row["segment_best_settle_s"] = _settle(by_label[new_best], candidates, start, segment_end, LOOSE)
            # the noise of the settle test: the static rule next best to the new best after the
            # transition (a rule that never changes), judged by the same test against the new best
            twin_goodput, twin = max((_window(by_label[k], end, segment_end)[0], k) for k in STATIC
                                     if k != new_best and end < segment_end) if end < segment_end else (0.0, None)
            row["twin_label"] = twin
            if twin is not None:
                row["twin_ratio"] = twin_goodput / _window(by_label[new_best], end, segment_end)[0]
                row["twin_settle_s"] = _settle(by_label[twin], candidates, start, segment_end, LOOSE,
                                               reference=by_label[new_best])
                row["twin_settle_10s"] = _settle(by_label[twin], candidates, start, segment_end, LOOSE,
                                                 reference=by_label[new_best], window_s=SETTLE_LONG_WINDOW_S)
            from_state = by_label["auto"].get("from_state", {}).get(f"{start:g}")
            if from_state:
                row.update(_from_state_scores(by_label["auto"], from_state, start, end, segment_end))
            if "replicas" in auto:   # each run of auto and of off against the new best as run, in 10 s windows
                row["replica_settle_10s"] = {label: [_settle(run, candidates, start, segment_end, LOOSE,
                                                             reference=by_label[new_best], window_s=SETTLE_LONG_WINDOW_S)
                                                     for run in runs_of(by_label, label)] for label in ("auto", "off")}
                # and each against the rules run from its own state at the change, by (f): the first
                # run's reading is the one just made
                replicas = _replicas_from_state(by_label, f"{start:g}")
                if from_state and replicas:
                    readings = [row, *(_from_state_scores(run, run["from_state"][f"{start:g}"], start, end, segment_end)
                                       for run in replicas)]
                    row["replica_settle_from_state"] = [
                        (r.get("auto_settle_from_state_10s_matched"), r.get("twin_settle_from_state_10s_matched"))
                        for r in readings]
                    row["pooled_settle_from_state"] = pooled_settle([auto, *replicas], start, segment_end)
            for auto_label, limit in (("auto", LOOSE), ("auto-bounded", GUARDRAIL)):
                row[f"{auto_label}_settle_segment_s"] = _settle(by_label[auto_label], candidates, start, segment_end,
                                                                LOOSE, reference=by_label[new_best])
                row[f"{auto_label}_settle_segment_10s"] = _settle(by_label[auto_label], candidates, start, segment_end,
                                                                  LOOSE, reference=by_label[new_best],
                                                                  window_s=SETTLE_LONG_WINDOW_S)
                after = [when for when, _ in by_label[auto_label]["writes"] if start <= when < segment_end]
                row[f"{auto_label}_last_write_s"] = round(after[-1] - start, 2) if after else None
                row[f"{auto_label}_settle_s"] = _settle(by_label[auto_label], candidates, start, segment_end, LOOSE)
                row[f"{auto_label}_settle_held_s"] = _settle(by_label[auto_label], candidates, start, segment_end, limit)
                row[f"{auto_label}_reversals"] = _reversals(by_label[auto_label], start, segment_end)
                row[f"{auto_label}_choice_reversals"] = _choice_reversals(by_label[auto_label], start, segment_end)
                row[f"{auto_label}_bucket_reversals"] = _bucket_reversals(by_label[auto_label], start, segment_end)
                row[f"{auto_label}_bucket_reversals_reset"] = _bucket_reversals(by_label[auto_label], start, segment_end,
                                                                                reset_at_stopgap=True)
                row[f"{auto_label}_trial_writes"] = sum(start <= when < segment_end
                                                        for when in by_label[auto_label].get("trial_writes", ()))
        rows.append(row)
    whole = {"trace": name, "off": off, "writes": {k: len(by_label[k]["writes"]) for k in ("auto", "auto-bounded")},
             "vs_off": {k: by_label[k]["goodput"] / off - 1 for k in ("auto", "auto-bounded")},
             "vs_off_pairs": vs_off_pairs(by_label),
             "vs_off_pairs_at_sizes": vs_off_pairs_at_sizes(by_label),
             "given_up": {k: by_label[k]["given_up"] for k in ("auto", "auto-bounded")},
             "first_write_s": {k: (by_label[k]["writes"][0][0] if by_label[k]["writes"] else None)
                               for k in ("auto", "auto-bounded")},
             "acceptance_changes": {k: by_label[k].get("acceptance_changes") for k in ("auto", "auto-bounded")},
             "last_policy": {k: (by_label[k]["writes"][-1][1] if by_label[k]["writes"] else "off")
                             for k in ("auto", "auto-bounded")},
             "expert_curve_r2": by_label["auto"]["metrics"]["vcap_controller_expert_curve_fit_r2"],
             "cost_r2": by_label["auto"]["metrics"]["vcap_controller_cost_fit_r2"]}
    return {"windows": rows, "whole": whole}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="traces of at most 40 s (changes at 15 s)")
    parser.add_argument("--only", default=None, help="comma-separated trace names")
    parser.add_argument("--drawn", type=int, default=0, metavar="N",
                        help="run N traces drawn at random (drawn_traces) instead of the named ones; --only and "
                             "--quick apply to them")
    parser.add_argument("--draw-seed", type=int, default=1, help="--drawn: the draw's seed (not the runs')")
    parser.add_argument("--steady-bs", type=int, default=0, metavar="N",
                        help="run each trace as a steady load of batch size N for 40 s, without its changes: "
                             "what its rules are worth where nothing moves (thirtieth round)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--long", type=float, default=0.0,
                        help=f"also run auto this many seconds on {LONG_TRACE} for writes per hour")
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: every run on the GPU engine (bench_loop's: real hook, router and MoE kernels, "
                             "measured step times; --jobs ignored)")
    parser.add_argument("--preset", default="v4.1", help="--device cuda: bench_loop's MoE preset")
    parser.add_argument("--run-layers", type=int, default=2, help="--device cuda: MoE layers run (times scaled up)")
    parser.add_argument("--other-ms", type=float, default=2.0, help="--device cuda: stated non-MoE part of a step")
    parser.add_argument("--controller", default="", metavar="FIELD:VALUE,...",
                        help="run auto and auto-bounded with these ControllerConfig fields (a variant; "
                             "not max_tokens_given_up, which tells the two apart)")
    parser.add_argument("--from-state", type=int, default=None, metavar="N",
                        help="after each change also run the N static rules best over the segment after it (from "
                             "time 0) from auto's state there: the settle test's fair reference (default all "
                             f"{len(STATIC)}; 0 with --device cuda, where all of them double the device time)")
    parser.add_argument("--also-from-state", default="", metavar="RULE,...",
                        help="with --from-state: these static rules too, from auto's state at every change (a "
                             "rule that leads a later window from time 0 but not the segment after the change)")
    parser.add_argument("--again", action=argparse.BooleanOptionalAction, default=None,
                        help="with --from-state: run the first rule from auto's state twice, and report how far "
                             "the two runs lie apart (the measurement's own noise; default: with --device cuda, "
                             "where each run measures its own step times)")
    parser.add_argument("--replicas", type=int, default=0, metavar="N",
                        help="run auto and off N more times each (pairs in alternating order) and report auto vs "
                             "off over the N + 1 pairs: on the GPU each run measures its own step times, and one "
                             "pair does not resolve 1%% (thirty-sixth round); on the simulator they repeat the first, "
                             "or with --step-noise each pair draws its own step-time jitter. "
                             "With --from-state/--also-from-state the rules also run from each auto replica's state")
    parser.add_argument("--step-noise", type=float, default=0.0, metavar="SIGMA",
                        help="simulator: every step time of every trace times exp(N(0, SIGMA)), SYNTHETIC jitter "
                             "(the drawn traces that have it draw 0.005-0.02), and with --replicas each pair its own")
    parser.add_argument("--controller-log", default=None, metavar="FILE",
                        help="write the decisions of auto and auto-bounded (the vcap.controller logger at DEBUG: "
                             "per busy bucket the rule judged, the choice and the five best predicted; each tick's "
                             "engine time) to FILE; with --jobs above 1 two runs' lines interleave")
    parser.add_argument("--summarize", default=None, metavar="A.json,B.json,...",
                        help="print auto's regret per window over the --json files of several seeds (.json or .json.xz) and exit")
    parser.add_argument("--goals", default=None, metavar="A.json,B.json,...",
                        help="print issue 12's goals, each as read from the --json files (.json or .json.xz), met or "
                             "missed, and exit")
    args = parser.parse_args(argv)
    if args.summarize:
        _summarize(args.summarize.split(","))
        return 0
    if args.goals:
        _print_goals(args.goals.split(","))
        return 0
    if "max_tokens_given_up" in args.controller:
        parser.error("--controller: auto and auto-bounded set max_tokens_given_up themselves (none, and 0.1)")
    try:
        controller_config(args.controller)   # fail early on a bad field, before it is in force
    except (AttributeError, TypeError, ValueError) as e:
        parser.error(f"--controller {args.controller!r}: {e}")
    global CONTROLLER_FIELDS
    CONTROLLER_FIELDS = args.controller
    if args.controller_log:
        handler = logging.FileHandler(args.controller_log)
        handler.setFormatter(logging.Formatter("%(message)s"))
        CONTROLLER_LOG.addHandler(handler)
        CONTROLLER_LOG.setLevel(logging.DEBUG)
    if args.from_state is not None and (args.from_state < 0 or args.from_state == 1):
        parser.error("--from-state: 0, or at least 2 (the next best of them is the settle test's noise)")
    from_state = args.from_state if args.from_state is not None else (0 if args.device == "cuda" else len(STATIC))
    also = list(dict.fromkeys(label for label in args.also_from_state.split(",") if label))
    unknown = [label for label in also if label not in STATIC]
    if unknown:
        parser.error(f"--also-from-state: no static rule {', '.join(unknown)} (the rules: {', '.join(STATIC)})")
    if args.replicas < 0:
        parser.error("--replicas: 0 or more")
    if from_state == 0 and len(also) == 1:
        parser.error("--also-from-state: with --from-state 0, at least 2 rules (the next best of them is the "
                     "settle test's noise)")
    if CONTROLLER_FIELDS:
        print(f"auto and auto-bounded run with {CONTROLLER_FIELDS}", file=sys.stderr, flush=True)
    if args.step_noise and args.device == "cuda":
        parser.error("--step-noise: the simulator's; on the GPU each step is measured")
    try:
        SimConfig(max_bs=256, step_noise=args.step_noise)   # the simulator's own bounds, checked before any run
    except ValueError as e:
        parser.error(f"--step-noise: {e}")
    traces = traces_of(args.only, args.quick, args.drawn, args.draw_seed, args.steady_bs, args.step_noise)
    started = time.perf_counter()
    jobs = [(name, params, label, policy, args.seed) for name, params in traces.items() for label, policy in STATIC.items()]
    jobs += [(name, params, label, None, args.seed) for name, params in traces.items() for label in ("auto", "auto-bounded")]
    if args.long:
        jobs.insert(0, (LONG_TRACE + "-long", dict(TRACES[LONG_TRACE], seconds=args.long), "auto", None, args.seed))
    results = {name: {} for name in traces}
    if args.device == "cuda":
        global _LOOP
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_loop
        _LOOP = bench_loop.Loop(argparse.Namespace(preset=args.preset, run_layers=args.run_layers,
                                                   other_ms=args.other_ms, max_bs=256))
        # one run of off first, discarded: on a machine just started, the call's first run (always
        # off's) took 0.6% longer per request over its first 10 s than off's replicas and drained
        # apart from them (thirty-sixth round), which handed every later run a lead over off
        name = next(iter(traces))
        warm_up = _job((name, traces[name], "off", STATIC["off"], args.seed))[2]
        print(f"warm-up, discarded: {name} off {warm_up['goodput']:.1f} tok/s", file=sys.stderr, flush=True)
    with _pool(args) as pool:
        for done, (name, label, result) in enumerate(pool.imap_unordered(_job, jobs), 1):
            results.setdefault(name, {})[label] = result
            print(f"[{done}/{len(jobs)}] {name} {label}: {result['goodput']:.1f} tok/s "
                  f"({result['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        static = {name: {k: v for k, v in results[name].items() if k in STATIC} for name in traces}
        second = [(name, traces[name], "hindsight-held", _combine(static[name], GUARDRAIL), args.seed) for name in traces]
        second += [(name, traces[name], "hindsight-free", _combine(static[name], LOOSE), args.seed) for name in traces]
        for name, label, result in pool.imap_unordered(_job, second):
            results[name][label] = result
        simulated = args.device != "cuda"
        for name, label, result in pool.imap_unordered(_job, replica_jobs(traces, args.replicas, args.seed, simulated)):
            # auto's whole run: the rules from the changes replay its writes, and its trials are scored
            # off's: its batch sizes too, so that each pair is also read at auto's (vs_off_pairs_at_sizes)
            kept = result if label == "auto" else {key: result[key] for key in ("second", "goodput", "given_up", "sizes")
                                                   if key in result}
            results[name]["auto"].setdefault("replicas", {}).setdefault(label, []).append(kept)
        if from_state > 0 or also:
            # what a replay needs of auto's runs, copied: the jobs are pickled while results fill in
            replay = {name: [{key: auto[key] for key in ("writes", "write_steps", "change_steps")}
                             for auto in runs_of(results[name], "auto")] for name in traces}
            picks = {(name, change): list(dict.fromkeys(
                         _best_after(static[name], traces[name], change, results[name]["auto"])[:from_state] + also))
                     for name in traces for change in changes_of(traces[name])}
            # the picks from the state of auto's first run (slot "first") and of each replica (slot i:
            # the same rules, so each run's settle time is read against its own new best; each
            # replica's with its own jitter, so that the state replayed is its own)
            third = [(name, traces[name] if i == 0 else replica_params(traces[name], i - 1, simulated), label, auto,
                      change, args.seed, "first" if i == 0 else i - 1)
                     for (name, change), labels in picks.items() for i, auto in enumerate(replay[name])
                     for label in labels]
            # --again: the first pick once more, from the same state: what a run's own measurement varies by
            again = args.again if args.again is not None else args.device == "cuda"
            third += [(name, traces[name], labels[0], replay[name][0], change, args.seed, "again")
                      for (name, change), labels in picks.items() if again and labels]
            for name, change, label, slot, result in pool.imap_unordered(_from_state_job, third):
                auto = results[name]["auto"]
                owner = auto if slot in ("first", "again") else auto["replicas"]["auto"][slot]
                runs = owner.setdefault("from_state_again" if slot == "again" else "from_state", {})
                runs.setdefault(f"{change:g}", {})[label] = {
                    key: result[key] for key in ("second", "given_up", "goodput", "change_steps", "sizes", "size_live")}
            if third:
                print(f"{len(third)} runs from auto's state at the changes", file=sys.stderr, flush=True)
    if _LOOP is not None:
        _LOOP.close()
    scores = {name: score(name, traces[name], results[name]) for name in traces}
    _print(scores, traces)
    if args.long:
        long_run = results[LONG_TRACE + "-long"]["auto"]
        print(f"\nlong run: {LONG_TRACE}, {args.long:.0f} s of engine time, auto (defaults): "
              f"{len(long_run['writes'])} writes, {writes_per_hour(long_run, args.long):.1f} per hour "
              f"after the first {LONG_SETTLE_S:.0f} s; goodput {long_run['goodput']:.1f}; "
              f"writes {long_run['writes']}")
    print(f"total wall time {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "scores": scores, "results": results}, f, default=str)
    return 0


class _InProcess:
    """The one-worker pool of a GPU run: every run in this process, one after another."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, func, jobs):
        return map(func, jobs)


def _pool(args):
    return _InProcess() if args.device == "cuda" else multiprocessing.get_context("fork").Pool(args.jobs)


def traces_of(only: str | None, quick: bool, drawn: int = 0, draw_seed: int = 1, steady_bs: int = 0,
              step_noise: float = 0.0) -> dict:
    """The traces a run covers (``--only``, ``--quick``, ``--drawn``, ``--draw-seed``, ``--steady-bs``,
    ``--step-noise``)."""
    traces = drawn_traces(drawn, draw_seed) if drawn else dict(TRACES)
    if only:
        traces = {k: v for k, v in traces.items() if k in only.split(",")}
    if steady_bs:
        changes = ("shift_bs", "shift_after_s", "accept_change_s", "accept_first_after", "accept_last_after")
        traces = {k: {**{key: value for key, value in v.items() if key not in changes},
                      "load": "steady", "mean_bs": steady_bs, "seconds": 40} for k, v in traces.items()}
    if step_noise:
        traces = {k: dict(v, step_noise=step_noise) for k, v in traces.items()}
    if quick:
        traces = {k: dict(v, seconds=min(v["seconds"], 40), **{key: 15.0 for key in ("shift_after_s", "accept_change_s") if key in v})
                  for k, v in traces.items()}
    return traces


def _rescored(stored: dict) -> dict:
    """A result file's scores (``stored``: the file as read), computed again from its runs (a
    file written before a change of the scoring is scored as today)."""
    args = stored["args"]
    traces = traces_of(args.get("only"), args.get("quick", False), args.get("drawn", 0), args.get("draw_seed", 1),
                       args.get("steady_bs", 0), args.get("step_noise", 0.0))
    return {name: score(name, traces[name], runs) for name, runs in stored["results"].items() if name in traces}


def held_out_floor(seeds: list[dict], index: int, start: float, end: float) -> tuple[str, float] | None:
    """The static rule a chooser that knew the trace but not this seed's luck would hold over
    ``[start, end)``: the one of best mean goodput, relative to each window's best, over the other
    seeds' runs (``seeds``: one ``{label: run}`` per seed, the same trace); and its regret in seed
    ``index``'s window, against the best candidate as auto's regret is scored (:func:`score`). That
    best is a maximum over ~24 noisy estimates of one seed; chosen out of sample, a rule that never
    changes scores this regret by the seed's noise alone. None with fewer than two seeds."""
    if len(seeds) < 2:
        return None

    def ratios(runs: dict) -> dict:
        goodput = {label: _window(run, start, end)[0] for label, run in _candidates(runs).items()}
        best = max(goodput.values())
        return {label: value / best for label, value in goodput.items()}

    others = [ratios(runs) for i, runs in enumerate(seeds) if i != index]
    label = max(STATIC, key=lambda k: sum(r.get(k, 0.0) for r in others))
    return label, 1.0 - ratios(seeds[index])[label]


def timing_noise(runs: dict, window_s: int = SETTLE_LONG_WINDOW_S) -> tuple[list[tuple[str, str]], list[float]]:
    """The measurement's own noise: pairs of static rules that verified the same rows (the same
    live length per request in every second: fixed k, and a threshold rule that never let another
    draft through), and ``|log|`` of their goodput ratio in each ``window_s`` window. Their steps
    are the same; on the simulator their times are too (0), on the GPU each run measures its own."""
    static = {label: run["second"] for label, run in runs.items() if label in STATIC}
    lengths = {label: [live / requests if requests else None for live, requests in zip(s["live"], s["requests"])]
               for label, s in static.items()}
    pairs, gaps = [], []
    for a, b in itertools.combinations(sorted(static), 2):
        n = min(len(lengths[a]), len(lengths[b]))
        if len({value for value in lengths[a][:n] + lengths[b][:n] if value is not None}) != 1:
            continue
        pairs.append((a, b))
        gaps += _window_gaps(runs[a], runs[b], 0, n, window_s)
    return pairs, gaps


def _window_gaps(run: dict, other: dict, start: int, end: int, window_s: int) -> list[float]:
    """``|log|`` of two runs' goodput ratio in each whole ``window_s`` window of ``[start, end)``."""
    return [abs(math.log(_window(run, lo, lo + window_s)[0] / _window(other, lo, lo + window_s)[0]))
            for lo in range(start, end - window_s + 1, window_s)]


def replica_noise(auto: dict, window_s: int = SETTLE_LONG_WINDOW_S, matched: bool = False) -> list[float]:
    """The measurement's own noise from a rule run twice from auto's state at a change
    (``--again``): ``|log|`` of the two runs' goodput ratio in each ``window_s`` window from the
    change on. On the simulator the two runs are one (0); on the GPU each measures its own.
    ``matched``: the two runs as the settle test reads them, by (f) at auto's batch sizes and
    requests (:func:`_matched_goodput`), in a window starting every second (unread ones left out)."""
    gaps = []
    for change, again in auto.get("from_state_again", {}).items():
        for label, run in again.items():
            first = auto["from_state"][change][label]
            n = min(len(first["second"]["tokens"]), len(run["second"]["tokens"]))
            if not matched:
                gaps += _window_gaps(run, first, int(float(change)), n, window_s)
                continue
            for lo in range(int(float(change)), n - window_s + 1):
                pair = [_matched_goodput(r, auto, lo, lo + window_s) for r in (run, first)]
                if None not in pair:
                    gaps.append(abs(math.log(pair[0] / pair[1])))
    return gaps


def runs_of(by_label: dict, label: str) -> list[dict]:
    """``label``'s runs (``auto`` or ``off``): the first, then its ``--replicas``."""
    return [by_label[label], *by_label["auto"].get("replicas", {}).get(label, [])]


def _replicas_from_state(by_label: dict, change: str) -> list[dict]:
    """auto's ``--replicas`` that have rules run from their own state at ``change`` (engine s, as keyed)."""
    return [run for run in runs_of(by_label, "auto")[1:] if change in run.get("from_state", {})]


def vs_off_pairs(by_label: dict, start: float | None = None, end: float | None = None) -> list[float]:
    """auto against off in each pair of runs: the first two, then each ``--replicas`` pair, over
    engine seconds ``[start, end)`` (None: the whole trace); auto's goodput over off's, minus 1.
    On the GPU each run measures its own step times, so the pairs differ by the measurement's
    noise and by the drains it sets off; on the simulator every pair is the first."""
    autos, offs = runs_of(by_label, "auto"), runs_of(by_label, "off")

    def goodput(run: dict) -> float:
        return run["goodput"] if start is None else _window(run, start, end)[0]

    return [goodput(auto) / goodput(off) - 1 for auto, off in zip(autos, offs) if goodput(off)]


def vs_off_pairs_at_sizes(by_label: dict, start: float | None = None, end: float | None = None) -> list[float | None]:
    """:func:`vs_off_pairs` with each pair's ``off`` read at its auto's batch sizes (:func:`_batch_goodput`).
    The simulator's load only adds requests up to the demand, so a run that finishes requests sooner
    holds fewer of them through each dip of the (paired) demand: on the H100, drawn53-4-shift's auto
    was 0.5% faster per request than ``off`` and held 1.4% fewer requests (forty-fourth round). None
    for a pair that cannot be read so (``off``'s replicas record their sizes since that round; the
    sizes both served hold less than half of auto's time)."""
    readings = []
    for auto, off in zip(runs_of(by_label, "auto"), runs_of(by_label, "off")):
        lo, hi = (0, len(auto["second"]["tokens"])) if start is None else (start, end)
        theirs = _batch_goodput(off, auto, lo, hi)
        readings.append(_window(auto, lo, hi)[0] / theirs - 1 if theirs else None)
    return readings


def own_spread(by_label: dict, label: str, start: float, end: float) -> float | None:
    """How far ``label``'s runs (``auto`` or ``off``: the first and its ``--replicas``) lie from
    their mean over engine seconds ``[start, end)``: rms of each run's log goodput less the runs'
    mean log goodput. None with one run."""
    goodput = np.array([_window(run, start, end)[0] for run in runs_of(by_label, label)])
    if len(goodput) < 2 or not goodput.all():
        return None
    return float(np.std(np.log(goodput)))


def row_cost(auto: dict, lo: float, hi: float) -> tuple[float, float, int] | None:
    """The step's cost of one more live row per request, as a fraction of the step, over seconds
    ``[lo, hi)`` (files since the thirty-fifth round): measured, and as auto's cost fit predicts
    it. Measured: ``log(step time)`` against live rows per request across auto's run and the
    runs from its state, within each batch size (a weighted least-squares slope with one level
    per batch size, so that only runs at the same size are compared). Predicted: the same slope
    of the fit's step time (``cost_probes``, one per tick in the window) over the live range
    measured. ``(measured, predicted, batch sizes with two or more live lengths)``; None where
    nothing can be read."""
    probes = [probe for probe in auto.get("cost_probes", []) if lo <= probe[0] < hi]
    cells = {}   # (batch size) -> [(live per request, log step ns, steps)]
    runs = [auto] + [run for runs in auto.get("from_state", {}).values() for run in runs.values()]
    for run in runs:
        if "size_live" not in run:
            continue
        ns = {(int(s), int(b)): v for s, b, _, v in run["sizes"] if lo <= s < hi}
        for second, bs, steps, live in run["size_live"]:
            key = (int(second), int(bs))
            if key in ns and steps > 0:
                cells.setdefault(int(bs), []).append((live / (steps * bs), math.log(ns[key] / steps), steps))
    x, y, w = [], [], []
    for group in cells.values():
        live, log_ns, steps = (np.array(column, dtype=np.float64) for column in zip(*group))
        if np.ptp(live) < 0.05:   # one live length at this size: nothing to compare
            continue
        x.append(live - np.average(live, weights=steps))
        y.append(log_ns - np.average(log_ns, weights=steps))
        w.append(steps)
    if not x or not probes:
        return None
    sizes_read = len(x)
    x, y, w = np.concatenate(x), np.concatenate(y), np.concatenate(w)
    measured = float(np.sum(w * x * y) / np.sum(w * x * x))
    span = [min(live for group in cells.values() for live, _, _ in group),
            max(live for group in cells.values() for live, _, _ in group)]
    predicted, grid = [], np.linspace(*span, 9)
    for _, _, step_ns in probes:
        log_ns = np.log(np.interp(grid, np.arange(1, len(step_ns) + 1), step_ns))
        predicted.append(float(np.polyfit(grid, log_ns, 1)[0]))
    return measured, float(np.mean(predicted)), sizes_read


def load_results(path: str) -> dict:
    """A result file of ``--json``, plain or as bench/runs keeps it (.json.xz)."""
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        return json.load(f)


def _summarize(paths: list[str]) -> None:
    """auto's unconstrained regret, vs off and settle per window, one column per seed's file."""
    files = [load_results(path) for path in paths]
    runs = [_rescored(stored) for stored in files]
    # every trace of every file, in the order first seen: files of different traces summarize together
    names = list(dict.fromkeys(name for run in runs for name in run))
    print("| trace | window (s) | auto regret vs unconstrained best, per seed (files since the twenty-ninth round: "
          "the same with every candidate at auto's batch sizes, exact sizes since the thirtieth; and since the thirtieth "
          "at auto's batch sizes and requests; '>=' where some candidates cannot be read so; in the steady window after "
          "a change, against the rules run from auto's state at the change, as run and at its batch sizes and "
          "requests) | mean | floor (the segment's best "
          "candidate's regret), per seed | held-out floor (the static rule best on the other seeds, its regret "
          "against the window's best as auto's), per seed | auto vs off, per seed | "
          "settle s vs the new best (reversals: all writes / the choice, trials left out / the choice in any one bucket, "
          "from the rules, and the same with the stopgap at a change of acceptance counted as a new start; trial "
          "writes), per seed | "
          "the test's noise: the next best static rule, its ratio to the new best after the transition and "
          "its own settle s, per seed | settle s vs the new best in 10 s windows (the next best static rule's own), per seed | "
          "from auto's state at the change: the new best; auto's regret over the window; auto's settle s vs the new "
          "best in 5 s / 10 s windows (the next best's own); the same at auto's requests (files since the "
          "twenty-seventh round): regret; settle s in 10 s windows (the next best's own); settle s at auto's batch sizes "
          "(files since the twenty-ninth round; the next best's own); and requests (since the thirtieth; the next "
          "best's own), per seed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        seeds = [stored["results"][name] for stored in files if name in stored["results"]]
        windows = next(run[name]["windows"] for run in runs if name in run)
        for index, w in enumerate(windows):
            rows = [run[name]["windows"][index] for run in runs if name in run]
            held_out = [held_out_floor(seeds, i, w["start"], w["end"]) for i in range(len(seeds))]
            held_out = " / ".join(f"{label} {_pct(regret)}" for label, regret in filter(None, held_out)) or "-"
            regrets = [r["auto_regret_free"] for r in rows]
            settle = ", ".join(f"{r['auto_settle_segment_s']} ({r['auto_reversals']} / {r.get('auto_choice_reversals', '-')} / "
                               f"{r.get('auto_bucket_reversals', '-')}, {r.get('auto_bucket_reversals_reset', '-')}; "
                               f"{r.get('auto_trial_writes', '-')})" for r in rows) \
                if w["window"] == "transition" else ""
            twins = ", ".join(f"{r['twin_label']} {r['twin_ratio']:.3f}: {r['twin_settle_s']}" for r in rows
                              if r.get("twin_label")) if w["window"] == "transition" else ""
            long_settle = ", ".join(f"{r['auto_settle_segment_10s']} ({r.get('twin_settle_10s', '-')})" for r in rows) \
                if w["window"] == "transition" else ""
            from_state = ", ".join(_from_state_cell(r) for r in rows) if w["window"] == "transition" else ""
            floors = " / ".join(_pct(r.get("floor")) for r in rows)
            at_batch = ""
            if any("auto_regret_free_at_batch" in r for r in rows):
                at_batch = f" (at auto's batch sizes {' / '.join(_read_pct(r, 'auto_regret_free_at_batch', 'at_batch_unread') for r in rows)}"
                if any("auto_regret_free_matched" in r for r in rows):
                    at_batch += f"; and requests {' / '.join(_read_pct(r, 'auto_regret_free_matched', 'matched_unread') for r in rows)}"
                at_batch += ")"
            if w["window"] == "steady" and any("auto_regret_from_state" in r for r in rows):
                at_batch += (f"; from auto's state at the change {' / '.join(_pct(r.get('auto_regret_from_state')) for r in rows)}, "
                             "at its batch sizes and requests "
                             f"{' / '.join(_read_pct(r, 'auto_regret_from_state_matched', 'from_state_matched_unread') for r in rows)}")
            print(f"| {name} | {w['window']} {w['start']:.0f}-{w['end']:.0f} | {' / '.join(_pct(v) for v in regrets)}{at_batch} | "
                  f"{_pct(sum(regrets) / len(regrets))} | {floors} | {held_out} | {' / '.join(_pct(r['auto_vs_off']) for r in rows)} | "
                  f"{settle} | {twins} | {long_settle} | {from_state} |")
    print()
    print("| trace | auto vs off (whole trace), per seed | writes, per seed |")
    print("| --- | --- | --- |")
    for name in names:
        wholes = [run[name]["whole"] for run in runs if name in run]
        print(f"| {name} | {' / '.join(_pct(w['vs_off']['auto']) for w in wholes)} | "
              f"{' / '.join(str(w['writes']['auto']) for w in wholes)} |")
    print()
    print("| trace | the measurement's own noise: static rules that verified the same rows (pairs), their goodput "
          f"apart in {SETTLE_LONG_WINDOW_S} s windows: rms / largest | the same for a rule run twice from auto's "
          "state at a change (--again), from the change on: as run; by (f), as the settle test reads it (a window "
          "starting every second) |")
    print("| --- | --- | --- |")
    for name in names:
        found = [timing_noise(stored["results"][name]) for stored in files if name in stored["results"]]
        pairs = sorted({" = ".join(pair) for pairs, _ in found for pair in pairs})
        gaps = [gap for _, seed_gaps in found for gap in seed_gaps]
        autos = [stored["results"][name]["auto"] for stored in files if name in stored["results"]]
        again, matched = ([gap for auto in autos for gap in replica_noise(auto, matched=m)] for m in (False, True))
        print(f"| {name} | {_spread(gaps)} ({', '.join(pairs) or 'none'}; {len(gaps)} windows) | "
              f"{_spread(again)}{f' ({len(again)} windows)' if again else ''}"
              f"{f'; by (f) {_spread(matched)} ({len(matched)} windows)' if matched else ''} |")
    if any("replicas" in stored["results"][name]["auto"] for stored in files for name in stored["results"]):
        _print_pairs(names, runs, files)
    readings = {name: [_row_cost_cell(stored["results"][name]["auto"]) for stored in files if name in stored["results"]]
                for name in names}
    if any(cell for cells in readings.values() for cell in cells):
        print()
        print("| trace | from each change to the end: the step's cost of one more live row per request, in % of the "
              "step, measured within each batch size across auto's run and the runs from its state / as auto's cost "
              "fit predicts it (batch sizes read), per seed |")
        print("| --- | --- |")
        for name, cells in readings.items():
            print(f"| {name} | {' / '.join(cell or '-' for cell in cells)} |")


def writes_per_hour(long_run: dict, seconds: float) -> float:
    """auto's writes after the first ``LONG_SETTLE_S`` of the long run (``--long``), per hour."""
    after = sum(w[0] >= LONG_SETTLE_S for w in long_run["writes"])
    return after / max(seconds - LONG_SETTLE_S, 1) * 3600


# issue 12's goals, each against the unconstrained best: steady regret, the whole trace against
# off, settling after a change and its reversals, writes per hour at a steady load
GOAL_STEADY_REGRET = 0.02
GOAL_BELOW_OFF = -0.01
GOAL_SETTLE_S = 30.0
GOAL_REVERSALS = 1
GOAL_WRITES_PER_HOUR = 10


def goal_readings(scored: dict) -> list[tuple[str, str, str, bool]]:
    """One trace's goals as (goal, window, reading, met), from its scores (:func:`score`).

    The readings are the ones the rounds of ``CONTROLLER_RESULTS.md`` judge by: the largest of
    auto's runs (the first and its ``--replicas``). A steady window before any change is read from
    time 0; one after a change from each run's own state there, at its batch sizes and requests
    (f), since runs from time 0 reach a change in their own states. Settling is the runs' mean
    (g), with the next best static rule's own settle beside it: the test's noise. Reversals are
    the first run's, of the choice in any one bucket, trials left out and the stopgap at a change of
    acceptance read as a new start. A run scored before a reading existed falls
    back to the reading it has, and says so."""
    rows = []
    changed = False
    for w in scored["windows"]:
        span = f"{w['window']} {w['start']:.0f}-{w['end']:.0f}"
        if w["window"] == "steady":
            if changed and "replica_regret_from_state" in w:
                values = [regret for regret, _ in w["replica_regret_from_state"]]
                unread = sum(n for _, n in w["replica_regret_from_state"])
                how = "each run from its state" + (f" ({unread} not read)" if unread else "")
            elif changed and w.get("auto_regret_from_state_matched") is not None:
                values, how = [w["auto_regret_from_state_matched"]], "from auto's state"
            else:
                values = w.get("replica_regret", {}).get("auto") or [w["auto_regret_free"]]
                how = "each run from time 0" if not changed else "from time 0, no reading from auto's state"
            worst = max(values)
            rows.append((f"steady regret <= {GOAL_STEADY_REGRET:.0%}", span, f"{_pct(worst)} ({how})",
                         worst <= GOAL_STEADY_REGRET))
        elif w["window"] == "transition":
            changed = True
            if w.get("pooled_settle_from_state"):
                settle, own = w["pooled_settle_from_state"]
                how = "the runs' mean"
            else:
                settle, own = w.get("auto_settle_segment_10s"), w.get("twin_settle_10s")
                how = "the first run, from time 0"
            rows.append((f"within 2% of the new best < {GOAL_SETTLE_S:.0f} s", span,
                         f"{settle} s, {how} (the next best's own {own} s)",
                         settle is not None and settle < GOAL_SETTLE_S))
            # the stopgap at a change of acceptance (every row verified, then a choice) is a new start
            reversals = w.get("auto_bucket_reversals_reset", w.get("auto_bucket_reversals"))
            if reversals is not None:
                rows.append((f"reversals <= {GOAL_REVERSALS}", span,
                             f"{reversals} (the choice in any one bucket, the first run)", reversals <= GOAL_REVERSALS))
    pairs = scored["whole"].get("vs_off_pairs") or [scored["whole"]["vs_off"]["auto"]]
    mean = float(np.mean(pairs))
    rows.append((f"never more than {-GOAL_BELOW_OFF:.0%} below off", "whole trace",
                 f"{_pct(mean)} (mean of {len(pairs)} pair{'s' if len(pairs) > 1 else ''})", mean >= GOAL_BELOW_OFF))
    return rows


def _print_goals(paths: list[str]) -> None:
    """The goals of every trace of every file, and the count missed."""
    print("| file | trace | goal | window | reading | met |")
    print("| --- | --- | --- | --- | --- | --- |")
    missed = total = 0
    for path in paths:
        stored = load_results(path)
        rows = [(name, *row) for name, scored in _rescored(stored).items() for row in goal_readings(scored)]
        long_run = stored["results"].get(LONG_TRACE + "-long")
        if long_run:
            rate = writes_per_hour(long_run["auto"], stored["args"]["long"])
            rows.append((LONG_TRACE + "-long", f"<= {GOAL_WRITES_PER_HOUR} writes per hour",
                         f"after {LONG_SETTLE_S:.0f} s",
                         f"{rate:.1f}", rate <= GOAL_WRITES_PER_HOUR))
        for name, goal, span, reading, met in rows:
            print(f"| {path} | {name} | {goal} | {span} | {reading} | {'met' if met else '**missed**'} |")
        missed += sum(not row[-1] for row in rows)
        total += len(rows)
    print(f"\n{total - missed} of {total} readings meet their goal; {missed} missed")


def _print_pairs(names: list[str], runs: list[dict], files: list[dict]) -> None:
    """auto vs off over the pairs of runs of each file (``--replicas``), per window and whole; and
    each of auto's runs' regret and settle time, read as the first run's."""
    print()
    print("| trace | seed | window (s) | auto vs off in each pair of runs (first runs, then the replicas, in "
          "alternating order; then each pair with off read at auto's batch sizes, '-' where it cannot be) | their mean ± standard error | auto's runs apart from their mean, rms / off's | "
          "each run's regret vs the window's best (from time 0): auto's; off's (a rule that never changes) | each "
          "run's settle s vs the new best (as run) in 10 s windows: auto's; off's | from each auto run's own state "
          "at the change (rules run from there): regret in the steady window after it, settle s vs its new best "
          "in 10 s windows (the next best's own), both by (f); and the settle s of the runs' mean ratio to their new "
          "bests (the next bests' mean's own) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        for run, stored in ((run[name], stored) for run, stored in zip(runs, files)
                            if name in run and len(run[name]["whole"].get("vs_off_pairs", [])) > 1):
            rows = [(f"{w['window']} {w['start']:.0f}-{w['end']:.0f}", w) for w in run["windows"]]
            whole = {"auto_vs_off_pairs": run["whole"]["vs_off_pairs"],
                     "auto_vs_off_pairs_at_sizes": run["whole"].get("vs_off_pairs_at_sizes")}
            for window, w in [*rows, ("whole trace", whole)]:
                pairs, spread = w["auto_vs_off_pairs"], w.get("own_spread", {})
                sized = w.get("auto_vs_off_pairs_at_sizes")
                at_sizes = "; at auto's batch sizes " + ", ".join("-" if p is None else _pct(p) for p in sized) \
                    if sized else ""
                error = float(np.std(pairs, ddof=1) / math.sqrt(len(pairs)))
                own = " / ".join("-" if spread.get(label) is None else f"{100 * spread[label]:.2f}%"
                                 for label in ("auto", "off")) if spread else "-"
                settle, regret = (_auto_and_off(w.get(key), show) for key, show in (("replica_settle_10s", str),
                                                                                   ("replica_regret", _pct)))
                own_state = ", ".join(f"{_pct(r)}{f' ({n} not read)' if n else ''}"
                                      for r, n in w.get("replica_regret_from_state", [])) \
                    or ", ".join(f"{a} ({b})" for a, b in w.get("replica_settle_from_state", [])) or "-"
                if w.get("pooled_settle_from_state"):
                    own_state += "; the runs' mean: {} ({})".format(*w["pooled_settle_from_state"])
                print(f"| {name} | {stored['args']['seed']} | {window} | {', '.join(_pct(p) for p in pairs)}{at_sizes} | "
                      f"{_pct(float(np.mean(pairs)))} ± {100 * error:.2f}% | {own} | "
                      f"{regret} | {settle} | {own_state} |")


def _auto_and_off(values: dict | None, show: Callable) -> str:
    """A reading of every run of auto, then of off (``{"auto": [...], "off": [...]}``), as a cell."""
    return "; ".join(", ".join(show(v) for v in values[label]) for label in ("auto", "off")) if values else "-"


def _row_cost_cell(auto: dict) -> str:
    """:func:`row_cost` from each change to the end of the run, as the summary prints it."""
    end = len(auto["second"]["tokens"])
    cells = []
    for change in auto.get("from_state", {}):
        reading = row_cost(auto, float(change), end)
        if reading is not None:
            cells.append(f"{100 * reading[0]:.1f}% / {100 * reading[1]:.1f}% ({reading[2]})")
    return ", ".join(cells)


def _spread(gaps: list[float]) -> str:
    """rms / largest of ``|log|`` goodput ratios, in percent."""
    return f"{100 * math.sqrt(sum(g * g for g in gaps) / len(gaps)):.2f}% / {100 * max(gaps):.2f}%" if gaps else "-"


def _from_state_cell(row: dict) -> str:
    if "from_state_best_label" not in row:
        return "-"
    cell = (f"{row['from_state_best_label']}; {_pct(row['auto_regret_from_state'])}; "
            f"{row['auto_settle_from_state_5s']} / {row['auto_settle_from_state_10s']} "
            f"({row['twin_settle_from_state_5s']} / {row['twin_settle_from_state_10s']})")
    if "auto_regret_from_state_adjusted" not in row:
        return cell
    cell = (f"{cell}; at auto's requests {_pct(row['auto_regret_from_state_adjusted'])}; "
            f"{row['auto_settle_from_state_10s_adjusted']} ({row['twin_settle_from_state_10s_adjusted']})")
    if "auto_settle_from_state_10s_at_batch" not in row:
        return cell
    cell = (f"{cell}; at auto's batch sizes {row['auto_settle_from_state_10s_at_batch']} "
            f"({row['twin_settle_from_state_10s_at_batch']})")
    if "auto_settle_from_state_10s_matched" not in row:
        return cell
    return (f"{cell}; and requests {row['auto_settle_from_state_10s_matched']} "
            f"({row['twin_settle_from_state_10s_matched']})")


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


def _read_pct(row: dict, key: str, unread_key: str) -> str:
    """A regret read against the candidates a reading can read, with how many it cannot: then it
    is a lower bound."""
    unread = row.get(unread_key) or 0
    return f">= {_pct(row[key])} ({unread} not read)" if unread and key in row else _pct(row.get(key))


def _print(scores: dict, traces: dict) -> None:
    print("| trace | window (s) | off | best, unconstrained | best, within 0.1 | auto (given up) | "
          "auto regret: unconstr. / constr. | auto vs off | auto-bounded (given up) | auto-bounded regret: unconstr. / constr. | "
          "settle s auto / bounded (reversals) | auto settle s vs the new best (its own, per-window test); last write s | "
          "auto settle s vs the new best, 10 s windows (the next best static rule's own) | "
          "from auto's state at the change: new best; regret; settle s 5 s / 10 s windows (the next best's own); "
          "at auto's requests: regret; settle s, 10 s windows (the next best's own); at auto's batch sizes: settle s "
          "(the next best's own); and requests: settle s (the next best's own); in the steady window after a change: "
          "auto's regret against the runs from its state, as run and at its batch sizes and requests |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, result in scores.items():
        for w in result["windows"]:
            settle = segment = long_settle = from_state = ""
            if w["window"] == "transition":
                from_state = _from_state_cell(w)
                long_settle = f"{w['auto_settle_segment_10s']} ({w.get('twin_settle_10s', '-')})"
                settle = (f"{w['auto_settle_s']} / {w['auto-bounded_settle_s']} "
                          f"({w['auto_reversals']} / {w['auto-bounded_reversals']})")
                segment = (f"{w['auto_settle_segment_s']} vs {w['segment_best_label']} ({w['segment_best_settle_s']}); "
                           f"{w['auto_last_write_s']}")
            elif "auto_regret_from_state" in w:   # the steady window after a change
                from_state = (f"regret {_pct(w['auto_regret_from_state'])}; at auto's batch sizes and requests "
                              f"{_read_pct(w, 'auto_regret_from_state_matched', 'from_state_matched_unread')}")
            print(f"| {name} | {w['window']} {w['start']:.0f}-{w['end']:.0f} | {w['off']:.1f} | "
                  f"{w['best_free']:.1f} ({w['best_free_label']}; floor {_pct(w['floor'])}) | "
                  f"{w['best_held']:.1f} ({w['best_held_label']}) | "
                  f"{w['auto']:.1f} ({w['auto_given_up']:.3f}) | {_pct(w['auto_regret_free'])} / {_pct(w['auto_regret_held'])} | "
                  f"{_pct(w['auto_vs_off'])} | {w['auto-bounded']:.1f} ({w['auto-bounded_given_up']:.3f}) | "
                  f"{_pct(w['auto-bounded_regret_free'])} / {_pct(w['auto-bounded_regret_held'])} | {settle} | {segment} | "
                  f"{long_settle} | {from_state} |")
    print()
    print("| trace | auto vs off (whole trace) | auto-bounded vs off | given up auto / bounded | writes auto / bounded | "
          "first write s | acceptance changes detected | expert curve R^2 | cost fit R^2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, result in scores.items():
        w = result["whole"]
        print(f"| {name} | {_pct(w['vs_off']['auto'])} | {_pct(w['vs_off']['auto-bounded'])} | "
              f"{w['given_up']['auto']:.3f} / {w['given_up']['auto-bounded']:.3f} | "
              f"{w['writes']['auto']} / {w['writes']['auto-bounded']} | {w['first_write_s']['auto']} | "
              f"{w['acceptance_changes']['auto']} / {w['acceptance_changes']['auto-bounded']} | "
              f"{w['expert_curve_r2']:.3f} | {w['cost_r2']:.3f} |")
    for name, result in scores.items():
        w = result["whole"]
        print(f"- {name}: auto's last `{w['last_policy']['auto']}`; auto-bounded's last `{w['last_policy']['auto-bounded']}`")


if __name__ == "__main__":
    sys.exit(main())
