"""Issue 7.1: the sidecar dies (SIGKILL) at random points, mid-write included, 100 times, under a
running simulated engine (SYNTHETIC workload). The engine never stalls, never uses a torn
policy, holds the last good policy while the lease runs, falls back when it expires, follows the
next sidecar's policy; each restarted sidecar re-attaches in under a second and adopts the
policy in force.
"""

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from vcap.engine_hook import reference
from vcap.policy import default_policy
from vcap.segment import FLAG_EXPLORE, FLAG_FALLBACK, RingReader, Segment
from vcap.sidecar.convert import policy_to_proto

from ._helpers import policy_for, start_sim, stop_process

LEASE_MS = 200
NUM_KILLS = int(os.environ.get("VCAP_CRASH_KILLS", "100"))
# Longest pause between two engine steps we accept: the engine never waits for the sidecar,
# so anything near this is the scheduler of a loaded 2-core machine, not vcap.
MAX_STEP_GAP_S = 1.0
MAX_ATTACH_S = 1.0
# a policy in force this long must show up in the engine's records (steps are ~ms apart)
MIN_IN_FORCE_S = 0.3
STRIDE = 6
_ZYGOTE = os.path.join(os.path.dirname(__file__), "_sidecar_zygote.py")
SIM_ARGS = ("--lease-ms", str(LEASE_MS), "--max-bs", "16", "--mean-bs", "8", "--layers", "4",
            "--sample-period", "0", "--ring-slots", "16384", "--time-scale", "0.15", "--other-ms", "1.5")


class _Records(threading.Thread):
    """Drains the engine's ring every few ms (a second reader beside the sidecar's)."""

    def __init__(self, segment):
        super().__init__(daemon=True)
        self.reader = RingReader(segment, 0, from_start=True)
        self.segment = segment
        self.batches, self.stop = [], threading.Event()
        self.renewals = []  # when the sidecar's heartbeat was seen to move (engine's clock)

    def run(self):
        heartbeat = int(self.segment.heartbeat[0])
        while not self.stop.is_set():
            self.batches.append(self.reader.read())
            if int(self.segment.heartbeat[0]) != heartbeat:
                heartbeat = int(self.segment.heartbeat[0])
                self.renewals.append(time.monotonic_ns())
            time.sleep(0.005)
        self.batches.append(self.reader.read())

    def all(self):
        return np.concatenate(self.batches)


class _Zygote:
    def __init__(self, segment_name):
        self.process = subprocess.Popen([sys.executable, _ZYGOTE, segment_name], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1)
        self.events, self.queue = [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready", None, 60)

    def _read(self):
        for line in self.process.stdout:
            self.queue.put(json.loads(line))

    def wait(self, event, pid, timeout):
        deadline = time.monotonic() + timeout
        for seen in self.events:
            if seen["event"] == event and seen.get("pid") == pid and not seen.get("taken"):
                seen["taken"] = True
                return seen
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event!r} event from sidecar {pid} within {timeout}s") from None
            self.events.append(item)
            if item["event"] == event and (pid is None or item.get("pid") == pid):
                item["taken"] = True
                return item

    def spawn(self, seed, pause_at=0):
        self.process.stdin.write(json.dumps({"seed": seed, "pause_at": pause_at}) + "\n")
        return self.wait("forked", None, 30)["pid"]

    def drain(self):
        while not self.queue.empty():
            self.events.append(self.queue.get())

    def close(self):
        self.process.stdin.close()
        stop_process(self.process)


def _expected_live(record, fallback):
    generation, bs = int(record["generation"]), int(record["bs"])
    policy = fallback if generation == 0 else policy_for(generation)
    explore = bool(record["flags"] & FLAG_EXPLORE)
    return reference.live_lengths(record["confidence"][:bs], policy, bs, STRIDE, explore)


