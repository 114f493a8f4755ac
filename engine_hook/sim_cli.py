"""``vcap-sim``: the simulated engine (:mod:`vcap.engine_hook.sim`) as a process. It creates the
segment, steps the engine at the modelled pace (or flat out), logs a status line now and then, and
unlinks the segment when signalled. Workload, acceptance, confidence, router and timings are
SYNTHETIC.

With ``--device cuda`` each verify step really runs on the GPU
(:class:`vcap.engine_hook.gpu_engine.GpuSimulatedEngine`: vcap's hook, the real router fed
SYNTHETIC routing logits, ``--run-layers`` MoE layers of ``--preset`` with SGLang's kernels, a CUDA
graph per batch size); ``--device cpu`` runs the same code eagerly (the hook's Triton kernels
under the interpreter, a plain-torch MoE; tiny dims by default), for tests. Either way the engine
reads its policy from the segment the sidecar writes, like the SGLang plugin, and the telemetry
records are the hook's own. ``--step-log`` writes, per step, the host clock (CLOCK_MONOTONIC)
before the step reads the policy and after its results are back on the host.

``--dp-size N`` runs N attention-DP ranks, as SGLang does under attention DP: each creates its
own segment (``SEGMENT`` for rank 0, ``SEGMENT-dp<r>`` for rank r), reads its own policy and
publishes its own records (its own SYNTHETIC requests, seed + r); they step in lock step.
"""

import argparse
import os
import signal
import sys
import time
from dataclasses import replace

import numpy as np

from vcap.policy import MODES
from vcap.layout import dp_segment_name
from vcap.segment import FLAG_FALLBACK, MODE_NAMES, SegmentError, segment_path

from .sim import SimConfig, SimulatedEngine, create_segment
from .workload import LOAD_PATTERNS

__all__ = ["main", "DEVICE_PRESETS"]

# engine_hook.gpu_engine.PRESETS (not imported here: torch loads only with --device)
DEVICE_PRESETS = ("tiny", "v4-flash", "v4-pro", "v4.1")
_DEVICE_FLAGS = {"device", "preset", "run_layers", "routing", "step_log"}


