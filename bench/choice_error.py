"""Where auto's prediction of two rules' goodput parts from what the runs measured.

A diagnostic for the steady windows where auto kept a rule the runs from its state beat by more
than the 1% gain a move needs (``CONTROLLER_RESULTS.md``, forty-third round). For one trace's
eval file and the controller log of its first auto run, over a window and a batch size (or a
range of them, read size by size):

- measured: committed tokens per request and step, live rows per request and the mean step of
  auto's run (the rule it kept) and of one rule run from auto's state at the change; or, for a
  window before any change (``--kept-run``), of two static rules' runs from time 0;
- predicted: the same parts of the two rules as the controller logged them at each tick in the
  window (goodput, live rows, committed tokens where the log has them, the measured step-time
  correction), and the step from the cost fit's own probes at the predicted live rows.

Every figure is a ratio of the other rule to the kept one, so that the scales of the simulated
engine's time and the fit's never meet. Auto's measured parts include its exploration steps (one
in the explore period, every row live), which the prediction of a rule leaves out: at period 128
they add about 0.03 live rows per request to the kept rule's measurement.

    python bench/choice_error.py runs/gpu41_drawn47-8-accept_s1.json.xz \\
        runs/gpu41_drawn47-8-accept_s1_controller.log.xz --kept 0.7:1-3 --other 0.6:1-5 --other-run conf0.6
    python bench/choice_error.py runs/gpu54_drawn47-4-shift_s1_c7023e3.json.xz \\
        runs/gpu54_drawn47-4-shift_s1_c7023e3_controller.log.xz --kept 0.2:1-5 --other 0.1:1-5 \\
        --kept-run conf0.2 --other-run conf0.1 --window 10,30 --bs 140-190 --drift 10
"""

import argparse
import json
import lzma
import re

import numpy as np

RULE = re.compile(r"(\d[\d.]*:\d-\d) ([\d.]+) tok/s \(L ([\d.]+)(?:, T ([\d.]+))?(?: x([\d.]+))?\)")


def _open(path: str):
    return lzma.open(path, "rt") if path.endswith(".xz") else open(path)


def measured(run: dict, lo: float, hi: float, bs: int) -> dict:
    """A run's tokens per request-step, live rows per request and mean step (ns) at ``bs``."""
    tokens = ns = steps = live = 0.0
    for second, size, t, n in run["sizes"]:
        if lo <= second < hi and size == bs:
            tokens, ns = tokens + t, ns + n
    for second, size, s, rows in run["size_live"]:
        if lo <= second < hi and size == bs:
            steps, live = steps + s, live + rows
    if not steps:
        raise SystemExit(f"no steps at bs {bs} in [{lo}, {hi}) s")
    return {"tokens": tokens / (steps * bs), "live": live / (steps * bs), "step": ns / steps, "steps": steps}


def measured_ratios(kept: dict, other: dict, lo: float, hi: float, sizes: range) -> dict:
    """``other``'s parts over ``kept``'s (tokens, live rows, step; and goodput), batch size by batch
    size over ``sizes``, each size weighted by the fewer steps the two runs took there: runs at a
    load that wanders are compared at equal batch sizes, never across them."""
    weights, ratios = [], []
    for bs in sizes:
        try:
            a, b = measured(kept, lo, hi, bs), measured(other, lo, hi, bs)
        except SystemExit:
            continue   # one of the runs never stepped at this size
        weights.append(min(a["steps"], b["steps"]))
        ratios.append([b[part] / a[part] for part in ("tokens", "live", "step")])
    if not weights:
        raise SystemExit(f"no batch size in {sizes.start}-{sizes.stop - 1} where both runs stepped in [{lo}, {hi}) s")
    tokens, live, step = np.average(np.asarray(ratios), axis=0, weights=weights)
    return {"tokens": float(tokens), "live": float(live), "step": float(step), "goodput": float(tokens / step),
            "steps": float(sum(weights))}


def live_by_window(run: dict, lo: float, hi: float, sizes: range, width: float) -> list[float | None]:
    """A run's live rows per request in each ``width`` s window of ``[lo, hi)``, over ``sizes``
    (None where it took no step there): whether the rows of a window stay as they were."""
    out = []
    for start in np.arange(lo, hi, width):
        rows = requests = 0.0
        for second, size, steps, live in run["size_live"]:
            if start <= second < start + width and size in sizes:
                rows, requests = rows + live, requests + steps * size
        out.append(rows / requests if requests else None)
    return out


