"""How far the window's counterfactual tokens are from the truth, per calibration binning.

SYNTHETIC rows from the simulated engine's acceptance model (``engine_hook/workload.py``: one
logit shift per request moves the acceptance of all its drafts and shows, with noise, in every
confidence). A rule in force caps them, one step in ``--explore`` verifies every row, and a
calibration learns from the capped rows as the controller's does. On the last window of rows,
each grid rule's committed tokens per request-step as :func:`evaluate_rules` predicts them are
compared with what the same rows commit under that rule, known here from the uncapped draws.

Binnings: ``running`` (the controller's: the running product of survival, which the rule cuts
on) and ``own`` (each draft's own confidence, the controller's binning before the twenty-second
round of ``bench/CONTROLLER_RESULTS.md``).

    python bench/calibration_bias.py --seeds 3
    python bench/calibration_bias.py --seeds 4 --steps 3000 --only 0.06:1-2,0.08:1-2   # more exploration data

After a forget (a restart of the calibration, every row verified for the first ``--restart-rows``
rows) at a small batch whose requests last (``--request-steps``: each request ends after a
geometric number of steps of this mean, so its rows are correlated as the engine's are):

    python bench/calibration_bias.py --only drawn47-8 --bs 4 --steps 840 --request-steps 300 --restart-rows 150 --seeds 12
"""

import argparse

import numpy as np

from vcap.engine_hook.workload import AcceptanceModel
from vcap.policy import Bucket
from vcap.sidecar.controller.calibration import AcceptanceCalibration, running_product, uniform_bins
from vcap.sidecar.controller.goodput import candidate_grid, evaluate_rules, live_for_rules

D = 5


class OwnConfidenceBins(AcceptanceCalibration):
    """The calibration binned by each draft's own confidence."""

    def bin_of(self, confidence):
        return uniform_bins(confidence[:, :self.num_drafts], self.num_bins)


BINNINGS = {"running": AcceptanceCalibration, "own": OwnConfidenceBins}


def rule(threshold: float, k_max: int) -> Bucket:
    return Bucket(1, 1, k_max, (threshold,) * D)


# (name, rule in force, acceptance model): the held-out traces' acceptance and confidence settings
SCENARIOS = [
    ("shift-4-96, 0.6:1-2", rule(0.6, 2), dict(accept=(0.8, 0.2), noise=0.8)),
    ("shift-4-96, 0.3:1-5", rule(0.3, 5), dict(accept=(0.8, 0.2), noise=0.8)),
    ("shift-4-96, 0.06:1-2", rule(0.06, 2), dict(accept=(0.8, 0.2), noise=0.8)),
    ("shift-128-8, 0.15:1-3", rule(0.15, 3), dict(accept=(0.8, 0.2), noise=0.5, bias=-0.5)),
    ("shift-128-8, 0.08:1-2", rule(0.08, 2), dict(accept=(0.8, 0.2), noise=0.5, bias=-0.5)),
    ("steep, 0.1:1-3", rule(0.1, 3), dict(accept=(0.75, 0.05), noise=0.5)),
    ("accept-fall after, 0.04:1-3", rule(0.04, 3), dict(accept=(0.6, 0.05), noise=0.5)),
    ("accept-fall before, 0.3:1-4", rule(0.3, 4), dict(accept=(0.9, 0.4), noise=0.5)),
    ("sat-bs200-attn, 0.2:1-3", rule(0.2, 3), dict(accept=(0.75, 0.15), noise=0.5, scale=0.7)),
    # drawn47-8-accept after its change: the rule its GPU runs kept after a forget
    ("drawn47-8-accept after, 0.7:1-3", rule(0.7, 3),
     dict(accept=(0.736, 0.394), noise=0.413, scale=1.004, bias=0.543)),
    # drawn97-2-accept (draw seed 97) after its rise: k=1 held at bs 10 (fifty-third round)
    ("drawn97-2-accept after, 0:1-1", rule(0.0, 1),
     dict(accept=(0.923, 0.529), noise=1.067, scale=1.15, bias=0.138)),
]


