"""One per-bucket policy run as a static rule on an eval_controller trace (SYNTHETIC simulated
engine, modelled step times), over several seeds: what its exploration costs, and how it
compares with a grid rule in 5 s windows.

    python bench/static_policy.py TRACE "1:0.16:1-2 8:0.4:1-3 64:0.2:1-3 explore/128" [--seeds 1,2,3]
        [--compare conf0.3k3] [--seconds 40]

The policy is written as ``eval_controller.py`` logs auto's writes (``MIN_BS:THRESHOLD:KMIN-KMAX``
per bucket, then ``explore/N``). Each seed runs it with exploration and without (``explore/0``):
their ratio is what exploration costs on this trace, against the target the controller chose its
period for (``--explore-cost-target``). ``--compare LABEL`` also runs a rule of the static grid
and prints both runs' goodput per 5 s window (bench/CONTROLLER_RESULTS.md, eleventh round).
"""

import argparse
import dataclasses
import sys

import numpy as np

import eval_controller as ev


def _windows(result: dict, seconds: float) -> list[float]:
    return [ev._window(result, start, start + 5)[0] for start in range(0, int(seconds) - 4, 5)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", choices=sorted(ev.TRACES))
    parser.add_argument("policy", help="as eval_controller.py logs it: '1:0.16:1-2 8:0.4:1-3 explore/128'")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--compare", default=None, choices=sorted(ev.STATIC), help="a static grid rule")
    parser.add_argument("--seconds", type=float, default=None, help="shorten the trace")
    args = parser.parse_args(argv)
    policy = ev.policy_of_description(args.policy)
    params = dict(ev.TRACES[args.trace])
    if args.seconds:
        params["seconds"] = args.seconds
    seconds = params["seconds"]
    costs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        explored = ev.run_trace(params, policy, seed)
        unexplored = ev.run_trace(params, dataclasses.replace(policy, explore_period=0), seed)
        costs.append(1 - explored["goodput"] / unexplored["goodput"])
        print(f"seed {seed}: {explored['goodput']:.1f} tok/s, {unexplored['goodput']:.1f} without exploration: "
              f"exploration costs {costs[-1]:+.2%}", flush=True)
        if args.compare:
            other = ev.run_trace(params, ev.STATIC[args.compare], seed)
            print(f"  5 s windows from 0 s, policy : {' '.join(f'{g:.0f}' for g in _windows(explored, seconds))}")
            print(f"  5 s windows from 0 s, {args.compare}: {' '.join(f'{g:.0f}' for g in _windows(other, seconds))}")
            print(f"  whole trace: policy / {args.compare} = {explored['goodput'] / other['goodput']:.4f}")
    print(f"{args.trace}: exploration (period {policy.explore_period}) costs {np.mean(costs):+.2%} on average "
          f"over {len(costs)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