def predicted(log_path: str, kept: str, other: str, lo: float, hi: float, run: int = 0) -> list[dict]:
    """Per tick in ``[lo, hi)`` of auto's run ``run`` in the log (0: the first, then its
    replicas; auto-bounded's runs are skipped): both rules' logged parts (where both are among
    the five best logged)."""
    ticks, now, runs, reading = [], None, -1, False
    with _open(log_path) as log:
        for line in log:
            if line.startswith("==="):
                if line.split()[2] == "auto":
                    runs += 1
                reading = line.split()[2] == "auto" and runs == run
                if runs > run:
                    break
            elif not reading:
                continue
            elif line.startswith("tick at"):
                now = float(line.split()[2])
            elif line.startswith("bucket") and now is not None and lo <= now < hi:
                rules = {}
                for name, goodput, live, tokens, fix in RULE.findall(line.split("best:")[1]):
                    rules[name] = {"goodput": float(goodput), "live": float(live),
                                   "tokens": float(tokens) if tokens else None, "x": float(fix) if fix else 1.0}
                if kept in rules and other in rules:
                    ticks.append({"at": now, "kept": rules[kept], "other": rules[other]})
    return ticks


def fitted_step(probes: list, at: float, live: float) -> float:
    """The cost fit's step at ``live`` rows per request, from the probe nearest ``at``."""
    _, _, step_ns = min(probes, key=lambda probe: abs(probe[0] - at))
    return float(np.interp(live, np.arange(1, len(step_ns) + 1), step_ns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_json")
    parser.add_argument("controller_log")
    parser.add_argument("--trace", default=None, help="the trace in the file (default: its only one)")
    parser.add_argument("--kept", required=True, help="the rule auto kept, as the log names it (0.7:1-3)")
    parser.add_argument("--other", required=True, help="the rule compared, as the log names it (0.6:1-5)")
    parser.add_argument("--other-run", required=True, help="the static rule run from auto's state (conf0.6)")
    parser.add_argument("--kept-run", default=None,
                        help="a window before any change: the kept rule measured on this static run (conf0.2) and "
                             "--other-run on its own, both from time 0, instead of auto's run and the runs from its state")
    parser.add_argument("--window", default="60,90")
    parser.add_argument("--bs", default="4", help="a batch size, or a range LO-HI read size by size")
    parser.add_argument("--run", type=int, default=0, help="auto's run: 0 the first, 1.. its replicas")
    parser.add_argument("--drift", type=float, default=0.0, metavar="S",
                        help="also print both runs' live rows per request in S-second windows from the start of the run")
    args = parser.parse_args()
    lo, hi = (float(v) for v in args.window.split(","))
    low, _, high = args.bs.partition("-")
    sizes = range(int(low), int(high or low) + 1)

    with _open(args.eval_json) as f:
        results = json.load(f)["results"]
    runs = results[args.trace or next(iter(results))]
    first = runs["auto"]
    auto = first if args.run == 0 else first["replicas"]["auto"][args.run - 1]
    if args.kept_run:
        kept_run, other_run = runs[args.kept_run], runs[args.other_run]
    else:
        kept_run, other_run = auto, next(iter(auto["from_state"].values()))[args.other_run]
    seen = measured_ratios(kept_run, other_run, lo, hi, sizes)
    ticks = predicted(args.controller_log, args.kept, args.other, lo, hi, args.run)
    if not ticks:
        raise SystemExit(f"no tick in [{lo}, {hi}) s logs both {args.kept} and {args.other}")
    probes = [probe for probe in auto["cost_probes"] if probe[1] in sizes] or auto["cost_probes"]

    ratios = {"goodput": [], "live": [], "step": [], "tokens": []}
    for tick in ticks:
        a, b = tick["kept"], tick["other"]
        step = (fitted_step(probes, tick["at"], b["live"]) * b["x"]) / (fitted_step(probes, tick["at"], a["live"]) * a["x"])
        ratios["goodput"].append(b["goodput"] / a["goodput"])
        ratios["live"].append(b["live"] / a["live"])
        ratios["step"].append(step)
        # committed tokens: logged where the log has them, else what goodput and step imply
        tokens = b["tokens"] / a["tokens"] if a["tokens"] else ratios["goodput"][-1] * step
        ratios["tokens"].append(tokens)

    kept_name = args.kept_run or f"auto's run {args.run}"
    print(f"{args.other} ({args.other_run}) over {args.kept} ({kept_name}), bs {args.bs}, {lo:g}-{hi:g} s: "
          f"measured over {int(seen['steps'])} steps of each at equal batch sizes, predicted at {len(ticks)} ticks "
          f"of auto's run {args.run}")
    print("| part | measured | predicted (mean of ticks) | predicted / measured - 1 |")
    print("| --- | --- | --- | --- |")
    for part in ("tokens", "live", "step", "goodput"):
        mean = float(np.mean(ratios[part]))
        print(f"| {part} | {seen[part]:.4f} | {mean:.4f} | {mean / seen[part] - 1:+.2%} |")
    if args.drift:
        print(f"\nlive rows per request in {args.drift:g} s windows from 0 s to {hi:g} s, bs {args.bs}:")
        for name, run in ((kept_name, kept_run), (args.other_run, other_run)):
            cells = ", ".join("-" if v is None else f"{v:.3f}" for v in live_by_window(run, 0.0, hi, sizes, args.drift))
            print(f"- {name}: {cells}")


if __name__ == "__main__":
    main()
