"""How far ahead of the best fixed threshold any verify rule can be, on the loop's SYNTHETIC head
and the H200's measured step times: the bound behind issue 13's "ahead of SGLang's and vLLM's
rules where late drafts are rarely accepted".

Rows are drawn from the simulated engine's acceptance model with bench_loop.py's profiles
(SYNTHETIC: per-request logit shift, confidence = true conditional acceptance seen through
logit noise). A step's time is the loop's own measurement for that cell (``cost_points`` of a
loop result: the mean step time at fixed k = 1..5, i.e. at 2..6 rows per request, interpolated
linearly in live rows). Tokens are expectations under the true acceptance, so the comparison
has no sampling noise in acceptance. Every rule verifies at least one draft per request, as
vcap's hook does. Per cell, goodput (committed tokens per second) of:

- ``threshold``: the best rule of the family auto chooses from (a threshold on the running
  product of the raw confidence, with k bounds), searched on a fine grid;
- ``top-B raw``: per step, the budget B and the top-B drafts by the raw running product, B
  chosen on the step's raw survival as the expected tokens (what vLLM's and SGLang's rules do,
  here with the current step's confidence instead of the previous step's: idealised);
- ``top-B true``: per step the top-B drafts by the TRUE survival, the budgets chosen for the
  best goodput over the whole run: an upper bound on any rule that chooses per step which drafts
  to verify;
- ``threshold true``: a fixed threshold on the true survival.

    python bench/rule_bound.py --loop bench/runs/loop24.json,bench/runs/loop25.json,bench/runs/loop25b.json,bench/runs/loop26.json
"""

import argparse
import json
import sys

import numpy as np

from vcap.engine_hook.sim import SimConfig
from vcap.engine_hook.workload import AcceptanceModel
from vcap.policy import Bucket
from vcap.sidecar.controller.goodput import live_for_rules

# bench_loop.PROFILES (not imported: bench_loop needs torch)
PROFILES = {"high": dict(accept_first=0.92, accept_last=0.6), "steep": dict(accept_first=0.75, accept_last=0.05)}
D = 5
THRESHOLDS = np.concatenate([np.linspace(0.005, 0.1, 20), np.linspace(0.11, 0.95, 85)])


