"""The loop closed on a GPU: every verify-length rule on the same engine, paired (results:
bench/LOOP_RESULTS.md; run by bench/run_loop.sh on the device).

Each cell (bs x routing x acceptance profile) runs every rule on :class:`GpuSimulatedEngine`
(real hook, real router, SGLang's MoE kernels, CUDA graphs; SYNTHETIC requests, confidence and
acceptance) from the same seed (the same requests and draws at every step index: common random
numbers). Rules: the static grid (off, k = 1..4, conf 0.1 / 0.3; the best of it is the best
static per-bucket policy in hindsight, since a cell has one batch size), SGLang 0.5.23's planner
(the wheel; SPS table from this cell's off / fixed-k runs), vLLM's rule (bench/anchor_rules.py;
cost curve from the same runs), and vcap ``auto`` (the sidecar's AutoController fed the hook's
ring records, writing the segment; ticks every 0.5 s of engine time) in one or more controller
configurations (``--auto NAME=FIELD:VALUE,...``; by default the committed defaults and the same
without its guardrails). Goodput = committed tokens per second of full-model GPU time (measured
time x model_layers / run_layers). ``--repeat BS,ROUTING,PROFILE`` runs one cell again (the
same seed once, then other seeds) for the run-to-run noise.

    python3 bench/bench_loop.py --budget-s 240 --out OUT.json
"""

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import anchor_rules  # noqa: E402
import sgl_standin  # noqa: E402
import static_grid  # noqa: E402
from eval_controller import controller_config  # noqa: E402

from vcap.engine_hook.gpu_engine import PRESETS, GpuSimulatedEngine, GpuStep  # noqa: E402
from vcap.engine_hook.sim import SimConfig  # noqa: E402
from vcap.policy import Policy, default_policy  # noqa: E402
from vcap.segment import RingReader, Segment, SegmentConfig  # noqa: E402
from vcap.sidecar.controller import AutoController, ControllerConfig  # noqa: E402
from vcap.sidecar.policy_control import PolicyControl  # noqa: E402
from vcap.sidecar.telemetry import unpack  # noqa: E402

D = static_grid.D
OFF = static_grid.rule("off")
PROFILES = {"high": dict(accept_first=0.92, accept_last=0.6), "steep": dict(accept_first=0.75, accept_last=0.05)}


TICK_S = 0.5


def log(*args):
    print(*args, flush=True)