class _IntervalLog:
    """Totals between two log lines."""

    def __init__(self):
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.started, self.steps, self.bs, self.live_sum, self.requests = now, 0, 0, 0, 0
        self.tokens, self.experts_all, self.experts_live = 0, 0, 0

    def add(self, records: np.ndarray) -> None:
        self.steps += 1
        for record in records:
            bs = int(record["bs"])
            self.bs += bs
            self.requests += bs
            self.live_sum += int(record["live"][:bs].sum())
            self.tokens += int(record["accepted"][:bs].sum()) + bs
            self.experts_all += int(record["experts_all"].sum())
            self.experts_live += int(record["experts_live"].sum())

    def line(self, records: np.ndarray, now: float) -> str:
        steps = max(self.steps, 1)
        saved = 1 - self.experts_live / self.experts_all if self.experts_all else 0.0
        last = records[0]
        mode = MODE_NAMES.get(int(last["mode"]), "?")
        state = " FALLBACK" if int(last["flags"]) & FLAG_FALLBACK else ""
        return (f"steps/s {self.steps / max(now - self.started, 1e-9):.1f}  bs {self.bs / steps:.1f}  "
                f"generation {int(last['generation'])}  mode {mode}{state}  "
                f"mean L {self.live_sum / max(self.requests, 1):.2f}  tokens/step {self.tokens / steps:.1f}  "
                f"experts saved {100 * saved:.1f}%")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vcap-sim", description="Simulated engine for the vcap sidecar: creates the shared segment, "
        "follows its policy and publishes telemetry. Workload, acceptance, confidence, router and timings "
        "are SYNTHETIC.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = SimConfig()

    def setting(flag: str, name: str, help: str | None = None, **options) -> None:
        """A flag for a SimConfig setting: its default and type are the dataclass's."""
        default = getattr(defaults, name)
        if "choices" not in options:
            options["metavar"] = flag[2:].upper().replace("-", "_")
        p.add_argument(flag, dest=name, type=type(default), default=default, help=help, **options)

    p.add_argument("--segment", default="vcap-0", help="segment name in /dev/shm (or a path)")
    p.add_argument("--group", type=int, default=None, help="GID that may also open the segment (mode 0660)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="attention-DP ranks, each with its own segment (SEGMENT, SEGMENT-dp1, ...) and requests")
    p.add_argument("--dp-first-rank", type=int, default=0,
                   help="the first DP rank (a node of a multi-node engine): ranks R..R+N-1")
    p.add_argument("--steps", type=int, default=None, help="stop after N steps (default: run until signalled)")
    p.add_argument("--time-scale", type=float, default=1.0, help="sleep X times the modelled step time (0: flat out)")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between status lines (0: never)")
    setting("--stride", "stride", "verify rows per request: anchor + drafts")
    setting("--max-bs", "max_bs")
    setting("--layers", "num_moe_layers", "MoE layers")
    setting("--experts", "num_experts", "routed experts per layer")
    setting("--top-k", "top_k")
    setting("--expert-bytes", "expert_bytes", "bytes of one routed expert (MXFP4 V4.1-Flash, 18.8 MB per "
            "expert over TP4)")
    setting("--rings", "num_rings", "data-parallel groups, each with its own batch and ring")
    setting("--dispatch-row-bytes", "dispatch_row_bytes", "bytes one row sends in the MoE's all-to-all dispatch, "
            "stated in the segment's header (0: a TP MoE, no dispatch)")
    setting("--ring-slots", "ring_slots")
    setting("--lease-ms", "lease_ms")
    setting("--fallback-mode", "fallback_mode", choices=MODES)
    setting("--sample-period", "expert_sample_period", "count experts every N steps (0: never)")
    setting("--seed", "seed")
    setting("--load", "load", choices=LOAD_PATTERNS)
    setting("--mean-bs", "mean_bs", "base load (steady, shift, bursty, sine)")
    setting("--load-noise", "load_noise", "std of the log-normal load noise")
    setting("--shift-bs", "shift_bs")
    setting("--shift-after", "shift_after_s", "seconds of engine time before the shift")
    setting("--peak-bs", "peak_bs", "bursts (bursty) and crest (sine)")
    setting("--period", "period_s", "seconds of engine time (bursty, ramp, sine)")
    setting("--mean-output-tokens", "mean_output_tokens")
    setting("--accept-first", "accept_first", "conditional acceptance of draft 1")
    setting("--accept-last", "accept_last", "conditional acceptance of the last draft")
    setting("--request-spread", "request_spread", "std of a request's acceptance logit shift")
    setting("--conf-scale", "conf_scale")
    setting("--conf-bias", "conf_bias")
    setting("--conf-noise", "conf_noise")
    setting("--router-skew", "router_skew", "Zipf exponent of expert popularity (0: uniform)")
    setting("--moe-a-us", "moe_a_us", "MoE layer time: a + b * distinct experts")
    setting("--moe-b-us", "moe_b_us")
    setting("--other-ms", "other_ms", "rest of the step (attention etc.)")
    setting("--attention-us-per-request", "attention_us_per_request",
            "SYNTHETIC attention: step time per request in the batch (default 0)")
    real = p.add_argument_group(
        "verify steps run for real (--device)", "vcap's hook + router + MoE layers on a device; the segment's "
        "layers, experts and top-k are then --run-layers and the preset's (--layers/--experts/--top-k and "
        "the --moe-* timings are not used; --other-ms is the stated non-MoE part of a full-model step)")
    real.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="run each verify step on this device (cpu: the same code eagerly, tiny dims); "
                      "default: the modelled step time a + b * D")
    real.add_argument("--preset", choices=DEVICE_PRESETS, default=None,
                      help="MoE layer dimensions (default: v4.1 on cuda, tiny on cpu)")
    real.add_argument("--run-layers", type=int, default=2,
                      help="MoE layers run per step; the step time is scaled to the preset's layer count")
    real.add_argument("--routing", default=None, metavar="uniform|zipf:S",
                      help="SYNTHETIC routing logits (default: zipf:ROUTER_SKEW, uniform when it is 0)")
    p.add_argument("--step-log", default=None, metavar="PATH",
                   help="CSV per step: step, generation, host CLOCK_MONOTONIC ns before the step reads the "
                   "policy and after its results are on the host")
    return p


def _config_from_args(args: argparse.Namespace) -> SimConfig:
    run_options = {"segment", "group", "steps", "time_scale", "log_every", "dp_size", "dp_first_rank"} | _DEVICE_FLAGS
    settings = {name: value for name, value in vars(args).items() if name not in run_options}
    if args.device is not None:
        from .gpu_engine import PRESETS
        preset = PRESETS[_preset_name(args)]
        if args.run_layers < 1:
            raise ValueError(f"--run-layers must be >= 1, got {args.run_layers}")
        if settings["num_rings"] != 1 or args.dp_size != 1:
            raise ValueError("--device runs one ring (--rings 1) of one DP rank (--dp-size 1)")
        settings.update(num_moe_layers=args.run_layers, num_experts=preset.num_experts, top_k=preset.top_k)
    return SimConfig(**settings)


def _preset_name(args: argparse.Namespace) -> str:
    return args.preset or ("v4.1" if args.device == "cuda" else "tiny")


def _routing(args: argparse.Namespace, config: SimConfig) -> str:
    if args.routing is not None:
        return args.routing
    return "uniform" if config.router_skew == 0 else f"zipf:{config.router_skew:g}"


def _engine(args: argparse.Namespace, config: SimConfig, segment):
    """The modelled engine, or (``--device``) the GPU engine on the device."""
    if args.device is None:
        return SimulatedEngine(config, segment, clock_ns=time.monotonic_ns)
    from .gpu_engine import PRESETS, GpuSimulatedEngine, GpuStep
    step = GpuStep(segment, PRESETS[_preset_name(args)], run_layers=args.run_layers,
                   routing=_routing(args, config), other_ms=config.other_ms, device=args.device, seed=config.seed)
    return GpuSimulatedEngine(config, segment, step)


