"""Control latency end to end: a client calls ``SetPolicy`` on a real sidecar process while the
engine runs in its own process (``vcap-sidecar --simulate -- --device cuda ...``), and we measure
from the RPC's return to the first verify step that used the new generation.

Clocks: the client stamps ``CLOCK_MONOTONIC`` (``time.monotonic_ns``) right after each
``SetPolicy`` returns; the engine (``vcap-sim --step-log``) stamps the same system-wide clock, per
step, just before the step's host read of the segment's control block and once its results are
back on the host (for the GPU engine: after the graph replay synced). The generation of a step
is the one its hook decided with, the value its telemetry record carries; the client also reads
the ring itself and checks the records' generations against the engine's log.

Per change ``g`` (returned by the RPC at ``t``), with ``i`` the first step whose generation is
``>= g``:

- ``used_ms``: ``done_ns[i] - t`` (the GPU has run a step with the new policy);
- ``read_ms``: ``read_ns[i] - t`` (negative when the step read the segment between the write and
  the RPC's return);
- ``steps``: steps started after the RPC returned up to and including ``i`` (1: the next step to
  start used it; 0: a step that started before the return already used it).

Changes alternate between policies that differ (fixed k cycling 1..4 and off), spaced by a random
gap so they land at random phases of the step. Workload, confidence, acceptance (and routing)
are SYNTHETIC.

    python3 bench/bench_control_latency.py --changes 200 --out latency.json -- --device cuda --mean-bs 16
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

__all__ = ["main", "analyse"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the sidecar exited ({proc.returncode}) while waiting for {what}")
        try:
            value = condition()
        except Exception:   # not up yet
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {timeout} s")


def _policies(num_drafts: int):
    from vcap.policy import Bucket, Policy, default_policy
    fixed = [Policy("fixed", k, (Bucket(1, 1, num_drafts, (0.0,) * num_drafts),)) for k in range(1, min(num_drafts, 4) + 1)]
    return [*fixed, default_policy(num_drafts)]


def read_step_log(path: str) -> np.ndarray:
    """The engine's ``--step-log`` as ``[steps, 4]`` int64: step, generation, read_ns, done_ns."""
    data = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    return data.reshape(-1, 4)