class Loop:
    """One segment + GPU step shared by every cell (graphs per bs; routing swapped in place)."""

    def __init__(self, args):
        self.args, self.preset = args, PRESETS[args.preset]
        # expert counts every step, as the SGLang plugin's segment has them (the controller's cost
        # fit waits for sampled steps: one in 4 made its cold start 4 times longer)
        self.segment = Segment.create(f"vcap-loop-{os.getpid()}", SegmentConfig(
            stride=D + 1, max_bs=args.max_bs, num_moe_layers=args.run_layers, num_experts=self.preset.num_experts,
            top_k=self.preset.top_k, expert_sample_period=1, lease_ms=600_000, ring_slots=1024))
        self.step = GpuStep(self.segment, self.preset, run_layers=args.run_layers, other_ms=args.other_ms)
        self.generation = 0
        self.final_policy = None   # the policy the last auto run ended with

    def set_routing(self, routing: str) -> None:
        gen = torch.Generator(device="cpu").manual_seed(7)
        self.step.log_popularity.copy_(self.step._popularity(routing, gen).to(self.step.device))

    def write(self, policy: Policy, source: str = "manual") -> None:
        self.generation += 1
        self.segment.write_policy(policy, self.generation, source)
        self.segment.heartbeat[0] += 1

    def engine(self, bs: int, profile: str, seed: int) -> GpuSimulatedEngine:
        # --conf-bias: the SYNTHETIC head's logit bias (0: right on average; > 0 over-confident)
        return self.engine_of(seed=seed, mean_bs=bs, load="steady", load_noise=0.0, mean_output_tokens=256.0,
                              conf_bias=getattr(self.args, "conf_bias", 0.0), **PROFILES[profile])

    def engine_of(self, **workload) -> GpuSimulatedEngine:
        """An engine on this loop's segment and step; ``workload``: SimConfig's workload fields."""
        config = SimConfig(self.segment.config,
                           paired_requests=True,   # the n-th request and its tokens' draws are alike under every rule
                           **workload)
        return GpuSimulatedEngine(config, self.segment, self.step)

    def run(self, bs, profile, seed, steps, policy=None, rule=None, auto=None) -> dict:
        """``steps`` verify steps under ``policy`` (static), ``rule`` (external) or ``auto`` (config)."""
        engine = self.engine(bs, profile, seed)
        reader = RingReader(self.segment, 0)
        reader.read()
        controller = control = None
        if rule is not None:
            self.write(anchor_rules.MASK_POLICY)
            engine.shape_confidence = lambda conf, ids: anchor_rules.mask_confidence(rule.live(conf, ids), D)
        elif auto is not None:
            self.write(default_policy(D))
            control = PolicyControl("bench")
            control.set_control_mode("auto")
            controller = AutoController(control, auto, engine_config=lambda: self.segment.config)
            # the segment's generations are this loop's (shared by every run), the controller's
            # are its PolicyControl's: the records it reads carry the controller's, as in the sidecar
            to_control = {self.generation: control.generation}
        else:
            self.write(policy)
        tokens = given_up = requests = 0
        per_step = np.zeros((steps, 4))   # tokens, step_ns, live rows, bs
        experts, next_tick, writes, seen_generation = [], TICK_S, [], 0
        trial_writes, written, trials = [], [], 0
        for i in range(steps):
            record = engine.step()[0]
            b = int(record["bs"])
            acc = record["accepted"][:b].astype(np.int64)
            per_step[i] = (acc.sum() + b, int(record["step_ns"]), int(record["live"][:b].sum()), b)
            given_up += int((engine.uncapped - acc).sum())
            requests += b
            records = reader.read()
            for r in records:
                if r["flags"] & 4:   # FLAG_EXPERTS_SAMPLED
                    experts.append((int(r["experts_live"].sum()), int(r["step_ns"]), int(r["live"][:int(r["bs"])].sum())))
            if controller is not None:
                self.segment.heartbeat[0] += 1
                records = engine.on_engine_clock(records)   # the controller's clock is the engine's
                if len(records):
                    records["generation"] = [to_control.get(int(g), 1 << 30) for g in records["generation"]]
                    controller.observe(0, unpack(records))
                now = engine.engine_time_ns / 1e9
                if now >= next_tick:
                    controller.tick(now)
                    next_tick = now + TICK_S
                    if control.generation != seen_generation:
                        seen_generation = control.generation
                        self.write(control.policy, "auto")
                        to_control[self.generation] = control.generation
                        writes.append(round(now, 2))
                        written.append(str(control.policy))
                        if controller.readings().trials_total > trials:   # this write put a trial in force
                            trial_writes.append(round(now, 2))
                        trials = controller.readings().trials_total
        tokens = per_step[:, 0].sum()
        ns = per_step[:, 1].sum()
        half = steps // 2
        half_s = per_step[:half, 1].sum() / 1e9
        result = {"steps": steps, "tokens": float(tokens), "ns": float(ns), "goodput": float(tokens / ns * 1e9),
                  "goodput_second_half": float(per_step[half:, 0].sum() / per_step[half:, 1].sum() * 1e9),
                  "given_up": given_up / max(requests, 1), "mean_live_rows": float(per_step[:, 2].mean()),
                  "mean_step_ms": float(per_step[:, 1].mean() / 1e6), "wall_s": engine.wall_ns / 1e9,
                  "engine_s": engine.engine_time_ns / 1e9}
        if experts:
            e = np.array(experts, dtype=np.float64)
            result.update(mean_experts_live=float(e[:, 0].mean()), mean_record_step_ns=float(e[:, 1].mean()),
                          step_jitter=_jitter(e))
        if rule is not None:
            result["clamped_k0"] = rule.clamped
        if controller is not None:
            cost = controller.model.cost if controller.model is not None else None
            late = [t for t in writes if t >= half_s]
            late_hours = max(engine.engine_time_ns / 1e9 - half_s, 1e-9) / 3600
            result.update(writes=len(writes), write_times_s=writes, trial_write_times_s=trial_writes,
                          policies_written=written, engine_hours=engine.engine_time_ns / 3.6e12,
                          writes_second_half=len(late), writes_per_hour_second_half=len(late) / late_hours,
                          readings=_readings(controller), cost_fit=_cost_fit(cost), last_policy=str(control.policy))
            # a controller that never wrote left the loop's own start in force
            self.final_policy = control.policy if control.policy is not None else default_policy(D)
            controller.close()
        return result

    def close(self):
        self.step.close()
        self.segment.unlink()


