"""``vcap``: the engine-side command line. ``vcap selftest`` checks the hook on this machine."""

import argparse
import os
import sys

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vcap", description="vcap engine hook tools")
    sub = parser.add_subparsers(dest="command", required=True)
    selftest = sub.add_parser("selftest", help="replay the hook's kernels against the reference rule")
    selftest.add_argument("--steps", type=int, default=None, help="checked steps (default 3000 on a GPU, 6 on CPU)")
    selftest.add_argument("--max-bs", type=int, default=None)
    selftest.add_argument("--layers", type=int, default=None)
    selftest.add_argument("--experts", type=int, default=None)
    selftest.add_argument("--strategy", choices=("drop", "anchor"), default="drop")
    args = parser.parse_args(argv)

    try:
        import torch
        cuda = torch.cuda.is_available()
        if not cuda:
            # Triton's interpreter must be chosen before Triton is imported (it reads the
            # variable then) and the kernels are defined
            os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton  # noqa: F401  (the hook's kernels)
    except ImportError as error:
        print(f"vcap selftest needs the engine extra ({error.name} is missing): pip install 'vcap[engine]' "
              "(from a clone: pip install -e '.[engine]'). Without a GPU, take PyTorch's CPU build first: "
              "pip install torch --index-url https://download.pytorch.org/whl/cpu", file=sys.stderr)
        return 2
    from .selftest import SelftestConfig, run_selftest
    if cuda:
        defaults = dict(steps=3000, max_bs=16, layers=3, experts=384, groups=(8, 4))
    else:
        print("no CUDA: running the same checks under Triton's interpreter, eagerly (no CUDA graph, "
              "no timing)", flush=True)
        defaults = dict(steps=6, max_bs=4, layers=2, experts=64, groups=(4, 2))
    experts = args.experts or defaults["experts"]
    groups = defaults["groups"] if experts % defaults["groups"][0] == 0 else (1, 1)
    config = SelftestConfig(steps=args.steps or defaults["steps"], max_bs=args.max_bs or defaults["max_bs"],
                            layers=args.layers or defaults["layers"], num_experts=experts,
                            num_expert_group=groups[0], topk_group=groups[1], strategy=args.strategy,
                            write_period_us=50.0 if cuda else 20000.0)
    report = run_selftest(config)
    if report["failures"]:
        print(f"FAILED: {len(report['failures'])} problem(s):")
        for failure in report["failures"]:
            print("  " + failure)
        return 1
    print(f"OK: {report['steps']} steps checked against the reference rule "
          f"({report['distinct_generations_used']} policy generations used, "
          f"{report['records_checked']} telemetry records checked)"
          + ("" if report["graph"] else " [CPU: interpreter, no CUDA graph]"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