def draw(profile: str, bs: int, steps: int, seed: int, conf_bias: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``[steps, bs, D]`` raw running product and true survival, SYNTHETIC."""
    config = SimConfig(conf_bias=conf_bias)
    model = AcceptanceModel(D, PROFILES[profile]["accept_first"], PROFILES[profile]["accept_last"],
                            config.conf_scale, config.conf_bias, config.conf_noise)
    rng = np.random.default_rng(seed)
    shift = rng.normal(0.0, config.request_spread, steps * bs)
    true = model.true_accept(shift)
    confidence = model.confidence(true, rng).astype(np.float64)
    shape = (steps, bs, D)
    return np.cumprod(confidence, axis=1).reshape(shape), np.cumprod(true, axis=1).reshape(shape)


def step_cost(cost_points: list):
    """Step seconds at any live row count, linear between the measured fixed-k steps."""
    rows, seconds = np.asarray(cost_points, dtype=np.float64).T
    return lambda live_rows: np.interp(live_rows, rows, seconds)


def threshold_best(score: np.ndarray, survival: np.ndarray, cost) -> tuple[float, str]:
    """Best goodput over the fixed k and the thresholds on ``score`` with k bounds (live lengths
    as the engine computes them: ``live_for_rules``); its rule."""
    steps, bs, _ = score.shape
    expected = np.concatenate([np.zeros((steps, bs, 1)), np.cumsum(survival, axis=2)], axis=2)  # by k
    bounds = [(k_min, k_max) for k_min in range(1, D + 1) for k_max in range(k_min, D + 1)]
    groups = [[Bucket(1, k, k, (0.0,) * D) for k in range(1, D + 1)]]
    groups += [[Bucket(1, k_min, k_max, (float(t),) * D) for k_min, k_max in bounds] for t in THRESHOLDS]
    best = (0.0, "")
    for rules in groups:   # one threshold at a time: [rows, rules] stays small
        k = (live_for_rules(score.reshape(-1, D), rules) - 1).reshape(steps, bs, len(rules))
        tokens = bs * steps + np.take_along_axis(expected, k, axis=2).sum(axis=(0, 1))
        seconds = cost(k.sum(axis=1) + bs).sum(axis=0)
        for rule, goodput in zip(rules, tokens / seconds):
            label = f"k={rule.k_max}" if rule.thresholds[0] == 0.0 else \
                f"{rule.thresholds[0]:.3f}:{rule.k_min}-{rule.k_max}"
            best = max(best, (float(goodput), label))
    return best


def top_budget(score: np.ndarray, estimate: np.ndarray, survival: np.ndarray, cost, pooled: bool = False) -> float:
    """Per step a budget of extra drafts (beyond one per request), given to the drafts of highest
    ``score``; goodput in true tokens. The budget maximises the step's ``estimate``d tokens per
    second (vLLM's and SGLang's choice), or with ``pooled`` the whole run's: per step
    ``tokens - rate * seconds`` at the run's best rate (Dinkelbach's iteration), the best any
    per-step top-B can do."""
    steps, bs, _ = score.shape
    # drafts 2..D: the running product falls along a row, so the top B keep each row a prefix
    order = np.argsort(-score[:, :, 1:].reshape(steps, -1), axis=1, kind="stable")
    gained = np.cumsum(np.take_along_axis(estimate[:, :, 1:].reshape(steps, -1), order, axis=1), axis=1)
    true_gained = np.cumsum(np.take_along_axis(survival[:, :, 1:].reshape(steps, -1), order, axis=1), axis=1)
    zero = np.zeros((steps, 1))
    estimated = bs + estimate[:, :, 0].sum(axis=1, keepdims=True) + np.concatenate([zero, gained], axis=1)
    true = bs + survival[:, :, 0].sum(axis=1, keepdims=True) + np.concatenate([zero, true_gained], axis=1)
    seconds = cost(2 * bs + np.arange(bs * (D - 1) + 1))[None, :]

    def run(budget: np.ndarray) -> float:
        rows = np.arange(steps)
        return true[rows, budget].sum() / seconds[0, budget].sum()

    if not pooled:
        return run(np.argmax(estimated / seconds, axis=1))
    rate = run(np.argmax(estimated / seconds, axis=1))
    for _ in range(50):
        better = run(np.argmax(estimated - rate * seconds, axis=1))
        if better <= rate * (1 + 1e-12):
            break
        rate = better
    return rate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", required=True, help="loop result files (json), comma separated; the newest cell wins")
    parser.add_argument("--rows", type=int, default=60_000, help="SYNTHETIC request rows per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conf-bias", type=float, default=0.0,
                        help="the head's logit bias (the loop's: 0; > 0 over-confident)")
    parser.add_argument("--profiles", default="steep,high")
    args = parser.parse_args(argv)
    cells = {}
    for path in args.loop.split(","):
        for cell in json.load(open(path))["cells"]:
            if cell["profile"] in args.profiles.split(","):
                cells[(cell["bs"], cell["routing"], cell["profile"])] = cell["cost_points"]
    print("| bs | routing | accept | best threshold rule | top-B raw / threshold | top-B true / threshold "
          "| threshold true / threshold |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (bs, routing, profile), points in sorted(cells.items(), key=lambda c: (c[0][2], -c[0][0], c[0][1])):
        cost = step_cost(points)
        raw, true = draw(profile, bs, max(args.rows // bs, 200), args.seed, args.conf_bias)
        best, label = threshold_best(raw, true, cost)
        topb_raw = top_budget(raw, raw, true, cost)
        topb_true = top_budget(true, true, true, cost, pooled=True)
        true_threshold, _ = threshold_best(true, true, cost)
        print(f"| {bs} | {routing} | {profile} | {label} | {topb_raw / best:.4f} | {topb_true / best:.4f} "
              f"| {true_threshold / best:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
