"""Evaluation of the automatic controller against static policies on SYNTHETIC traces.

Every trace is a run of the simulated engine in pure-trace mode (engine time, no sleeping; the
workload, acceptance, confidence head, router and timings are SYNTHETIC). For each trace:

- every static policy of a grid runs the whole trace;
- the best static per-bucket policy in hindsight: per batch-size bucket (the controller's edges),
  the grid policy with the best committed tokens per second over that bucket's steps; the
  combination then runs the trace (and the best single static policy counts too);
- the auto controller starts from ``off`` (the engine's behaviour) and learns online, with its
  exploration steps included in its goodput.

Goodput = committed tokens (accepted drafts + 1 per request) / engine time. The simulator
parameters of the held-out traces differ from the defaults the controller was developed on
(another acceptance curve, noisier or miscalibrated confidence heads, other router skews).
Every run of a trace sees the same requests and demand (``_PairedWorkload``), so the policies are
compared on paired traces.

    python bench/eval_controller.py [--quick] [--dev] [--only NAME,...] [--jobs 2] [--json out.json]
"""

import argparse
import json
import multiprocessing
import sys
import time
from dataclasses import asdict

import numpy as np

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import Bucket, Policy, default_policy
from vcap.sidecar.controller import AutoController, ControllerConfig
from vcap.sidecar.policy_control import PolicyControl
from vcap.sidecar.telemetry import unpack

D = 5
EDGES = ControllerConfig().bucket_edges
TICK_S = 0.5
LOOSE = 100.0  # a guardrail that never binds


def _conf(threshold: float, k_max: int = D) -> Policy:
    return Policy("conf", D, (Bucket(1, 1, k_max, (threshold,) * D),))


STATIC = {
    "off": default_policy(D),
    "k=1": Policy("fixed", 1, (Bucket(1, 1, D, (0.0,) * D),)),
    "k=2": Policy("fixed", 2, (Bucket(1, 1, D, (0.0,) * D),)),
    "k=3": Policy("fixed", 3, (Bucket(1, 1, D, (0.0,) * D),)),
    "conf0.05": _conf(0.05),
    "conf0.1": _conf(0.1),
    "conf0.2": _conf(0.2),
    "conf0.3": _conf(0.3),
    "conf0.45": _conf(0.45),
    "conf0.1k3": _conf(0.1, 3),
}

# held-out simulator parameters (defaults: accept 0.75 -> 0.08, conf noise 0.5, scale 1, bias 0, skew 1)
HELD_OUT = {
    "steady-bs4": dict(load="steady", mean_bs=4, accept_first=0.85, accept_last=0.3, conf_noise=1.0, router_skew=1.5, seconds=40),
    "steady-bs32-overconf": dict(load="steady", mean_bs=32, accept_first=0.7, accept_last=0.15, conf_scale=0.5, conf_bias=1.0, router_skew=0.5, seconds=40),
    "steady-bs128-uniform": dict(load="steady", mean_bs=128, accept_first=0.8, accept_last=0.1, conf_noise=0.8, router_skew=0.0, seconds=30),
    "bursty-8-96": dict(load="bursty", mean_bs=8, peak_bs=96, period_s=20.0, accept_first=0.8, accept_last=0.2, conf_noise=0.8, router_skew=1.2, seconds=60),
    "shift-4-64": dict(load="shift", mean_bs=4, shift_bs=64, shift_after_s=20.0, accept_first=0.85, accept_last=0.3, conf_bias=-1.0, router_skew=1.0, seconds=60),
    "saturated-bs256": dict(load="steady", mean_bs=300, accept_first=0.8, accept_last=0.12, conf_noise=0.3, router_skew=1.0, seconds=20),
}
DEV = {
    "dev-steady-bs32": dict(load="steady", mean_bs=32, seconds=40),
    "dev-shift-4-64": dict(load="shift", mean_bs=4, shift_bs=64, shift_after_s=20.0, seconds=60),
}


