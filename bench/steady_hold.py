"""How often auto mode's test of acceptance (``EngineModel.acceptance_moved``) and its hold fire at
a steady load, and what they cost there: the share of ticks after which the busy buckets are
judged on their recent rows, the policy writes per hour and the goodput after the first minute.

SYNTHETIC: ``eval_controller.run_trace`` (the simulated engine, pure-trace mode, engine time) on
drawn41-2-accept (draw seed 41) without its change of acceptance; ``--mean-bs`` sets the load,
``--trace SEED:NAME`` another drawn trace's knobs (``59:drawn59-5-accept``: a rule of k=1 at bs 3).
``--variant off`` patches the test off (the code before de65ef7); ``--variant chunks`` judges it on
the chunks' standard error alone (without ``SteadySpread``, the code before the forty-first round);
``--variant zX`` runs it with ``moved_acceptance_z = X``; ``--variant on`` is the default configuration.

    python bench/steady_hold.py --seconds 1800 --seed 1 --variant on

``--fall-at S`` keeps drawn41-2-accept's fall of acceptance, at S s of engine time: how soon the
hold comes on after it, and the goodput and writes after it, once the steady spread is learned.

    python bench/steady_hold.py --seconds 330 --fall-at 240 --seed 1 --variant on
"""

import argparse
import time

import eval_controller
from vcap.sidecar.controller.model import EngineModel, SteadySpread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1800.0, help="engine time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mean-bs", type=int, default=3)
    parser.add_argument("--trace", default="41:drawn41-2-accept", metavar="SEED:NAME",
                        help="the drawn trace whose knobs run (draw seed, name)")
    parser.add_argument("--variant", default="on", help="on, off, chunks, or zX (moved_acceptance_z = X)")
    parser.add_argument("--fall-at", type=float, default=None, metavar="S",
                        help="keep the trace's fall of acceptance, at S s of engine time")
    args = parser.parse_args()
    if args.variant == "off":
        EngineModel.acceptance_moved = lambda self, difference, se, bs: False
    elif args.variant == "chunks":
        SteadySpread.sd = lambda self, bs: 0.0
    elif args.variant.startswith("z"):
        eval_controller.CONTROLLER_FIELDS = f"moved_acceptance_z:{args.variant[1:]}"
    draw_seed, name = args.trace.split(":")
    params = dict(eval_controller.drawn_traces(9, int(draw_seed))[name], mean_bs=args.mean_bs, seconds=args.seconds)
    if args.fall_at is None:
        for key in ("accept_change_s", "accept_first_after", "accept_last_after"):
            del params[key]
    else:
        params["accept_change_s"] = args.fall_at
    started = time.time()
    run = eval_controller.run_trace(params, None, args.seed)
    second = run["second"]
    goodput = sum(second["tokens"][60:]) / sum(second["ns"][60:]) * 1e9
    writes = [t for t, _ in run["writes"]]
    late = sum(t >= 60 for t in writes)
    print(f"{name} bs {args.mean_bs} seed {args.seed} {args.variant}: goodput after 60 s {goodput:.2f} tok/s; "
          f"writes {len(writes)}, after 60 s {late} = {late / (args.seconds - 60) * 3600:.1f}/h; "
          f"held {run['held_share']:.1%}; changes of acceptance forgotten {run['acceptance_changes']}; wall {time.time() - started:.0f} s; writes at {writes}", flush=True)
    if args.fall_at is not None:
        fall = int(args.fall_at)
        after = [hold for hold in run["held"] if hold[0] >= args.fall_at]
        windows = [(fall, fall + 30), (fall + 30, int(args.seconds))]
        rates = [sum(second["tokens"][a:b]) / sum(second["ns"][a:b]) * 1e9 for a, b in windows]
        print(f"  fall at {args.fall_at:g} s: first hold after it {after[0] if after else None}; goodput "
              + ", ".join(f"[{a}, {b}) s {rate:.2f}" for (a, b), rate in zip(windows, rates))
              + f" tok/s; writes after it {[t for t in writes if t >= args.fall_at]}", flush=True)


if __name__ == "__main__":
    main()