def _jitter(experts: np.ndarray) -> float | None:
    """Standard deviation of the measured step times around their least-squares fit on distinct
    experts and live rows, over the mean step: what a linear cost model cannot see."""
    if len(experts) < 16:
        return None
    design = np.column_stack([np.ones(len(experts)), experts[:, 0], experts[:, 2]])
    coef, *_ = np.linalg.lstsq(design, experts[:, 1], rcond=None)
    return float((experts[:, 1] - design @ coef).std() / experts[:, 1].mean())


def _readings(controller) -> dict:
    from dataclasses import asdict
    try:
        return {k: float(v) for k, v in asdict(controller.readings()).items() if isinstance(v, (int, float))}
    except Exception as error:   # the controller's readings changed shape: keep the run
        return {"error": f"{type(error).__name__}: {error}"}


def _cost_fit(cost) -> dict | None:
    """The controller's step-cost fit, whatever terms it has (``step_ns = alpha + beta * D + ...``)."""
    if cost is None:
        return None
    fit = {f"{k}_ns": float(getattr(cost, k)) for k in ("alpha", "beta", "gamma", "delta") if hasattr(cost, k)}
    fit["r2"] = float(np.nan_to_num(getattr(cost, "r2", float("nan"))))
    fit["identified"] = bool(getattr(cost, "identified", False))
    return fit


