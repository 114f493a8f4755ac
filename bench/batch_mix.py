"""Which requests fill the batch under each static rule (SYNTHETIC, the simulated engine).

A request stays in the batch until it has committed its output, so the requests that commit fewer
tokens per step make up more of the batch than of the arrivals, and a rule moves that mix: it
slows some requests more than others. The controller judges every rule on the rows of the batch
the rule in force made, so it cannot see such a move. The simulator gives each request a latent
logit shift (``request_spread``; arrivals have mean 0): this prints, per rule, the mean shift of
the requests running after each step, over the steps after a warm-up, the committed tokens per
request-step and the live rows per request, measured and as the controller would predict them
from the rows of the first rule's run (``CONTROLLER_RESULTS.md``, fifty-first round: checked as
a cause of the flat predicted top).

    python bench/batch_mix.py --rules conf0.2,conf0.3,off,k=1 --spread 0.5 --bs 60 --steps 12000
"""

import argparse

import numpy as np

from static_grid import D, GRID
from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import rule_at
from vcap.sidecar.controller.goodput import live_for_rules, running_product


def batch_mix(label: str, spread: float, bs: int, steps: int, warm_up: int, seed: int) -> dict:
    """One static rule at a steady load: the batch's mean logit shift, tokens per request-step,
    live rows per request, and the rows' draft confidences (``[rows, D]``)."""
    engine = SimulatedEngine(SimConfig(load="steady", mean_bs=bs, max_bs=max(256, bs), request_spread=spread,
                                       seed=seed))
    engine.set_policy(GRID[label])
    pool = engine.pools[0]
    shifts, tokens, live, confidence = [], 0, 0, []
    for step in range(steps):
        record = engine.step()[0]
        if step < warm_up:
            continue
        running = int(record["bs"])
        tokens += running + int(record["accepted"][:running].sum())   # one target token per request
        live += int(record["live"][:running].sum())
        confidence.append(np.array(record["confidence"][:running]))
        shifts.append(float(pool.logit_shift[:pool.num_running].mean()))
    rows = np.concatenate(confidence)
    return {"shift": float(np.mean(shifts)), "tokens": tokens / len(rows), "live": live / len(rows),
            "confidence": rows}


def judged_live(label: str, confidence: np.ndarray, bs: int) -> float:
    """The live rows per request rule ``label`` gives the rows ``confidence`` (recorded under
    another rule): what the controller predicts for it from those rows."""
    rule = rule_at(GRID[label], bs, D)
    return float(live_for_rules(running_product(confidence), [rule]).mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", default="conf0.2,conf0.3,off",
                        help="static rule labels (bench/static_grid.py); every rule is also judged on the first one's rows")
    parser.add_argument("--spread", default="0.5,0", help="request_spread values (the logit shift's sd)")
    parser.add_argument("--bs", type=int, default=60)
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--warm-up", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    labels = args.rules.split(",")
    print("| request spread | rule | mean logit shift of the requests in the batch | committed tokens per "
          f"request-step | live rows per request | the same, judged on {labels[0]}'s rows |")
    print("| --- | --- | --- | --- | --- | --- |")
    for spread in (float(value) for value in args.spread.split(",")):
        first = None
        for label in labels:
            mix = batch_mix(label, spread, args.bs, args.steps, args.warm_up, args.seed)
            first = mix["confidence"] if first is None else first
            print(f"| {spread:g} | {label} | {mix['shift']:+.3f} | {mix['tokens']:.3f} | {mix['live']:.3f} | "
                  f"{judged_live(label, first, args.bs):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
