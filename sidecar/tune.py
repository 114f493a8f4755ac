"""``vcapctl tune FILE``: offline choice of thresholds from a recorded trace.

Reads a sidecar recording (``--record``, :mod:`vcap.sidecar.recorder`) or the seed adapter's
binary log (``DSV41_VERIFY_CAP_LOG``: little-endian float32 rows of ``stride + 1`` values per
request: the confidences, the live length L and the accepted drafts; no step boundary, batch size
or expert ids; rows with ``L < stride`` are censored), then prints, for a grid of policies and
each batch size, committed tokens per request-step, tokens given up against verifying every row,
distinct experts per layer, predicted step time and goodput, and names the recommended policy.

Tokens are measured where the trace observed them and modelled (calibrated acceptance) only for
drafts the trace's own policy capped. Expert counts and step times are modelled: fitted on the
recording's sampled steps, or, for a seed log (no expert counts), the controller's modelled H200
cost (``MODELLED_COST``: ``22.9 us + 11.05 us x D`` per MoE layer + 2 ms, and ``MODELLED_ROW_US``
per live row and layer) over a Zipf(1) router of 384 experts, top-6, 43 layers.

The recommendation is bounded by ``--max-tokens-given-up`` (default 0.1 accepted drafts per
request-step). The live controller's default has no such bound (``inf``): it protects goodput
with a test on its model's standard errors, re-judged on every window of new rows. The tuner
decides once, on one recording, without that test, so it keeps an explicit bound.
"""

import argparse
import sys

import numpy as np

from vcap.policy import Bucket, Policy

from .controller.calibration import AcceptanceCalibration
from .controller.cost_model import MODELLED_COST, MODELLED_ROW_US, ExpertCurve, StepCostFit
from .controller.goodput import THRESHOLD_GRID, accepted_table, candidate_grid, evaluate_rules
from .policy_edit import merge_buckets
from .recorder import is_recording, iter_recording, recording_files
from .telemetry import unpack

__all__ = ["main", "run", "read_seed_log", "load_trace", "build_parser", "recommended_policy", "set_command"]

_CHUNK_ROWS = 100_000
_COARSE_THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)


# The tuner's explicit bound on tokens given up (see the module docstring): the first round's
# default of the live controller, kept here because the tuner has no model-error guardrail.
TUNE_MAX_TOKENS_GIVEN_UP = 0.1