def _wait_dead(pid: int, timeout_s: float = 5.0) -> None:
    """Until the process is gone (SIGCHLD is ignored by the zygote, so it is reaped at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):  # gone while we looked
            return
        time.sleep(0.0005)
    raise AssertionError(f"sidecar {pid} still alive {timeout_s}s after SIGKILL")


def _complete_writes(events, pid) -> list[int]:
    """Generations one sidecar wrote whole, in order: each with a "wrote", or a later "writing"
    (a sidecar writes one policy at a time, so a write begun means the one before it ended)."""
    writing = [e["generation"] for e in events if e["event"] == "writing" and e["pid"] == pid]
    wrote = {e["generation"] for e in events if e["event"] == "wrote" and e["pid"] == pid}
    return [g for i, g in enumerate(writing) if g in wrote or i + 1 < len(writing)]


def test_sidecar_killed_at_random_points(segment_name):
    engine = start_sim(segment_name, *SIM_ARGS)
    segment = Segment.attach(segment_name)
    records = _Records(segment)
    records.start()
    zygote = _Zygote(segment_name)
    rng = random.Random(7)
    kills, adoptions, odd_restarts, odd_since, exited_early = [], [], 0, None, []
    try:
        for cycle in range(NUM_KILLS):
            kind = ("early" if cycle % 10 == 9 else "mid-write" if cycle % 5 == 2 else "random")
            found = segment.read_policy()  # what is in force before the sidecar starts
            pid = zygote.spawn(seed=cycle, pause_at=rng.randint(1, 3) if kind == "mid-write" else 0)
            if kind == "early":  # anywhere in its start-up, attached or not
                time.sleep(rng.uniform(0.0, 0.15))
            else:
                attached = zygote.wait("attached", pid, 30)
                assert attached["attach_s"] < MAX_ATTACH_S, attached
                if found is None:
                    odd_restarts += 1
                elif found[2] != "engine":
                    adoptions.append((found[1], attached))
                if kind == "mid-write":
                    paused = zygote.wait("paused", pid, 30)
                    time.sleep(rng.choice([0.02, 0.05, LEASE_MS / 1000 + 0.25]))
                else:
                    time.sleep(rng.uniform(0.0, 0.15))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # gone before the kill: counted and reported below
                exited_early.append(pid)
            _wait_dead(pid)  # SIGKILL is asynchronous: a running sidecar may finish one more write
            t_kill = time.monotonic_ns()
            after = segment.read_policy()
            kill = {"cycle": cycle, "kind": kind, "pid": pid, "t_kill": t_kill,
                    "block_generation": None if after is None else after[1],
                    "paused_t": paused["t_ns"] if kind == "mid-write" else None,
                    "gap": cycle % 5 == 0}
            # since when the control block has been odd (a write left mid-way): from a kill
            # mid-write, until a later sidecar completes a write
            zygote.drain()
            wrote = any(e["event"] == "wrote" and e["pid"] == pid for e in zygote.events)
            if after is not None:
                odd_since = None
            elif odd_since is None or wrote:
                odd_since = kill["paused_t"] or t_kill
            kill["odd_since"] = odd_since
            kills.append(kill)
            if kill["gap"]:  # leave the engine alone past its lease
                time.sleep(LEASE_MS / 1000 + 0.3)
            kill["t_next"] = time.monotonic_ns()
        steps_before = int(segment.status_u64[0])
        time.sleep(0.2)
        assert int(segment.status_u64[0]) > steps_before, "the engine stopped stepping"
    finally:
        zygote.close()
        records.stop.set()
        records.join()
        zygote.drain()
        stop_process(engine)
    data = records.all()
    times = data["time_ns"].astype(np.int64)
    fallback_flag = (data["flags"] & FLAG_FALLBACK) != 0
    generation = data["generation"].astype(np.int64)
    fallback_policy = default_policy(STRIDE - 1)

    # 1. never a torn policy: every record's live lengths follow from its own confidence and
    #    the policy written for its generation (0: the engine's fallback)
    assert not np.any(fallback_flag & (generation != 0))
    torn = [int(r["step"]) for r in data if not np.array_equal(r["live"][:r["bs"]], _expected_live(r, fallback_policy))]
    assert torn == [], f"{len(torn)} records used a policy not written for their generation: steps {torn[:5]}"

    # 2. never stalls
    steps = data["step"].astype(np.int64)
    consecutive = np.diff(steps) == 1
    gaps = np.diff(times)[consecutive] / 1e9
    assert records.reader.dropped == 0
    assert gaps.max() < MAX_STEP_GAP_S, f"the engine paused {gaps.max():.3f}s between two steps"

    # when writes began (announced first, so a write whose "wrote" a kill cut off still counts)
    write_times = np.sort([e["t_ns"] for e in zygote.events if e["event"] == "writing"])
    held = fell_back = 0
    for i, kill in enumerate(kills):
        t_kill, window_end = kill["t_kill"], kill["t_next"]
        before = generation[times < t_kill - 2_000_000]
        # 3. the lease runs: the last good policy stays (unless the write had been left odd
        #    longer than the lease already, when the engine is in fallback by design)
        if kill["odd_since"] is None or t_kill - kill["odd_since"] < LEASE_MS * 1e6 / 2:
            allowed = {int(before[-1])} if len(before) else set()
            if kill["block_generation"] is not None:
                allowed.add(kill["block_generation"])
            # the killed sidecar's last complete write may have reached the engine in the last
            # steps before the kill, even when the block was left odd by the write after it
            complete = _complete_writes(zygote.events, kill["pid"])
            if complete:
                allowed.add(complete[-1])
            later_writes = write_times[write_times > t_kill]
            next_write = later_writes[0] if len(later_writes) else times[-1] + 1
            # the lease runs from the last renewal (a sidecar killed before it attached renewed
            # nothing): half a lease after it, generously inside
            renewed = [t for t in records.renewals if t <= t_kill]
            last_renewal = renewed[-1] if renewed else 0
            soon = (times > t_kill + 20_000_000) & (times < min(last_renewal + LEASE_MS * 1e6 / 2, next_write))
            assert not fallback_flag[soon].any(), f"fallback inside the lease after kill {kill}"
            assert set(generation[soon].tolist()) <= allowed, (kill, set(generation[soon].tolist()), allowed)
            held += int(soon.any())
        # 4. past the lease with no sidecar: the fallback, and nothing else
        if kill["gap"]:
            late = (times > t_kill + (LEASE_MS + 100) * 1_000_000) & (times < window_end)
            assert late.any() and fallback_flag[late].all(), f"no fallback after the lease: {kill}"
            fell_back += 1
        # a write left mid-way longer than the lease counts as expired too
        if kill["odd_since"] is not None and t_kill - kill["odd_since"] > (LEASE_MS + 100) * 1e6:
            odd = (times > kill["odd_since"] + (LEASE_MS + 100) * 1e6) & (times < t_kill)
            assert fallback_flag[odd].all(), f"odd control block not treated as expired: {kill}"

    # 5. every sidecar's last complete write reaches the engine (back from the fallback), when it
    #    stayed in force long enough for the engine to step: a write overwritten by the next
    #    sidecar within a few steps may rightly never be seen
    last_written = {}
    for event in zygote.events:
        if event["event"] == "wrote":
            last_written[event["pid"]] = event
    # the policy in force ends at the next write that began: complete, or left mid-way (paused)
    change_times = write_times
    checked = 0
    for pid, event in last_written.items():
        later = change_times[change_times > event["t_ns"]]
        in_force_s = ((later[0] if len(later) else times[-1]) - event["t_ns"]) / 1e9
        if in_force_s < MIN_IN_FORCE_S:
            continue
        checked += 1
        seen = (generation == event["generation"]) & ~fallback_flag
        assert seen.any(), f"generation {event['generation']} of sidecar {pid} never reached the engine"
    assert checked > 0

    # 6. a restarted sidecar adopts the policy in force (found even in the block)
    for found_generation, attached in adoptions:
        assert attached["generation"] == found_generation, attached
        assert attached["policy"] == policy_to_proto(policy_for(found_generation)).SerializeToString().hex()

    print(f"\nsidecar crash soak: {len(kills)} SIGKILLs ({sum(k['kind'] == 'mid-write' for k in kills)} "
          f"mid-write, {sum(k['kind'] == 'early' for k in kills)} during start-up), {len(data)} records "
          f"checked, 0 torn, max step gap {gaps.max() * 1000:.1f} ms, lease held after {held} kills, "
          f"fallback after {fell_back}, {len(adoptions)} adoptions checked, {odd_restarts} restarts "
          f"on a block left mid-write, {checked} sidecars' last policies seen, {len(exited_early)} "
          f"sidecars gone before their kill")


def test_restart_after_kill_mid_write_never_reuses_a_generation(segment_name):
    from vcap.segment import SegmentConfig
    from vcap.sidecar.policy_control import PolicyControl

    engine = Segment.create(segment_name, SegmentConfig(stride=STRIDE, max_bs=16, num_moe_layers=2))
    try:
        first = PolicyControl(segment_name)
        first.attach(Segment.attach(segment_name))
        for _ in range(4):
            first.set_policy(policy_for(first.generation + 1), "manual", who="test")
        first._write_pause = lambda: (_ for _ in ()).throw(KeyboardInterrupt)  # dies inside write 5
        with pytest.raises(KeyboardInterrupt):
            first.set_policy(policy_for(5), "manual", who="test")
        assert engine.read_policy() is None  # left odd, generation 5 in the body
        restarted = PolicyControl(segment_name)
        restarted.attach(Segment.attach(segment_name))
        assert restarted.state().generation >= 5
    finally:
        engine.unlink()