class _DataParallel:
    """The engines of every attention-DP rank, stepped in lock step (what vcap-sim's loop reads
    of one engine: ``step()``, ``steps``, ``last_step_ns``)."""

    def __init__(self, engines: list):
        self.engines = engines

    @property
    def steps(self) -> int:
        return self.engines[0].steps

    @property
    def last_step_ns(self) -> int:
        return max(engine.last_step_ns for engine in self.engines)

    def step(self) -> np.ndarray:
        return np.concatenate([engine.step() for engine in self.engines])


class _StepLog:
    """``--step-log``: one CSV line per step, written in blocks."""

    def __init__(self, path: str | None):
        self.file = open(path, "w") if path else None
        self.lines: list[str] = []
        if self.file:
            self.file.write("step,generation,read_ns,done_ns\n")

    def add(self, step: int, generation: int, read_ns: int, done_ns: int) -> None:
        if self.file:
            self.lines.append(f"{step},{generation},{read_ns},{done_ns}\n")
            if len(self.lines) >= 256:
                self.flush()

    def flush(self) -> None:
        if self.file:
            self.file.writelines(self.lines)
            self.file.flush()
            self.lines.clear()

    def close(self) -> None:
        if self.file:
            self.flush()
            self.file.close()


def _sleep_unless(stop: list, seconds: float) -> None:
    # short naps so a signal ends the run within one of them
    deadline = time.monotonic() + seconds
    while not stop and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # the hook's Triton kernels run on CPU tensors only under the interpreter, chosen before
        # triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        config = _config_from_args(args)
        if args.routing is not None and args.routing != "uniform" and not args.routing.startswith("zipf:"):
            raise ValueError(f"--routing must be uniform or zipf:S, got {args.routing!r}")
        if args.time_scale < 0 or args.log_every < 0 or (args.steps is not None and args.steps < 0):
            raise ValueError("time-scale, log-every and steps must be >= 0")
        if not 1 <= args.dp_size <= 1024 or args.dp_first_rank < 0:
            raise ValueError(f"need --dp-size in 1..1024 and --dp-first-rank >= 0, got {args.dp_size}, "
                             f"{args.dp_first_rank}")
    except ValueError as error:
        parser.error(str(error))
    stop: list = []

    def request_stop(signum, _frame):
        stop.append(signum)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    segments = []
    try:
        for dp_rank in range(args.dp_first_rank, args.dp_first_rank + args.dp_size):
            segments.append(create_segment(dp_segment_name(args.segment, dp_rank), config, args.group))
    except SegmentError as error:
        print(f"vcap-sim: {error}", file=sys.stderr)
        for segment in segments:
            segment.unlink()
            segment.close()
        return 2
    segment = segments[0]
    engine = None
    step_log = _StepLog(args.step_log)
    try:
        if args.dp_size == 1:
            engine = _engine(args, config, segment)
        else:
            engine = _DataParallel([_engine(args, replace(config, seed=config.seed + dp_rank), ranked)
                                    for dp_rank, ranked in enumerate(segments, start=args.dp_first_rank)])
        if args.device is None:
            print("vcap-sim: workload, acceptance, confidence, router and timings are SYNTHETIC", flush=True)
        else:
            print(f"vcap-sim: verify steps run on {args.device} (vcap's hook, router, {args.run_layers} MoE "
                  f"layers of {_preset_name(args)}, routing {_routing(args, config)}; step time scaled "
                  f"x{engine.gpu.scale:g} to the preset's layers, plus other_ms={config.other_ms}); workload, "
                  "acceptance, confidence and routing logits are SYNTHETIC", flush=True)
        paths = ", ".join(segment_path(ranked.path) for ranked in segments)
        print(f"vcap-sim: segment {paths} time_scale={args.time_scale} {config}", flush=True)
        interval = _IntervalLog()
        while not stop and (args.steps is None or engine.steps < args.steps):
            started = time.monotonic()
            read_ns = time.monotonic_ns()
            records = engine.step()
            done_ns = time.monotonic_ns()
            gpu = getattr(engine, "gpu", None)
            if gpu is not None:   # the GPU step's own host read of the control block
                read_ns, done_ns = gpu.read_ns, gpu.done_ns
            step_log.add(engine.steps - 1, int(records[0]["generation"]), read_ns, done_ns)
            interval.add(records)
            now = time.monotonic()
            if args.log_every and now - interval.started >= args.log_every:
                print(f"vcap-sim: {interval.line(records, now)}", flush=True)
                interval.reset(now)
            if args.time_scale:
                _sleep_unless(stop, engine.last_step_ns / 1e9 * args.time_scale - (now - started))
        print(f"vcap-sim: stopped after {engine.steps} steps", flush=True)
    finally:
        step_log.close()
        if engine is not None and hasattr(engine, "close"):
            engine.close()
        for ranked in segments:
            ranked.unlink()
            ranked.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