def errors(in_force: Bucket, accept, noise, scale=1.0, bias=0.0, spread=0.5, explore=128, bs=256,
           steps=600, window_rows=16384, seed=0, request_steps=0.0, restart_rows=0) -> dict:
    """Per binning: predicted over true committed tokens per request-step, minus 1, per grid rule.
    ``request_steps``: mean steps a request lasts (0: new requests every step); ``restart_rows``:
    every row verified until this many rows are in (the controller after a forget)."""
    rng = np.random.default_rng(seed)
    model = AcceptanceModel(D, accept[0], accept[1], scale, bias, noise)
    calibrations = {name: kind(D) for name, kind in BINNINGS.items()}
    window = []
    shift = np.zeros(bs)
    for step in range(steps):
        ended = rng.random(bs) < 1.0 / request_steps if request_steps and step else np.ones(bs, dtype=bool)
        shift[ended] = rng.normal(0.0, spread, int(ended.sum()))
        true_accept = model.true_accept(shift)
        confidence = model.confidence(true_accept, rng)
        uncapped = model.accepted_drafts(true_accept, rng)
        if step * bs < restart_rows or (explore and step % explore == 0):
            live = np.full(bs, D + 1)
        else:
            live = live_for_rules(running_product(confidence), [in_force])[:, 0]
        accepted = np.minimum(uncapped, live - 1)
        for calibration in calibrations.values():
            calibration.update(confidence, live, accepted)
        window.append((confidence, live, accepted, uncapped))
    confidence, live, accepted, uncapped = (np.concatenate(x) for x in zip(*window[-max(1, window_rows // bs):]))
    rules = candidate_grid(D)
    candidate_live = live_for_rules(running_product(confidence), rules)
    truth = (np.minimum(uncapped[:, None], candidate_live - 1) + 1).mean(axis=0)
    return {name: evaluate_rules(confidence, live, accepted, calibration, rules).tokens / truth - 1
            for name, calibration in calibrations.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--bs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--explore", type=int, default=128)
    parser.add_argument("--request-steps", type=float, default=0.0,
                        help="mean steps a request lasts (0: every step new requests)")
    parser.add_argument("--restart-rows", type=int, default=0,
                        help="every row verified for the first rows, as after a forget")
    parser.add_argument("--pair", default="", metavar="A,B",
                        help="also the error of rule A's predicted tokens relative to rule B's (e.g. 0.6:1-3,0.7:1-3)")
    parser.add_argument("--only", default="", help="scenarios whose name contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    wanted = [part for part in args.only.split(",") if part]
    names = [f"{r.thresholds[0]:g}:{r.k_min}-{r.k_max}" for r in candidate_grid(D)]
    pair = [names.index(name) for name in args.pair.split(",")] if args.pair else []
    worst = {name: [] for name in BINNINGS}
    print("| scenario (SYNTHETIC), rule in force | seed | " + " | ".join(
        f"{b}: largest error (rule), mean" + (f", {args.pair.replace(',', ' / ')}" if pair else "")
        for b in BINNINGS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in BINNINGS) + " |")
    for label, in_force, settings in SCENARIOS:
        if wanted and not any(part in label for part in wanted):
            continue
        for seed in range(args.seeds):
            found = errors(in_force, bs=args.bs, steps=args.steps, explore=args.explore, seed=seed,
                           request_steps=args.request_steps, restart_rows=args.restart_rows, **settings)
            cells = []
            for name, error in found.items():
                i = int(np.abs(error).argmax())
                worst[name].append(abs(error[i]))
                relative = f", {(1 + error[pair[0]]) / (1 + error[pair[1]]) - 1:+.2%}" if pair else ""
                cells.append(f"{error[i]:+.2%} ({names[i]}), {error.mean():+.2%}{relative}")
            print(f"| {label} | {seed} | " + " | ".join(cells) + " |", flush=True)
    for name, values in worst.items():
        print(f"{name}: largest |error| per run, mean {np.mean(values):.2%}, worst {np.max(values):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