def cell(loop: Loop, bs: int, routing: str, profile: str, args, planner_ok: bool, seed=None, steps=None) -> dict:
    seed = 1000 + bs if seed is None else seed
    grid = args.grid   # the static rules (--static-grid, --extra-rules)
    loop.run(bs, profile, seed, 3, policy=OFF)   # graph capture + first-step costs
    if steps is None:
        timed = loop.run(bs, profile, seed, 5, policy=OFF)
        steps = int(np.clip(args.static_s / max(timed["wall_s"] / 5, 1e-4), args.min_steps, args.max_steps))
    out = {"bs": bs, "routing": routing, "profile": profile, "seed": seed, "steps": steps, "rules": {},
           "conf_bias": args.conf_bias}
    for label, policy in grid.items():
        out["rules"][label] = loop.run(bs, profile, seed, steps, policy=policy)
    # cost points measured on this loop: batch tokens -> full-model step time (off and fixed k)
    points = sorted((bs * (1 + (D if label == "off" else int(label[2:]))), r["mean_step_ms"] / 1e3)
                    for label, r in out["rules"].items() if label == "off" or label.startswith("k="))
    out["cost_points"] = points
    out["rules"]["vllm"] = loop.run(bs, profile, seed, steps, rule=anchor_rules.VllmRule(args.max_bs, D, points))
    if planner_ok:
        sps = sps_points(points)
        out["rules"]["sglang"] = loop.run(bs, profile, seed, steps, rule=anchor_rules.SglangPlanner(D, sps))
    variants = auto_variants(args.auto)
    settled = None   # the policy the first auto configuration ended with
    # auto runs long enough to learn: the controller's first decision waits for min_rows rows
    # ... and past its trials: at least auto_min_s of engine time at the fastest static rule's step
    fastest_s = min(out["rules"][label]["mean_step_ms"] for label in grid) / 1e3
    out["auto_steps"] = auto_steps = max(steps * args.auto_factor, -(-args.auto_min_rows // bs), args.auto_min_steps,
                                         int(np.ceil(args.auto_min_s / fastest_s)))
    for name, auto_config in variants.items():
        if auto_config.sps_table == "cell":
            # the engine's start-up profile as SGLang's planner gets it: the SPS table of this cell
            variants[name] = auto_config = replace(auto_config, sps_table=write_sps_table(sps_points(points)))
        logging.getLogger("vcap.controller").debug("=== bs %d %s %s seed %d: %s", bs, routing, profile, seed, name)
        out["rules"][name] = loop.run(bs, profile, seed, auto_steps, auto=auto_config)
        if settled is None:
            settled = loop.final_policy
        out["rules"][name]["config"] = {k: float(getattr(auto_config, k)) for k in ("max_tokens_given_up", "guardrail_z")}
    rules = out["rules"]
    best = max(grid, key=lambda k: rules[k]["goodput"])
    out["summary"] = {"best_static": best}
    if args.paired_tail:
        # off, the best static rule and the external rules over the auto run's length: their second
        # half is the same step window (and the same seeded draws) as auto's
        out["tail"] = {label: loop.run(bs, profile, seed, auto_steps, policy=grid[label])
                       for label in dict.fromkeys(("off", best))}
        out["tail"]["vllm"] = loop.run(bs, profile, seed, auto_steps, rule=anchor_rules.VllmRule(args.max_bs, D, points))
        if planner_ok:
            out["tail"]["sglang"] = loop.run(bs, profile, seed, auto_steps, rule=anchor_rules.SglangPlanner(D, sps))
        # the policy auto ended with, run from the first step as a static one: its choice judged
        # apart from what learning it cost (auto / settled: the start, the trials, and the draws
        # that differ once auto's early steps differ)
        out["tail"]["settled"] = loop.run(bs, profile, seed, auto_steps, policy=settled)
        out["settled_policy"] = str(settled)
    for name, auto_config in variants.items():
        bound = auto_config.max_tokens_given_up
        feasible = [k for k in grid if rules[k]["given_up"] <= bound] or ["off"]
        best_feasible = max(feasible, key=lambda k: rules[k]["goodput"])
        auto = rules[name]["goodput_second_half"]
        # the static rules over the same second half of the auto run's length are not run; the
        # static goodput is stationary (steady load), so its whole-run value stands for it
        summary = {"best_static_guardrail": best_feasible,
                   "auto_over_best_static": auto / rules[best]["goodput"],
                   "auto_over_best_static_guardrail": auto / rules[best_feasible]["goodput"],
                   "auto_over_off": auto / rules["off"]["goodput"],
                   "auto_whole_over_off": rules[name]["goodput"] / rules["off"]["goodput"],
                   "auto_over_vllm": auto / rules["vllm"]["goodput"],
                   "auto_over_sglang": auto / rules["sglang"]["goodput"] if "sglang" in rules else None,
                   "writes": rules[name]["writes"], "writes_per_engine_hour": rules[name]["writes"] / max(
                       rules[name]["engine_hours"], 1e-9),
                   "writes_per_hour_second_half": rules[name]["writes_per_hour_second_half"]}
        if args.paired_tail:
            tail = out["tail"]
            summary.update(
                paired_auto_over_best_static=auto / tail[best]["goodput_second_half"],
                paired_auto_over_off=auto / tail["off"]["goodput_second_half"],
                paired_auto_over_vllm=auto / tail["vllm"]["goodput_second_half"],
                paired_auto_over_sglang=auto / tail["sglang"]["goodput_second_half"] if "sglang" in tail else None)
            if name == next(iter(variants)):
                settled_goodput = tail["settled"]["goodput_second_half"]
                summary.update(
                    paired_auto_over_settled=auto / settled_goodput,
                    paired_settled_over_best_static=settled_goodput / tail[best]["goodput_second_half"],
                    paired_settled_over_vllm=settled_goodput / tail["vllm"]["goodput_second_half"],
                    paired_settled_over_sglang=settled_goodput / tail["sglang"]["goodput_second_half"]
                    if "sglang" in tail else None)
        if name == next(iter(variants)):
            out["summary"].update(summary)
        out["summary"][name] = summary
    return out


def sps_points(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Cost points (batch tokens, seconds) as SGLang's SPS probes (batch tokens, steps per second)."""
    return [(tokens, 1.0 / seconds) for tokens, seconds in points]


def write_sps_table(probes: list[tuple[int, float]]) -> str:
    """An SGLang SPS table file of ``probes`` (``--controller-sps-table``), written by SGLang's own
    ``profile_sps_table`` where it imports, else in its JSON shape."""
    try:
        from sglang.srt.speculative.dspark_components.dspark_sps import profile_sps_table
        text = profile_sps_table(probes=probes).to_json()
    except ImportError:
        tokens, rates = zip(*sorted(probes))
        text = json.dumps({"sample_batch_tokens": list(tokens), "sample_steps_per_sec": list(rates),
                           "max_batch_tokens": tokens[-1]})
    with tempfile.NamedTemporaryFile("w", suffix=".sps.json", delete=False) as f:
        f.write(text)
    return f.name


def auto_variants(specs: list[str]) -> dict:
    """``NAME`` or ``NAME=FIELD:VALUE,...`` -> ``{NAME: ControllerConfig}`` (the committed
    defaults, then the fields given; values take the field's default's type)."""
    return {name: controller_config(fields) for name, _, fields in (spec.partition("=") for spec in specs)}


def _line(result: dict, seconds: float) -> str:
    s, rules = result["summary"], result["rules"]
    autos = [k for k in rules if k.startswith("auto")]
    return (f"bs={result['bs']} {result['routing']} {result['profile']} seed={result['seed']} steps={result['steps']}"
            f"/{result['auto_steps']} "
            f"({seconds:.0f} s): " + "  ".join(f"{k} {v['goodput']:.0f}" for k, v in rules.items())
            + " | " + "; ".join(
                f"{a}(2nd half) {rules[a]['goodput_second_half']:.0f} /best {s[a]['auto_over_best_static']:.3f} "
                f"/off {s[a]['auto_over_off']:.3f} /vllm {s[a]['auto_over_vllm']:.3f} "
                f"/sglang {s[a]['auto_over_sglang'] if s[a]['auto_over_sglang'] is None else round(s[a]['auto_over_sglang'], 3)} "
                f"writes {s[a]['writes']}" for a in autos) + f" (best {s['best_static']})")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _r(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _model_over_measured(rule: dict) -> str:
    """The controller's predicted goodput of the policy in force over the goodput it measured on
    that policy's steps, at the end of the run (in runs before 18 the measured side also held
    the earlier policies' steps: a trial's, the start's)."""
    readings = rule.get("readings", {})
    current, observed = readings.get("current_goodput_tokens_per_second"), readings.get("observed_goodput_tokens_per_second")
    return _r(current / observed) if current and observed else "-"


def tables(R: dict) -> str:
    """bench/LOOP_RESULTS.md's tables from a result file."""
    autos = [a.partition("=")[0] for a in R["args"]["auto"]]
    head = ["bs", "routing", "accept", "steps (auto)", "off", "best static (label)", "SGLang", "vLLM"]
    for a in autos:
        head += [f"{a} 2nd half", f"{a} / best", f"{a} / off", f"{a} / SGLang", f"{a} / vLLM",
                 f"{a} writes (per h, 2nd half)", f"{a} given up"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in R["cells"] + [dict(x, repeat=True) for x in R.get("repeats", [])]:
        rules, s = c["rules"], c["summary"]
        best = s["best_static"]
        row = [str(c["bs"]) + (f" (repeat, seed {c['seed']})" if c.get("repeat") else ""), c["routing"], c["profile"],
               f"{c['steps']} ({c.get('auto_steps', '')})", f"{rules['off']['goodput']:.0f}",
               f"{rules[best]['goodput']:.0f} ({best})",
               f"{rules['sglang']['goodput']:.0f}" if "sglang" in rules else "-", f"{rules['vllm']['goodput']:.0f}"]
        for a in autos:
            v, r = s[a], rules[a]
            row += [f"{r['goodput_second_half']:.0f}", _r(v["auto_over_best_static"]), _r(v["auto_over_off"]),
                    _r(v["auto_over_sglang"]), _r(v["auto_over_vllm"]),
                    f"{r['writes']} ({r['writes_per_hour_second_half']:.0f})", f"{r['given_up']:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    out = ["\n".join(lines)]
    paired = [c for c in R["cells"] + R.get("repeats", []) if "tail" in c]
    if paired:
        # older result files ran only off and the best static rule over auto's length: the external
        # rules' ratios went through the best static rule's short run
        how = "" if "vllm" in paired[0]["tail"] else " (via best)"
        head = ["bs", "routing", "accept", "seed", "auto steps", "first / last write (s of engine time, run length; trial writes)",
                "off (window)", "best static (window)"]
        for name in autos:
            head += [f"{name} (window)", f"{name} / best static", f"{name} / off", f"{name} / SGLang{how}",
                     f"{name} / vLLM{how}", f"{name} given up", f"{name} model / measured"]
        rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for c in paired:
            best, w = c["summary"]["best_static"], c["rules"][autos[0]]["write_times_s"]
            engine_s = c["rules"][autos[0]]["engine_s"]
            trials = c["rules"][autos[0]].get("trial_write_times_s")   # recorded since run 12
            trials = f"; trials at {', '.join(f'{t:.1f}' for t in trials)}" if trials else ""
            row = [str(c["bs"]), c["routing"], c["profile"], str(c["seed"]), str(c["auto_steps"]),
                   (f"{w[0]:.1f} / {w[-1]:.1f} ({engine_s:.1f}{trials})" if w else f"none ({engine_s:.1f})"),
                   f"{c['tail']['off']['goodput_second_half']:.0f}",
                   f"{c['tail'][best]['goodput_second_half']:.0f} ({best})"]
            for name in autos:
                a, s = c["rules"][name], c["summary"][name]
                row += [f"{a['goodput_second_half']:.0f}", _r(s["paired_auto_over_best_static"]),
                        _r(s["paired_auto_over_off"]), _r(s["paired_auto_over_sglang"]),
                        _r(s["paired_auto_over_vllm"]), f"{a['given_up']:.2f}", _model_over_measured(a)]
            rows.append("| " + " | ".join(row) + " |")
        out.append("\n".join(rows))
    settled = [c for c in paired if "settled" in c["tail"]]
    if settled:
        out.append(_settled_table(settled, autos[0]))
    # the controller's cost fit against the measured step time
    cost = ["| bs | routing | accept | fit (auto) | " + " | ".join(
        f"{k}: D, measured / fitted ms" for k in ("off", "k=1", "k=2", "k=3", "k=4")) + " | step jitter (k=1) |",
        "|" + " --- |" * 10]
    scale = R.get("scale", 1.0)
    for c in R["cells"]:
        fit = c["rules"][autos[0]].get("cost_fit")
        if not fit:
            continue
        cells = []
        for k in ("off", "k=1", "k=2", "k=3", "k=4"):
            r = c["rules"][k]
            d = r.get("mean_experts_live")
            if d is None:
                cells.append("-")
                continue
            fitted = (fit.get("alpha_ns", 0) + fit.get("beta_ns", 0) * d + fit.get("delta_ns", 0) * r["mean_live_rows"]
                      + fit.get("gamma_ns", 0) * c["bs"]) * scale / 1e6
            cells.append(f"{d:.0f}, {r['mean_record_step_ns'] * scale / 1e6:.1f} / {fitted:.1f}")
        cost.append(f"| {c['bs']} | {c['routing']} | {c['profile']} | R^2 {fit['r2']:.3f} "
                    f"({'identified' if fit['identified'] else 'not identified'}) | " + " | ".join(cells)
                    + f" | {_pct(c['rules']['k=1'].get('step_jitter'))} |")
    out.append("\n".join(cost))
    return "\n\n".join(out)


def _settled_table(cells: list[dict], name: str) -> str:
    """The policy ``name`` ended with, run from the first step as a static one, over the same
    second half: its choice against the other rules, and what auto's learning cost against it."""
    head = ["bs", "routing", "accept", "ended with (rule at this bs; explore period)", "settled (window)",
            "settled / best static", "settled / SGLang", "settled / vLLM", f"{name} / settled"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in cells:
        s, rule = c["summary"][name], _rule_text(c["settled_policy"], c["bs"])
        rows.append("| " + " | ".join([
            str(c["bs"]), c["routing"], c["profile"], rule, f"{c['tail']['settled']['goodput_second_half']:.0f}",
            _r(s["paired_settled_over_best_static"]), _r(s["paired_settled_over_sglang"]),
            _r(s["paired_settled_over_vllm"]), _r(s["paired_auto_over_settled"])]) + " |")
    return "\n".join(rows)


def _rule_text(policy_text: str, bs: int) -> str:
    """``threshold:k_min-k_max; explore/N`` of the bucket serving ``bs`` in a ``str(Policy)``."""
    if "mode='off'" in policy_text:
        return "off"
    buckets = re.findall(r"Bucket\(min_bs=(\d+), k_min=(\d+), k_max=(\d+), thresholds=\(([\d.]+)", policy_text)
    period = re.search(r"explore_period=(\d+)", policy_text)
    rule = [b for b in buckets if int(b[0]) <= bs][-1] if buckets else None
    text = f"{float(rule[3]):g}:{rule[1]}-{rule[2]}" if rule else policy_text
    return text + (f"; explore/{period.group(1)}" if period else "")


def noise(R: dict) -> str:
    """Spread of each repeated cell: every rule's goodput and auto's ratios, over the grid's run and the repeats."""
    def cell_of(c):
        return c["bs"], c["routing"], c["profile"]

    repeated = list(dict.fromkeys(cell_of(c) for c in R.get("repeats", [])))
    out = [_noise([c for c in R["cells"] + R.get("repeats", []) if cell_of(c) == key]) for key in repeated]
    return "\n\n".join(out) or "no repeats"


def _noise(runs: list[dict]) -> str:
    if len(runs) < 2:
        return "one run"
    lines = [f"bs {runs[0]['bs']} {runs[0]['routing']} {runs[0]['profile']}:", "",
             "| quantity | runs (seed) | same seed: max/min - 1 | all: max/min - 1 | all: mean |",
             "| --- | --- | --- | --- | --- |"]
    same = [r for r in runs if r["seed"] == runs[0]["seed"]]
    keys = list(runs[0]["rules"])
    autos = [k for k in keys if k.startswith("auto")]
    rows = [(k, lambda c, k=k: c["rules"][k]["goodput_second_half" if k.startswith("auto") else "goodput"]) for k in keys]
    for a in autos:
        for q in ("auto_over_best_static", "auto_over_off", "auto_over_vllm", "auto_over_sglang",
                  "paired_auto_over_best_static", "paired_auto_over_off", "paired_auto_over_vllm",
                  "paired_auto_over_sglang"):
            rows.append((f"{a}: {q.replace('auto_over_', '')}", lambda c, a=a, q=q: c["summary"][a].get(q)))
    for name, get in rows:
        values = [get(c) for c in runs]
        if any(v is None for v in values):
            continue
        sv = [get(c) for c in same]
        lines.append(f"| {name} | " + ", ".join(f"{v:.3g} ({c['seed']})" for v, c in zip(values, runs))
                     + f" | {max(sv) / min(sv) - 1:.3f} | {max(values) / min(values) - 1:.3f} | "
                       f"{sum(values) / len(values):.3g} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", metavar="RESULT.json", help="print the markdown tables of a result file and exit")
    ap.add_argument("--out", default="loop.json")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting cells after this")
    ap.add_argument("--bs", default="1,4,16,64,256")
    ap.add_argument("--routings", default="uniform,zipf:1.2")
    ap.add_argument("--profiles", default="steep,high")
    ap.add_argument("--conf-bias", type=float, default=0.0,
                    help="SYNTHETIC head's confidence bias in logits (0: right on average; > 0 over-confident)")
    ap.add_argument("--preset", default="v4.1", choices=sorted(PRESETS))
    ap.add_argument("--run-layers", type=int, default=2)
    ap.add_argument("--other-ms", type=float, default=2.0, help="stated non-MoE part of a full-model step")
    ap.add_argument("--max-bs", type=int, default=256)
    ap.add_argument("--static-s", type=float, default=0.5, help="wall seconds per static run (sets the steps)")
    ap.add_argument("--auto-factor", type=int, default=6, help="auto runs this many times the steps")
    ap.add_argument("--auto-min-rows", type=int, default=2400, help="and at least this many request-steps")
    ap.add_argument("--auto-min-steps", type=int, default=0, help="and at least this many steps")
    ap.add_argument("--auto-min-s", type=float, default=0.0,
                    help="and at least this many seconds of engine time (at the fastest static rule's step)")
    ap.add_argument("--paired-tail", action="store_true",
                    help="also run off, the best static rule, vLLM's and SGLang's rules for auto's steps: ratios "
                         "over the same window")
    ap.add_argument("--static-grid", choices=("full", "short"), default="full",
                    help="the static rules: the full grid (bench/static_grid.py, as eval_controller.py) or the "
                    "seven of runs up to 22")
    ap.add_argument("--extra-rules", default="", metavar="LABEL,...",
                    help="more static rules, by label (conf0.4k4: threshold 0.4, k 1-4; conf0.3k2-5; k=2)")
    ap.add_argument("--min-steps", type=int, default=40)
    ap.add_argument("--max-steps", type=int, default=1500)
    ap.add_argument("--auto", action="append", default=None, metavar="NAME[=FIELD:VALUE,...]",
                    help="a controller configuration to run as a rule (repeatable); default: 'auto' (the "
                    "committed ControllerConfig) and 'auto_noguard' (no given-up bound, guardrail_z 0)")
    ap.add_argument("--repeat", action="append", default=[], metavar="BS,ROUTING,PROFILE",
                    help="after the grid, run this cell again --repeats times: its own seed once, then others "
                         "(repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", default=None, metavar="BS,ROUTING,PROFILE,STEPS",
                    help="after the grid, run each auto configuration alone this many steps on this cell: policy "
                    "writes at steady load (after the first 60 s of engine time) per hour")
    ap.add_argument("--controller-log", default=None, metavar="FILE",
                    help="write the controller's decisions (the vcap.controller logger at DEBUG: per busy bucket "
                    "the rule judged, the choice and the five best predicted) to FILE")
    ap.add_argument("--repeat-budget-s", type=float, default=60.0, help="stop starting repeats after this (all cells)")
    args = ap.parse_args(argv)
    if args.tables:
        with open(args.tables) as f:
            R = json.load(f)
        print(tables(R) + "\n\n" + noise(R))
        return
    try:
        args.grid = dict(static_grid.GRID if args.static_grid == "full" else static_grid.SHORT)
        args.grid.update(static_grid.rules(label for label in args.extra_rules.split(",") if label))
    except ValueError as error:
        ap.error(str(error))
    if args.controller_log:
        handler = logging.FileHandler(args.controller_log)
        handler.setFormatter(logging.Formatter("%(created).3f %(message)s"))
        logging.getLogger("vcap.controller").addHandler(handler)
        logging.getLogger("vcap.controller").setLevel(logging.DEBUG)
    args.auto = args.auto or ["auto", "auto_noguard=max_tokens_given_up:inf,guardrail_z:0"]
    if not all(a.partition("=")[0].startswith("auto") for a in args.auto):
        ap.error("--auto names must start with 'auto'")
    auto_variants(args.auto)   # fail early on a bad field
    started = time.monotonic()
    R = {"args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
         "stand_ins": sgl_standin.install(), "cells": [], "skipped": [], "repeats": [],
         "controller_defaults": {k: float(getattr(ControllerConfig(), k)) for k in ("max_tokens_given_up", "guardrail_z")}}
    try:
        anchor_rules.SglangPlanner(D, [(1, 1.0)])
        planner_ok = True
    except Exception as error:   # recorded, and the cells run without it
        planner_ok, R["planner_error"] = False, f"{type(error).__name__}: {error}"
        log("SGLang planner unavailable:", R["planner_error"])
    loop = Loop(args)
    R["scale"] = loop.step.scale
    try:
        for bs in (int(b) for b in args.bs.split(",")):
            for routing in args.routings.split(","):
                loop.set_routing(routing)
                for profile in args.profiles.split(","):
                    if time.monotonic() - started > args.budget_s:
                        R["skipped"].append((bs, routing, profile))
                        continue
                    t0 = time.monotonic()
                    result = cell(loop, bs, routing, profile, args, planner_ok)
                    R["cells"].append(result)
                    log(_line(result, time.monotonic() - t0))
                    with open(args.out, "w") as f:
                        json.dump(R, f, default=str)
        if args.long:
            bs, routing, profile, steps = args.long.split(",")
            bs, steps = int(bs), int(steps)
            loop.set_routing(routing)
            loop.run(bs, profile, 1000 + bs, 3, policy=OFF)   # graph capture
            # every auto configuration on the same requests: R["long"] the first, R["long_more"] the rest
            for n, (name, config) in enumerate(auto_variants(args.auto).items()):
                t0 = time.monotonic()
                run = loop.run(bs, profile, 1000 + bs, steps, auto=config)
                steady = [t for t in run["write_times_s"] if t >= 60.0]
                long = dict(run, bs=bs, routing=routing, profile=profile, auto=name, writes_after_60s=len(steady),
                            writes_per_hour_after_60s=len(steady) / max(run["engine_s"] - 60.0, 1e-9) * 3600)
                if n == 0:
                    R["long"] = long
                else:
                    R.setdefault("long_more", []).append(long)
                log(f"long: bs={bs} {routing} {profile} {name} {steps} steps, {run['engine_s']:.0f} s of engine time "
                    f"({time.monotonic() - t0:.0f} s): writes {run['write_times_s']}, {len(steady)} after 60 s = "
                    f"{long['writes_per_hour_after_60s']:.1f} per hour; goodput {run['goodput']:.0f}; "
                    f"last {run['last_policy']}")
                with open(args.out, "w") as f:
                    json.dump(R, f, default=str)
        repeat_started = time.monotonic()
        for repeat in args.repeat:
            bs, routing, profile = repeat.split(",")
            bs = int(bs)
            first = next((c for c in R["cells"] if (c["bs"], c["routing"], c["profile"]) == (bs, routing, profile)), None)
            loop.set_routing(routing)
            for n in range(args.repeats):
                if time.monotonic() - repeat_started > args.repeat_budget_s:
                    break
                t0 = time.monotonic()
                # the same seed (and steps) as the grid's run first: timing and decisions alone; then other workloads
                result = cell(loop, bs, routing, profile, args, planner_ok, seed=1000 + bs + n * 7919 if n else None,
                              steps=first["steps"] if first else None)
                R["repeats"].append(result)
                log("repeat", n, _line(result, time.monotonic() - t0))
                with open(args.out, "w") as f:
                    json.dump(R, f, default=str)
    finally:
        loop.close()
        R["wall_s"] = time.monotonic() - started
        with open(args.out, "w") as f:
            json.dump(R, f, default=str)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