def read_seed_log(path: str, stride: int = 6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(confidence [rows, stride-1], live, accepted)`` of a seed-adapter log; a partial last row is dropped."""
    values = np.fromfile(path, dtype="<f4")
    width = stride + 1
    usable = len(values) // width * width
    if usable != len(values):
        print(f"tune: {path}: {len(values) - usable} trailing float(s) of a partial row ignored", file=sys.stderr)
    rows = values[:usable].reshape(-1, width)
    # a seed log holds confidences in [0, 1] and whole live/accepted counts: anything else is
    # another file, which clipping would turn into a confident-looking recommendation
    confidence_ok = np.isfinite(rows[:, :stride - 1]) & (rows[:, :stride - 1] >= 0) & (rows[:, :stride - 1] <= 1)
    counts = rows[:, stride - 1:]
    counts_ok = np.isfinite(counts) & (counts == np.round(counts)) & (counts >= 0) & (counts <= stride)
    bad = len(rows) - int((confidence_ok.all(axis=1) & counts_ok.all(axis=1)).sum())
    if bad:
        raise ValueError(f"{path}: not a vcap recording, nor a seed log of stride {stride}: {bad} of {len(rows)} "
                         "rows hold a confidence outside [0, 1] or a live/accepted count that is not a whole "
                         f"number in 0..{stride}")
    live = np.clip(np.rint(rows[:, stride - 1]).astype(np.int64), 1, stride)
    accepted = np.clip(np.rint(rows[:, stride]).astype(np.int64), 0, live - 1)
    return rows[:, :stride - 1].copy(), live, accepted


def load_trace(path: str, stride: int = 6) -> dict:
    """Request rows, batch sizes and, for a recording, the measured cost samples. A recording is
    read with the files rotated out of it (``FILE.1``...), oldest first, chunk by chunk."""
    if is_recording(path):
        files = recording_files(path)
        parts = {name: [] for name in ("confidence", "live", "accepted", "bs", "sampled_bs", "sampled_live_rows",
                                       "experts_all", "experts_live", "step_ns")}
        config = None
        for file in files:
            file_config, chunks = iter_recording(file)
            if config is not None and file_config != config:
                raise ValueError(f"{file}: another engine geometry than {files[-1]}; tune them apart")
            config = file_config
            for records in chunks:
                batch = unpack(records)
                confidence, live, accepted = batch.rows()
                sampled = batch.sampled
                for name, values in (("confidence", confidence), ("live", live), ("accepted", accepted),
                                     ("bs", batch.bs), ("sampled_bs", batch.bs[sampled]),
                                     ("sampled_live_rows", batch.live_rows[sampled]),
                                     ("experts_all", batch.experts_all), ("experts_live", batch.experts_live),
                                     ("step_ns", batch.field("step_ns")[sampled])):
                    parts[name].append(values)
        if not parts["bs"]:
            raise ValueError(f"{path}: no records")
        trace = {name: np.concatenate(values) for name, values in parts.items()}
        return {"kind": "recording", "config": config, "files": files, **trace}
    confidence, live, accepted = read_seed_log(path, stride)
    return {"kind": "seed", "config": None, "confidence": confidence, "live": live, "accepted": accepted, "bs": None,
            "files": [path]}


def _cost_model(trace: dict, stride: int):
    config = trace["config"]
    if trace["kind"] == "recording" and len(trace["sampled_bs"]) >= 8:
        curve = ExpertCurve(config.num_moe_layers, config.num_experts, config.top_k, stride * config.max_bs)
        rows = np.concatenate([stride * trace["sampled_bs"], trace["sampled_live_rows"]])
        curve.fit(rows, np.concatenate([trace["experts_all"], trace["experts_live"]]))
        cost = StepCostFit(num_layers=config.num_moe_layers)
        cost.fit(trace["experts_live"].sum(axis=1), trace["sampled_bs"], trace["step_ns"],
                 live_rows=trace["sampled_live_rows"])
        if cost.ready:
            rows = f" + {cost.delta / 1e3:.2f} us x live rows{'' if cost.rows_identified else ' (modelled)'}" \
                if cost.delta else ""
            return curve, cost, (f"measured on {len(trace['sampled_bs'])} sampled steps: expert curve R^2 "
                                 f"{curve.r2:.3f}, step time {cost.alpha / 1e6:.2f} ms + {cost.beta / 1e3:.2f} us x experts"
                                 f"{rows}{' (slope assumed: one operating point)' if not cost.identified else f', R^2 {cost.r2:.3f}'}")
    layers = config.num_moe_layers if config else 43
    curve = ExpertCurve(layers, config.num_experts if config else 384, config.top_k if config else 6,
                        stride * (config.max_bs if config else 1024))
    curve.assume_skew(1.0)
    per_layer_us, per_expert_us, other_ms = MODELLED_COST
    cost = StepCostFit(num_layers=layers)
    cost.set_prior((layers * per_layer_us + other_ms * 1e3) * 1e3, per_expert_us * 1e3,
                   delta_ns=MODELLED_ROW_US * layers * 1e3)
    return curve, cost, (f"MODELLED (no expert counts in the trace): Zipf(1) router, H200 cost {per_layer_us:g} us + "
                         f"{per_expert_us:g} us x D + {MODELLED_ROW_US:g} us x live rows per layer + {other_ms:g} ms")


def run(args) -> dict:
    """Evaluate the grid on the trace; returns the table (list of dicts) and the recommendation."""
    trace = load_trace(args.file, args.stride)
    confidence, live, accepted = trace["confidence"], trace["live"], trace["accepted"]
    stride = confidence.shape[1] + 1
    num_drafts = stride - 1
    total = len(live)
    if total == 0:
        raise ValueError(f"{args.file}: no request rows")
    calibration = AcceptanceCalibration(num_drafts, half_life_rows=float("inf"))
    for start in range(0, total, _CHUNK_ROWS):
        part = slice(start, start + _CHUNK_ROWS)
        calibration.update(confidence[part], live[part], accepted[part])
    thresholds = THRESHOLD_GRID if args.grid == "full" else _COARSE_THRESHOLDS
    rules = candidate_grid(num_drafts, thresholds)
    sums = {"tokens": np.zeros(len(rules)), "live": np.zeros(len(rules)), "given_up": np.zeros(len(rules))}
    for start in range(0, total, _CHUNK_ROWS):
        part = slice(start, start + _CHUNK_ROWS)
        evaluation = evaluate_rules(confidence[part], live[part], accepted[part], calibration, rules)
        count = len(live[part])
        sums["tokens"] += evaluation.tokens * count
        sums["live"] += evaluation.mean_live * count
        sums["given_up"] += evaluation.given_up * count
        if total > _CHUNK_ROWS:
            print(f"tune: {min(start + _CHUNK_ROWS, total)}/{total} rows evaluated", file=sys.stderr, flush=True)
    tokens, mean_live, given_up = (sums[k] / total for k in ("tokens", "live", "given_up"))
    curve, cost, cost_source = _cost_model(trace, stride)
    if args.bs:
        batch_sizes = sorted({int(b) for b in args.bs.split(",")})
    elif trace["bs"] is not None:
        batch_sizes = sorted({int(b) for b in np.percentile(trace["bs"], [10, 50, 90]).round()})
    else:
        batch_sizes = [1, 8, 32, 64]
    censored = float(((accepted == live - 1) & (live < stride)).mean())
    recorded_given_up = _recorded_given_up(confidence, live, accepted, calibration)
    table, recommended, recorded = [], {}, {}
    for bs in batch_sizes:
        experts = curve.total(bs * mean_live) / curve.num_layers
        experts_all = curve.total(bs * stride) / curve.num_layers
        step_ns = cost.predict(curve.total(bs * mean_live), bs, bs * mean_live)
        goodput = bs * tokens / (step_ns / 1e9)
        for i, rule in enumerate(rules):
            table.append({"bs": bs, "rule": rule, "tokens": tokens[i], "given_up": given_up[i], "mean_live": mean_live[i],
                          "experts_per_layer": experts[i], "experts_saved": 1 - experts[i] / experts_all,
                          "step_ms": step_ns[i] / 1e6, "goodput": goodput[i]})
        feasible = np.where(given_up <= args.max_tokens_given_up + 1e-12, goodput, -np.inf)
        recommended[bs] = int(np.argmax(feasible))
        recorded_experts = curve.total(bs * live.mean()) / curve.num_layers
        recorded[bs] = {"given_up": recorded_given_up, "experts_saved": 1 - recorded_experts / experts_all}
    policy = recommended_policy(rules, recommended, batch_sizes)
    return {"kind": trace["kind"], "files": trace["files"], "rows": total, "censored_fraction": censored, "cost_source": cost_source,
            "rules": rules, "table": table, "recommended": recommended, "batch_sizes": batch_sizes,
            "recorded": recorded, "policy": policy, "command": set_command(policy)}


def _recorded_given_up(confidence, live, accepted, calibration) -> float:
    """Tokens per request-step the trace's own policy gave up against verifying every row."""
    total, stride = 0.0, confidence.shape[1] + 1
    for start in range(0, len(live), _CHUNK_ROWS):
        part = slice(start, start + _CHUNK_ROWS)
        table = accepted_table(confidence[part], live[part], accepted[part], calibration)
        total += float((table[:, stride] - np.minimum(accepted[part], live[part] - 1)).sum())
    return total / len(live)


def recommended_policy(rules: list[Bucket], recommended: dict, batch_sizes: list[int]) -> Policy:
    """The per-batch-size choices as one conf policy: a bucket from each evaluated batch size
    (the first from 1), consecutive buckets of the same rule merged, exploration off."""
    buckets = [Bucket(1 if i == 0 else bs, rules[recommended[bs]].k_min, rules[recommended[bs]].k_max,
                      (rules[recommended[bs]].thresholds[0],))
               for i, bs in enumerate(batch_sizes)]
    return Policy(mode="conf", fixed_k=1, buckets=merge_buckets(buckets), explore_period=0)


def set_command(policy: Policy) -> str:
    """A ``vcapctl set`` command that yields ``policy`` from any state (off, fixed, auto...)."""
    buckets = " ".join(f"--bucket {b.min_bs}:{b.thresholds[0]:g}:{b.k_min}-{b.k_max}" for b in policy.buckets)
    return f"vcapctl set --mode conf --explore-period {policy.explore_period} {buckets}"


def _spec(rule: Bucket) -> str:
    return f"{rule.thresholds[0]:g}:{rule.k_min}-{rule.k_max}"


def _print(result: dict, args) -> None:
    rotated = len(result["files"]) - 1
    print(f"trace: {args.file}{f' and {rotated} file(s) rotated out of it' if rotated else ''} "
          f"({'sidecar recording' if result['kind'] == 'recording' else 'seed adapter log'}), "
          f"{result['rows']} request rows, {100 * result['censored_fraction']:.1f}% capped by the recorded policy")
    print("tokens/request-step and tokens given up: MEASURED on the trace's rows, MODELLED (calibrated "
          "confidence) only for drafts the recorded policy capped")
    print(f"experts per layer and step time: {result['cost_source']}")
    for bs in result["batch_sizes"]:
        print(f"\nbs {bs}: policy (threshold:k_min-k_max)  tokens/req-step  given up  mean L  experts/layer  saved  step ms  tok/s")
        for row in (r for r in result["table"] if r["bs"] == bs):
            print(f"  {_spec(row['rule']):>14}  {row['tokens']:15.3f}  {row['given_up']:8.3f}  {row['mean_live']:6.2f}  "
                  f"{row['experts_per_layer']:13.1f}  {100 * row['experts_saved']:4.1f}%  {row['step_ms']:7.2f}  {row['goodput']:7.0f}")
    print(f"\nrecorded policy: {result['recorded'][result['batch_sizes'][0]]['given_up']:.3f} tokens given up "
          "per request-step")
    print(f"recommended (max goodput with at most {args.max_tokens_given_up:g} tokens given up per request-step; "
          f"from any mode, auto included, it takes manual control): {result['command']}")


def _plot(result: dict, path: str) -> list[str] | None:
    """Write the Pareto plot; its legend's labels (None without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tune: matplotlib is missing (pip install 'vcap[plot]'); no Pareto plot written", file=sys.stderr)
        return None
    figure, axes = plt.subplots(figsize=(7, 5))
    for bs in result["batch_sizes"]:
        rows = [r for r in result["table"] if r["bs"] == bs]
        x = np.array([r["given_up"] for r in rows])
        y = np.array([100 * r["experts_saved"] for r in rows])
        order = np.argsort(x)
        front = [i for i in order if not ((x <= x[i]) & (y > y[i])).any()]
        axes.scatter(x, y, s=10, alpha=0.4)
        line, = axes.plot(x[front], y[front], marker="o", label=f"bs {bs} Pareto front")
        chosen = rows[result["recommended"][bs]]
        axes.scatter([chosen["given_up"]], [100 * chosen["experts_saved"]], marker="*", s=260, color=line.get_color(),
                     edgecolors="black", zorder=5, label=f"bs {bs} recommended ({_spec(chosen['rule'])})")
        recorded = result["recorded"][bs]
        axes.scatter([recorded["given_up"]], [100 * recorded["experts_saved"]], marker="X", s=140,
                     color=line.get_color(), edgecolors="black", zorder=5, label=f"bs {bs} current (as recorded)")
    axes.set_xlabel("accepted tokens given up per request-step")
    axes.set_ylabel("experts saved per layer (%)")
    axes.set_title("vcap tune: tokens given up vs experts saved")
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    plt.close(figure)
    print(f"tune: Pareto plot written to {path}", file=sys.stderr)
    return labels


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vcapctl tune", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("file", help="a sidecar --record file or a DSV41_VERIFY_CAP_LOG seed log")
    add("--stride", type=int, default=6, help="seed log only: verify rows per request (drafts + 1)")
    add("--bs", default=None, help="batch sizes to evaluate, e.g. 1,8,32,64 (default: the recording's, or 1,8,32,64)")
    add("--max-tokens-given-up", type=float, default=TUNE_MAX_TOKENS_GIVEN_UP,
        help="most accepted drafts per request-step the recommendation may give up against verifying every "
             "row (default: %(default)s; the tuner has no test on its model's error, unlike the live controller, "
             "whose default is inf)")
    add("--grid", choices=("coarse", "full"), default="coarse", help="policy grid to print and search")
    add("--plot", default=None, metavar="PNG", help="write the Pareto front here (needs matplotlib)")
    return parser


def main(argv=None) -> int:
    return report(build_parser().parse_args(argv))


def report(args) -> int:
    """Run the tuner on parsed arguments and print (and plot) the result; the exit status."""
    try:
        result = run(args)
    except (OSError, ValueError) as error:
        print(f"tune: {error}", file=sys.stderr)
        return 1
    _print(result, args)
    if args.plot:
        _plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
