"""How often auto mode's test of acceptance (``EngineModel.acceptance_moved``) and its hold fire at
a steady load, and what they cost there: the share of time the busy buckets are judged on their
recent rows, the policy writes per hour and the goodput after the first minute.

SYNTHETIC: the simulated engine (pure-trace mode, engine time) with drawn41-2-accept's knobs
(bench/eval_controller.py, draw seed 41) and no change of acceptance; ``--mean-bs`` sets the load.
``--variant off`` patches the test off (the code before de65ef7); ``--variant zX`` runs it with
``moved_acceptance_z = X``; ``--variant on`` is the default configuration.

    python bench/steady_hold.py --seconds 1800 --seed 1 --variant on
"""

import argparse
import time

import numpy as np

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.sidecar.controller import AutoController, ControllerConfig
from vcap.sidecar.controller.model import EngineModel
from vcap.sidecar.policy_control import PolicyControl
from vcap.sidecar.telemetry import unpack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1800.0, help="engine time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mean-bs", type=int, default=3)
    parser.add_argument("--variant", default="on", help="on, off, or zX (moved_acceptance_z = X)")
    args = parser.parse_args()
    settings = {}
    if args.variant == "off":
        EngineModel.acceptance_moved = lambda self, live, accepted, time_ns: False
    elif args.variant.startswith("z"):
        settings["moved_acceptance_z"] = float(args.variant[1:])
    config = SimConfig(max_bs=256, mean_bs=args.mean_bs, accept_first=0.866, accept_last=0.712, router_skew=1.408,
                       moe_a_us=19.83, moe_b_us=8.28, other_ms=1.75, mean_output_tokens=891.0,
                       paired_requests=True, seed=args.seed, conf_scale=1.096, conf_bias=-0.178, conf_noise=0.81)
    engine = SimulatedEngine(config)
    control = PolicyControl("steady-hold")
    control.set_control_mode("auto")
    controller = AutoController(control, ControllerConfig(**settings), engine_config=config.segment_config)
    generation, writes, next_tick, held, tokens = control.generation, [], 0.5, [], []
    started = time.time()
    while engine.engine_time_ns < args.seconds * 1e9:
        batch = unpack(engine.step())
        now = engine.engine_time_ns / 1e9
        tokens.append((now, float((batch.accepted * batch.real).sum() + batch.bs.sum())))
        controller.observe(0, batch)
        if now >= next_tick:   # the sidecar's tick, every 0.5 s
            controller.tick(now)
            next_tick = now + 0.5
            if controller.model is not None and now >= len(held):   # once a second
                held.append(controller.readings().acceptance_moved)
            if control.generation != generation:
                generation = control.generation
                engine.set_policy(control.policy, generation, "auto")
                writes.append(round(now, 1))
    t = np.array(tokens)
    after = t[:, 0] >= 60
    late = sum(w >= 60 for w in writes)
    print(f"bs {args.mean_bs} seed {args.seed} {args.variant}: goodput after 60 s "
          f"{t[after, 1].sum() / (t[after, 0][-1] - 60):.2f} tok/s; writes {len(writes)}, after 60 s {late} = "
          f"{late / (args.seconds - 60) * 3600:.1f}/h; held {np.mean(held):.1%}; wall {time.time() - started:.0f} s; "
          f"writes at {writes}", flush=True)


if __name__ == "__main__":
    main()
