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

With ``--explore P`` every rule verifies every row one step in P (the steps are left out of the
measured columns), the first rule's run teaches a calibration as the controller's does, and each
rule's committed tokens are also judged on the first rule's rows through it; ``--drawn NAME``
takes a drawn trace's acceptance, confidence and output length (``eval_controller.drawn_traces``,
``--draw-seed``; fifty-second round):

    python bench/batch_mix.py --drawn drawn47-4-shift --draw-seed 47 --rules conf0.2,conf0.1,conf0.05 \
        --spread 0.5 --bs 152 --steps 3000 --warm-up 800 --explore 64
"""

import argparse
import dataclasses

import numpy as np

from eval_controller import drawn_traces
from static_grid import D, GRID
from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.policy import rule_at
from vcap.ring import FLAG_EXPLORE
from vcap.sidecar.controller import ControllerConfig
from vcap.sidecar.controller.calibration import AcceptanceCalibration
from vcap.sidecar.controller.goodput import evaluate_rules, live_for_rules, running_product

# the knobs of a drawn trace that make its requests (not its load or step costs)
REQUEST_KNOBS = ("accept_first", "accept_last", "conf_noise", "conf_bias", "conf_scale", "mean_output_tokens")


def batch_mix(label: str, spread: float, bs: int, steps: int, warm_up: int, seed: int, knobs: dict | None = None,
              explore: int = 0) -> dict:
    """One static rule at a steady load: the batch's mean logit shift, tokens per request-step,
    live rows per request, the rows (confidences ``[rows, D]``, live lengths, accepted drafts;
    exploration steps too, which the measured figures leave out) and the calibration they teach.
    ``knobs``: :class:`SimConfig` fields of the requests; ``explore``: one step in this many
    verifies every row."""
    engine = SimulatedEngine(SimConfig(load="steady", mean_bs=bs, max_bs=max(256, bs), request_spread=spread,
                                       seed=seed, **(knobs or {})))
    engine.set_policy(dataclasses.replace(GRID[label], explore_period=explore))
    calibration = AcceptanceCalibration(D, half_life_rows=ControllerConfig().calibration_half_life_rows)
    pool = engine.pools[0]
    shifts, tokens, live, counted, rows = [], 0, 0, 0, []
    for step in range(steps):
        record = engine.step()[0]
        running = int(record["bs"])
        confidence = np.array(record["confidence"][:running])
        lengths, accepted = np.array(record["live"][:running]), np.array(record["accepted"][:running])
        calibration.update(confidence, lengths, accepted)
        if step < warm_up:
            continue
        rows.append((confidence, lengths, accepted))
        if int(record["flags"]) & FLAG_EXPLORE:
            continue
        tokens += running + int(accepted.sum())   # one target token per request
        live += int(lengths.sum())
        counted += running
        shifts.append(float(pool.logit_shift[:pool.num_running].mean()))
    confidence, lengths, accepted = (np.concatenate(part) for part in zip(*rows))
    return {"shift": float(np.mean(shifts)), "tokens": tokens / counted, "live": live / counted,
            "confidence": confidence, "live_rows": lengths, "accepted": accepted, "calibration": calibration}


def judged_live(label: str, confidence: np.ndarray, bs: int) -> float:
    """The live rows per request rule ``label`` gives the rows ``confidence`` (recorded under
    another rule): what the controller predicts for it from those rows."""
    rule = rule_at(GRID[label], bs, D)
    return float(live_for_rules(running_product(confidence), [rule]).mean())


def judged_tokens(label: str, mix: dict, bs: int) -> float:
    """The committed tokens per request-step the controller predicts for rule ``label`` from the
    rows of another rule's run (``mix``, :func:`batch_mix`) and the calibration they taught."""
    rule = rule_at(GRID[label], bs, D)
    return float(evaluate_rules(mix["confidence"], mix["live_rows"], mix["accepted"], mix["calibration"],
                                [rule]).tokens[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", default="conf0.2,conf0.3,off",
                        help="static rule labels (bench/static_grid.py); every rule is also judged on the first one's rows")
    parser.add_argument("--spread", default="0.5,0", help="request_spread values (the logit shift's sd)")
    parser.add_argument("--bs", type=int, default=60)
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--warm-up", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--explore", type=int, default=0,
                        help="one step in this many verifies every row; also judges tokens on the first rule's rows")
    parser.add_argument("--drawn", default="", help="a drawn trace whose request knobs to take (e.g. drawn47-4-shift)")
    parser.add_argument("--draw-seed", type=int, default=1)
    args = parser.parse_args(argv)
    labels = args.rules.split(",")
    knobs = {}
    if args.drawn:
        count = int(args.drawn.split("-")[1]) + 1
        knobs = {k: v for k, v in drawn_traces(count, args.draw_seed)[args.drawn].items() if k in REQUEST_KNOBS}
    judged = f" | tokens judged on {labels[0]}'s rows" if args.explore else ""
    print("| request spread | rule | mean logit shift of the requests in the batch | committed tokens per "
          f"request-step | live rows per request | the same, judged on {labels[0]}'s rows{judged} |")
    print("| --- | --- | --- | --- | --- | --- |" + (" --- |" if args.explore else ""))
    for spread in (float(value) for value in args.spread.split(",")):
        first = None
        for label in labels:
            mix = batch_mix(label, spread, args.bs, args.steps, args.warm_up, args.seed, knobs, args.explore)
            first = mix if first is None else first
            tokens = f" | {judged_tokens(label, first, args.bs):.4f}" if args.explore else ""
            print(f"| {spread:g} | {label} | {mix['shift']:+.3f} | {mix['tokens']:.4f} | {mix['live']:.4f} | "
                  f"{judged_live(label, first['confidence'], args.bs):.4f}{tokens} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