class _PairedWorkload:
    """Common random numbers for the simulator's request stream (stands in for a pool's generator).

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


def _bucket_of(bs: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(EDGES), bs, side="right") - 1


def run_trace(params: dict, policy: Policy | None, seed: int = 1, max_given_up: float = 0.1) -> dict:
    """One run; ``policy=None`` runs the auto controller. Returns totals, per bucket and per second."""
    params = dict(params)
    seconds = params.pop("seconds")
    config = SimConfig(max_bs=256, seed=seed, **params)
    engine = SimulatedEngine(config)
    for index, pool in enumerate(engine.pools):
        pool.rng = _PairedWorkload(seed, index, lambda: engine.engine_time_ns)
    uncapped = []  # the simulator's acceptance before the cap: measures tokens given up exactly
    draw = engine.acceptance.accepted_drafts

    def recording_draw(true_accept, rng):
        values = draw(true_accept, rng)
        uncapped.append(values)
        return values

    engine.acceptance.accepted_drafts = recording_draw
    controller = control = None
    if policy is None:
        control = PolicyControl("eval")
        control.set_control_mode("auto")
        controller = AutoController(control, ControllerConfig(max_tokens_given_up=max_given_up),
                                    engine_config=config.segment_config)
    else:
        engine.set_policy(policy, 1, "manual")
    num_buckets = len(EDGES)
    bucket_tokens, bucket_ns = np.zeros(num_buckets), np.zeros(num_buckets)
    bucket_given_up, bucket_requests = np.zeros(num_buckets), np.zeros(num_buckets)
    per_second_tokens, per_second_ns = np.zeros(int(seconds) + 1), np.zeros(int(seconds) + 1)
    generation, writes, next_tick, tick_wall = 0, [], TICK_S, 0.0
    while engine.engine_time_ns < seconds * 1e9:
        records = engine.step()
        record = records[0]
        bs = int(record["bs"])
        tokens = int(record["accepted"][:bs].sum()) + bs
        bucket = _bucket_of(np.array([bs]))[0]
        bucket_tokens[bucket] += tokens
        bucket_ns[bucket] += int(record["step_ns"])
        bucket_given_up[bucket] += int((uncapped.pop() - record["accepted"][:bs]).sum())
        bucket_requests[bucket] += bs
        second = min(int(engine.engine_time_ns / 1e9), int(seconds))
        per_second_tokens[second] += tokens
        per_second_ns[second] += int(record["step_ns"])
        if controller is not None:
            controller.observe(0, unpack(records))
            now = engine.engine_time_ns / 1e9
            if now >= next_tick:
                started = time.perf_counter()
                controller.tick(now)
                tick_wall += time.perf_counter() - started
                next_tick = now + TICK_S
                if control.generation != generation:
                    generation = control.generation
                    engine.set_policy(control.policy, generation, "auto")
                    writes.append((round(now, 2), _describe(control.policy)))
    result = {"tokens": float(bucket_tokens.sum()), "ns": float(bucket_ns.sum()),
              "bucket_tokens": bucket_tokens.tolist(), "bucket_ns": bucket_ns.tolist(),
              "bucket_given_up": bucket_given_up.tolist(), "bucket_requests": bucket_requests.tolist(),
              "given_up": float(bucket_given_up.sum() / max(bucket_requests.sum(), 1)),
              "second_tokens": per_second_tokens.tolist(), "second_ns": per_second_ns.tolist(),
              "writes": writes, "steps": engine.steps, "tick_wall_s": tick_wall}
    if controller is not None:
        result["metrics"] = {f"vcap_controller_{k}": float(v) for k, v in asdict(controller.readings()).items()}
    result["goodput"] = result["tokens"] / result["ns"] * 1e9
    return result


def _describe(policy: Policy) -> str:
    parts = [f"{b.min_bs}:{b.thresholds[0]:g}:{b.k_min}-{b.k_max}" for b in policy.buckets]
    return " ".join(parts) + f" explore/{policy.explore_period}"


def _job(args):
    name, params, label, policy = args
    started = time.perf_counter()
    result = run_trace(params, policy, max_given_up=LOOSE if label == "auto-loose" else 0.1)
    result["wall_s"] = time.perf_counter() - started
    return name, label, result


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


def _window_goodput(result: dict, start: int, end: int) -> float:
    tokens = sum(result["second_tokens"][start:end])
    ns = sum(result["second_ns"][start:end])
    return tokens / ns * 1e9 if ns else 0.0


def _shift_analysis(name: str, params: dict, results: dict, auto_label: str, limit: float) -> dict:
    shift, seconds = int(params["shift_after_s"]), int(params["seconds"])
    results = dict(results, auto=results[auto_label])
    post = {label: _window_goodput(r, shift + 10, seconds) for label, r in results.items()
            if label not in ("auto", auto_label) and r["given_up"] <= limit}
    best_label = max(post, key=post.get)
    best = results[best_label]
    settle = None
    for start in range(shift, seconds - 5):
        ok = all(_window_goodput(results["auto"], s, s + 10) >= 0.98 * _window_goodput(best, s, s + 10)
                 for s in range(start, seconds - 9, 5))
        if ok:
            settle = start - shift
            break
    writes_after = [w for w in results["auto"]["writes"] if w[0] >= shift]
    return {"best_post_shift": best_label, "settle_s": settle, "writes_after_shift": len(writes_after),
            "auto_vs_best_post": _window_goodput(results["auto"], shift + 10, seconds) / post[best_label] - 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", action="store_true", help="the development traces (default simulator parameters)")
    parser.add_argument("--quick", action="store_true", help="halve every trace")
    parser.add_argument("--only", default=None, help="comma-separated trace names")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", default=None, help="write raw results here")
    args = parser.parse_args(argv)
    traces = dict(DEV if args.dev else HELD_OUT)
    if args.only:
        traces = {k: v for k, v in traces.items() if k in args.only.split(",")}
    if args.quick:
        traces = {k: dict(v, seconds=v["seconds"] / 2, **({"shift_after_s": v["shift_after_s"] / 2} if "shift_after_s" in v else {}))
                  for k, v in traces.items()}
    started = time.perf_counter()
    jobs = [(name, params, label, policy) for name, params in traces.items() for label, policy in STATIC.items()]
    jobs += [(name, params, label, None) for name, params in traces.items() for label in ("auto", "auto-loose")]
    results = {name: {} for name in traces}
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for done, (name, label, result) in enumerate(pool.imap_unordered(_job, jobs), 1):
            results[name][label] = result
            print(f"[{done}/{len(jobs)}] {name} {label}: {result['goodput']:.1f} tok/s "
                  f"({result['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        static = {name: {k: v for k, v in results[name].items() if k in STATIC} for name in traces}
        combos = {name: _combine(static[name], 0.1) for name in traces}
        loose = {name: _combine(static[name], LOOSE) for name in traces}
        second = [(name, traces[name], "hindsight", combos[name]) for name in traces]
        second += [(name, traces[name], "hindsight-loose", loose[name]) for name in traces]
        for name, label, result in pool.imap_unordered(_job, second):
            results[name][label] = result
    rows = []
    for name, by_label in results.items():
        for guard, auto_label, hindsight_label in (("0.1", "auto", "hindsight"), ("none", "auto-loose", "hindsight-loose")):
            limit = 0.1 if guard == "0.1" else LOOSE
            candidates = {k: v for k, v in by_label.items() if k in STATIC or k == hindsight_label}
            feasible = {k: v["goodput"] for k, v in candidates.items() if v["given_up"] <= limit}
            best_label = max(feasible, key=feasible.get)
            best_static = max((v, k) for k, v in feasible.items() if k in STATIC)
            auto = by_label[auto_label]
            off = by_label["off"]["goodput"]
            row = {"trace": name, "guardrail": guard, "off": off, "best_static": best_static,
                   "hindsight": by_label[hindsight_label]["goodput"], "hindsight_given_up": by_label[hindsight_label]["given_up"],
                   "best_label": best_label, "best": feasible[best_label], "auto": auto["goodput"],
                   "auto_given_up": auto["given_up"], "regret": 1 - auto["goodput"] / feasible[best_label],
                   "vs_off": auto["goodput"] / off - 1, "writes": len(auto["writes"]),
                   "explore_cost": auto["metrics"]["vcap_controller_explore_cost_ratio"],
                   "guardrail_hits": auto["metrics"]["vcap_controller_guardrail_hits_total"],
                   "cost_r2": auto["metrics"]["vcap_controller_cost_fit_r2"],
                   "hindsight_policy": _describe((combos if guard == "0.1" else loose)[name]),
                   "last_policy": auto["writes"][-1][1] if auto["writes"] else "off"}
            if name.startswith(("shift", "dev-shift")):
                row["shift"] = _shift_analysis(name, traces[name], {k: v for k, v in by_label.items()
                                                                    if k in STATIC or k == auto_label}, auto_label, limit)
            rows.append(row)
    _print_table(rows)
    print(f"total wall time {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "results": results}, f, default=str)
    return 0


def _print_table(rows) -> None:
    print("| trace | guardrail | off | best static (grid) | best per-bucket in hindsight (given up) | auto (given up) | regret vs best | auto vs off | writes | explore cost (pred.) | guardrail hits | cost fit R^2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        value, label = r["best_static"]
        print(f"| {r['trace']} | {r['guardrail']} | {r['off']:.1f} | {value:.1f} ({label}) | {r['hindsight']:.1f} ({r['hindsight_given_up']:.3f}) | "
              f"{r['auto']:.1f} ({r['auto_given_up']:.3f}) | "
              f"{100 * r['regret']:+.2f}% | {100 * r['vs_off']:+.2f}% | {r['writes']} | {100 * r['explore_cost']:.2f}% | "
              f"{r['guardrail_hits']:.0f} | {r['cost_r2']:.3f} |")
    for r in rows:
        print(f"- {r['trace']} (guardrail {r['guardrail']}): hindsight per-bucket `{r['hindsight_policy']}`; auto's last `{r['last_policy']}`")
        if "shift" in r:
            s = r["shift"]
            print(f"  shift: best static after the shift {s['best_post_shift']}; auto within 2% of it (10 s windows) "
                  f"from {s['settle_s']} s after the shift; {s['writes_after_shift']} writes after the shift; "
                  f"auto vs best over [shift+10 s, end]: {100 * s['auto_vs_best_post']:+.2f}%")


if __name__ == "__main__":
    sys.exit(main())
