"""``vcap-sim``: the simulated engine (:mod:`vcap.engine_hook.sim`) as a process. It creates the
segment, steps the engine at the modelled pace (or flat out), logs a status line now and then, and
unlinks the segment when signalled. Workload, acceptance, confidence, router and timings are
SYNTHETIC.
"""

import argparse
import signal
import sys
import time

import numpy as np

from vcap.policy import MODES
from vcap.segment import FLAG_FALLBACK, MODE_NAMES, SegmentError, segment_path

from .sim import SimConfig, SimulatedEngine, create_segment
from .workload import LOAD_PATTERNS

__all__ = ["main"]


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
    return p


def _config_from_args(args: argparse.Namespace) -> SimConfig:
    run_options = {"segment", "group", "steps", "time_scale", "log_every"}
    return SimConfig(**{name: value for name, value in vars(args).items() if name not in run_options})


def _sleep_unless(stop: list, seconds: float) -> None:
    # short naps so a signal ends the run within one of them
    deadline = time.monotonic() + seconds
    while not stop and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = _config_from_args(args)
        if args.time_scale < 0 or args.log_every < 0 or (args.steps is not None and args.steps < 0):
            raise ValueError("time-scale, log-every and steps must be >= 0")
    except ValueError as error:
        parser.error(str(error))
    stop: list = []

    def request_stop(signum, _frame):
        stop.append(signum)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        segment = create_segment(args.segment, config, args.group)
    except SegmentError as error:
        print(f"vcap-sim: {error}", file=sys.stderr)
        return 2
    try:
        engine = SimulatedEngine(config, segment, clock_ns=time.monotonic_ns)
        print("vcap-sim: workload, acceptance, confidence, router and timings are SYNTHETIC", flush=True)
        print(f"vcap-sim: segment {segment_path(args.segment)} time_scale={args.time_scale} {config}", flush=True)
        interval = _IntervalLog()
        while not stop and (args.steps is None or engine.steps < args.steps):
            started = time.monotonic()
            records = engine.step()
            interval.add(records)
            now = time.monotonic()
            if args.log_every and now - interval.started >= args.log_every:
                print(f"vcap-sim: {interval.line(records, now)}", flush=True)
                interval.reset(now)
            if args.time_scale:
                _sleep_unless(stop, engine.last_step_ns / 1e9 * args.time_scale - (now - started))
        print(f"vcap-sim: stopped after {engine.steps} steps", flush=True)
    finally:
        segment.unlink()
        segment.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0



if __name__ == "__main__":
    sys.exit(main())