def analyse(changes: list[tuple[int, int]], log: np.ndarray) -> dict:
    """Per change ``(generation, returned_ns)``: the first step with that generation or a later one."""
    gens, read_ns, done_ns = log[:, 1], log[:, 2], log[:, 3]
    used_ms, read_ms, steps, missed = [], [], [], 0
    for generation, returned in changes:
        hits = np.flatnonzero(gens >= generation)
        if not len(hits):
            missed += 1
            continue
        i = int(hits[0])
        used_ms.append((int(done_ns[i]) - returned) / 1e6)
        read_ms.append((int(read_ns[i]) - returned) / 1e6)
        steps.append(int(np.count_nonzero(read_ns[:i + 1] > returned)))
    out = {"changes": len(changes), "measured": len(used_ms), "missed": missed}
    if used_ms:
        u, r, s = np.array(used_ms), np.array(read_ms), np.array(steps)
        q = lambda a, p: float(np.percentile(a, p))   # noqa: E731
        out.update(used_ms={"median": q(u, 50), "p99": q(u, 99), "max": float(u.max()), "min": float(u.min())},
                   read_ms={"median": q(r, 50), "p99": q(r, 99), "max": float(r.max())},
                   steps={"median": q(s, 50), "p99": q(s, 99), "max": int(s.max()),
                          "histogram": {str(k): int(v) for k, v in zip(*np.unique(s, return_counts=True))}},
                   within_2_steps=float(np.mean(s <= 2)))
    step_ms = np.diff(done_ns) / 1e6
    if len(step_ms):
        out["step_ms"] = {"median": float(np.median(step_ms)), "p99": float(np.percentile(step_ms, 99))}
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=200)
    ap.add_argument("--gap-ms", default="20,60", help="random gap between two changes, MIN,MAX ms")
    ap.add_argument("--warmup-steps", type=int, default=50, help="engine steps before the first change")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import grpc

    from vcap.segment import STATUS_STEPS, RingReader, Segment
    from vcap.sidecar.convert import policy_to_proto
    from vcap.v1 import controller_pb2 as pb
    from vcap.v1 import controller_pb2_grpc as pb_grpc

    gap_lo, gap_hi = (float(v) / 1e3 for v in args.gap_ms.split(","))
    rng = random.Random(args.seed)
    segment_name = f"vcap-lat-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="vcap-lat-")
    step_log = os.path.join(workdir, "steps.csv")
    sidecar_log = open(os.path.join(workdir, "sidecar.log"), "w")
    command = [sys.executable, "-m", "vcap.sidecar.cli", "--simulate", "--segment", segment_name,
               "--grpc", f"127.0.0.1:{port}", "--metrics", "", "--log-level", "WARNING",
               "--", "--log-every", "0", "--step-log", step_log, *engine_args]
    sidecar = subprocess.Popen(command, stdout=sidecar_log, stderr=subprocess.STDOUT)
    changes: list[tuple[int, int]] = []
    ring_generations: dict[int, int] = {}
    result = {"command": command[1:], "engine_args": engine_args}
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.ControllerStub(channel)
        state = _wait(lambda: (s := stub.GetPolicy(pb.GetPolicyRequest(), timeout=2)).engine_attached and s,
                      args.start_timeout, "attached engine", sidecar)
        segment = Segment.attach(segment_name)
        ring = RingReader(segment, 0)
        _wait(lambda: int(segment.status_u64[STATUS_STEPS]) >= args.warmup_steps, args.start_timeout,
              f"{args.warmup_steps} engine steps", sidecar)
        ring.read()
        policies = _policies(int(state.num_drafts))
        started = time.monotonic()
        for n in range(args.changes):
            policy = policies[n % len(policies)]
            reply = stub.SetPolicy(pb.SetPolicyRequest(policy=policy_to_proto(policy), reason="latency bench"),
                                   timeout=10)
            returned = time.monotonic_ns()
            changes.append((int(reply.generation), returned))
            time.sleep(rng.uniform(gap_lo, gap_hi))
            records = ring.read()
            ring_generations.update(zip(records["step"].tolist(), records["generation"].tolist()))
            if sidecar.poll() is not None:
                raise RuntimeError(f"the sidecar exited ({sidecar.returncode})")
        time.sleep(max(gap_hi, 0.2))
        records = ring.read()
        ring_generations.update(zip(records["step"].tolist(), records["generation"].tolist()))
        result["client_s"] = time.monotonic() - started
        result["ring_dropped"] = int(ring.dropped)
        segment.close()
        channel.close()
    finally:
        if sidecar.poll() is None:
            sidecar.send_signal(signal.SIGTERM)
            try:
                sidecar.wait(timeout=60)
            except subprocess.TimeoutExpired:
                sidecar.kill()
        sidecar_log.close()
        result["sidecar_log_tail"] = open(os.path.join(workdir, "sidecar.log")).read()[-2000:]
    log = read_step_log(step_log)
    result.update(analyse(changes, log))
    # the telemetry records (as the ring carried them) against the engine's own log
    by_step = dict(zip(log[:, 0].tolist(), log[:, 1].tolist()))
    common = [s for s in ring_generations if s in by_step]
    result["ring_records_checked"] = len(common)
    result["ring_generation_mismatches"] = sum(ring_generations[s] != by_step[s] for s in common)
    result["engine_steps"] = int(len(log))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    summary = {k: result.get(k) for k in ("changes", "measured", "missed", "used_ms", "read_ms", "steps",
                                          "within_2_steps", "step_ms", "ring_records_checked",
                                          "ring_generation_mismatches", "engine_steps")}
    print(json.dumps(summary), flush=True)
    return result


if __name__ == "__main__":
    main()
