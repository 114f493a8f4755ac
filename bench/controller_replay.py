"""Capture what the auto controller is fed on a trace, and replay it into a fresh controller.

The controller is deterministic given its inputs (the records it observes and the times it
ticks), so a run on the GPU engine can be captured there and replayed here on the CPU: the
replay makes the same writes, and its model (cost fit, expert curve, measured step times) can be
inspected at any tick. A controller changed here replays the same inputs until its first write
that differs (after that the engine would have run another policy). The twentieth round of
``bench/CONTROLLER_RESULTS.md`` found its cost-fit defect this way.

    # on the device (results under $OUT): every trace NAME:SEED given
    python bench/controller_replay.py capture --device cuda --out $OUT shift-128-8-skew1.5:1
    # here
    python bench/controller_replay.py replay cap_shift-128-8-skew1.5_1.pkl.xz --until 52
    # with a field changed from the captured configuration; prints the ticks' wall time too
    python bench/controller_replay.py replay cap_shift-128-8-skew1.5_1.pkl.xz --controller settled_share:0
    # the model at a tick: every candidate rule's tokens and step time at one batch size, judged on
    # the whole window, on its rows of the last 20 s, and on the rows the decision judges bs 8 on
    python bench/controller_replay.py inspect cap_shift-128-8-skew1.5_1.pkl.xz --at 74 --bs 8 --recent-s 20

A capture keeps the configuration it ran with; a field added to ``ControllerConfig`` since then
replays at its default.
"""

import argparse
import dataclasses
import lzma
import os
import pickle
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eval_controller as ev  # noqa: E402
from vcap.sidecar.controller import AutoController, ControllerConfig  # noqa: E402
from vcap.sidecar.controller.goodput import evaluate_rules  # noqa: E402
from vcap.sidecar.policy_control import PolicyControl  # noqa: E402


def capture(params: dict, seed: int, loop=None) -> dict:
    """Run auto on one trace; returns ``{"events": [...], "result": run_trace's result}`` with
    events ``("init", config, engine geometry)``, ``("observe", rank, records)``, ``("tick", now)``."""
    events = []
    init, observe, tick = AutoController.__init__, AutoController.observe, AutoController.tick

    def capturing_init(self, control, config=None, engine_config=lambda: None):
        events.append(("init", config, engine_config()))
        init(self, control, config, engine_config)

    def capturing_observe(self, rank, records):
        events.append(("observe", rank, records))
        return observe(self, rank, records)

    def capturing_tick(self, now):
        events.append(("tick", now))
        return tick(self, now)

    with mock.patch.multiple(AutoController, __init__=capturing_init, observe=capturing_observe,
                             tick=capturing_tick):
        result = ev.run_trace(params, None, seed=seed, loop=loop)
    return {"events": events, "result": result}


def replay(captured: dict, config=None, until: float | None = None, tick_seconds: list | None = None):
    """Feed ``captured`` into a fresh controller (its captured config, or ``config``) up to the tick
    at ``until`` s; returns the controller and its writes as ``(time, description)``. Each tick's
    wall time is appended to ``tick_seconds`` where given."""
    events = captured["events"]
    _, captured_config, geometry = events[0]
    control = PolicyControl("replay")
    control.set_control_mode("auto")
    controller = AutoController(control, config or current_config(captured_config), engine_config=lambda: geometry)
    writes, generation = [], control.generation
    for event in events[1:]:
        if event[0] == "observe":
            controller.observe(event[1], event[2])
            continue
        if until is not None and event[1] > until:
            break
        before = controller.readings().tick_seconds_total
        controller.tick(event[1])
        if tick_seconds is not None:
            tick_seconds.append(controller.readings().tick_seconds_total - before)
        if control.generation != generation:
            generation = control.generation
            writes.append((round(event[1], 2), ev._describe(control.policy)))
    return controller, writes


def current_config(captured_config) -> ControllerConfig:
    """The captured configuration as today's class: a field added since the capture takes its default."""
    names = [field.name for field in dataclasses.fields(ControllerConfig)]
    return ControllerConfig(**{name: getattr(captured_config, name) for name in names
                               if hasattr(captured_config, name)})


def judge(controller, bs: int, recent_s: float | None = None, as_decided: bool = False) -> list[dict]:
    """Every candidate rule as the controller's model sees it at batch size ``bs``: live rows and
    committed tokens per request on the window (only its rows of the last ``recent_s`` seconds,
    when given; with ``as_decided``, the rows the decision judges ``bs``'s bucket on,
    ``EngineModel.evaluate_buckets``), predicted step time (the cost fit, no measured
    correction) and goodput. ``rows``: the window's rows judged on (None with ``as_decided``)."""
    model = controller.model
    if as_decided:
        bucket = int(model.step_times.bucket_of(bs))
        evaluation, rows = model.evaluate_buckets(model.rules, model.bucket_loads())[bucket], None
    elif recent_s is None:
        evaluation, rows = model.evaluate(model.rules), len(model.window_rows()[1])
    else:
        confidence, live, accepted, time_ns, _ = model.window_rows()
        recent = time_ns >= model.now_ns - recent_s * 1e9
        evaluation = evaluate_rules(confidence[recent], live[recent], accepted[recent], model.calibration, model.rules)
        rows = int(recent.sum())
    step_ns = evaluation.step_time_ns(bs, model.curve, model.cost)
    return [dict(rule=f"{r.thresholds[0]:g}:{r.k_min}-{r.k_max}", rows=rows, live=float(evaluation.mean_live[i]),
                 tokens=float(evaluation.tokens[i]), step_ns=float(step_ns[i]),
                 goodput=float(bs * evaluation.tokens[i] / step_ns[i] * 1e9))
            for i, r in enumerate(model.rules)]


def save(captured: dict, path: str) -> None:
    with lzma.open(path, "wb", preset=1) as f:
        pickle.dump(captured, f)


def load(path: str) -> dict:
    """A capture written by :func:`save` (pickle: open only files you made)."""
    with lzma.open(path, "rb") as f:
        return pickle.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("capture", help="run auto on traces NAME:SEED and save what it was fed")
    run.add_argument("traces", nargs="+", metavar="NAME:SEED")
    run.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    run.add_argument("--out", default=".")
    again = verbs.add_parser("replay", help="replay a capture; print its writes and the cost fit")
    again.add_argument("path")
    again.add_argument("--until", type=float, default=None, help="stop after the tick at this time (s)")
    again.add_argument("--controller", default="", metavar="FIELD:VALUE,...",
                       help="replay with these ControllerConfig fields changed from the captured ones")
    look = verbs.add_parser("inspect", help="replay a capture to a tick; print the model's view of every rule")
    look.add_argument("path")
    look.add_argument("--at", type=float, required=True, help="the tick (s of engine time)")
    look.add_argument("--bs", type=int, required=True, help="the batch size to judge the rules at")
    look.add_argument("--recent-s", type=float, default=None, help="also judge on the window's last N s alone")
    look.add_argument("--top", type=int, default=12, help="rules to print, best first")
    args = parser.parse_args(argv)
    if args.verb == "capture":
        loop = None
        if args.device == "cuda":
            import bench_loop
            loop = bench_loop.Loop(argparse.Namespace(preset="v4.1", run_layers=2, other_ms=2.0, max_bs=256))
        for spec in args.traces:
            name, _, seed = spec.partition(":")
            captured = capture(ev.TRACES[name], int(seed or 1), loop)
            path = os.path.join(args.out, f"cap_{name}_{seed or 1}.pkl.xz")
            save(captured, path)
            print(f"{path}: goodput {captured['result']['goodput']:.1f}, {len(captured['result']['writes'])} writes")
        if loop is not None:
            loop.close()
        return 0
    captured = load(args.path)
    if args.verb == "inspect":
        controller, _ = replay(captured, until=args.at)
        views = [("window", judge(controller, args.bs))]
        if args.recent_s is not None:
            views.append((f"last {args.recent_s:g} s", judge(controller, args.bs, args.recent_s)))
        views.append(("as the decision judges the bucket", judge(controller, args.bs, as_decided=True)))
        for name, rules in views:
            best = max(rule["goodput"] for rule in rules)
            rows = "" if rules[0]["rows"] is None else f" ({rules[0]['rows']} rows)"
            print(f"{name}{rows}, bs {args.bs}: rule, live rows and committed tokens per "
                  f"request, step ms, goodput over the best")
            for rule in sorted(rules, key=lambda r: -r["goodput"])[:args.top]:
                print(f"  {rule['rule']:>10} L {rule['live']:.2f} tokens {rule['tokens']:.3f} "
                      f"step {rule['step_ns'] / 1e6:.3f} ms {rule['goodput'] / best:.4f}")
        return 0
    try:
        config = ev.controller_config(args.controller, base=current_config(captured["events"][0][1]))
    except (AttributeError, TypeError, ValueError) as e:
        parser.error(f"--controller {args.controller!r}: {e}")
    ticks = []
    controller, writes = replay(captured, config, until=args.until, tick_seconds=ticks)
    for write in writes:
        print(*write)
    if args.until is None:
        print("same writes as the captured run:", writes == [tuple(w) for w in captured["result"]["writes"]])
    if ticks:
        print(f"{len(ticks)} ticks, wall time {sum(ticks):.2f} s: mean {1e3 * sum(ticks) / len(ticks):.1f} ms, "
              f"largest {1e3 * max(ticks):.1f} ms")
    cost = controller.model.cost if controller.model else None
    if cost is not None:
        print(f"cost fit: alpha {cost.alpha:.0f} ns, beta {cost.beta:.0f} ns per expert, delta {cost.delta:.0f} ns "
              f"per live row, gamma {cost.gamma:.0f} ns per request; R^2 {cost.r2:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
