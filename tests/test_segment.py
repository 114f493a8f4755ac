"""The shared segment: layout, refusal of bad files, seqlock, the lease rule and rings across processes."""

import multiprocessing as mp
import os
import signal
import struct
import time

import numpy as np
import pytest

from vcap.policy import Bucket, Policy, default_policy
from vcap.ring import slot_offset
from vcap.segment import (ABI_VERSION, CONTROL_FALLBACK, CONTROL_HELD, CONTROL_LIVE, CONTROL_MODE, ControlReader,
                          ControlSnapshot, Layout, RingReader, RingWriter, Segment, SegmentConfig, SegmentError,
                          decode_policy, encode_policy, record_dtype)

CONFIG = SegmentConfig(stride=6, max_bs=48, num_moe_layers=7, ring_slots=16, lease_ms=200)


def _policy(i: int, num_drafts: int = 5) -> Policy:
    """The i-th policy of a deterministic sequence; every field depends on i."""
    thresholds = tuple(float(np.float32(((i * 7 + p) % 100) / 100)) for p in range(num_drafts))
    buckets = (Bucket(1, 1 + i % 2, num_drafts, thresholds),
               Bucket(2 + i % 30, 1, 1 + i % num_drafts, thresholds[::-1]))
    return Policy(mode=("off", "fixed", "conf")[i % 3], fixed_k=1 + i % num_drafts,
                  buckets=buckets, explore_period=i % 5)


def test_layout_follows_engine_dimensions():
    small, large = Layout(SegmentConfig(6, 64, 43)), Layout(SegmentConfig(12, 256, 61))
    assert large.record_size > small.record_size
    assert large.bucket_size > small.bucket_size
    for layout in (small, large):
        offsets = [layout.fallback_offset, layout.control_offset, layout.lease_offset,
                   layout.status_offset, layout.rings_offset, layout.record_size]
        assert all(o % 64 == 0 for o in offsets)
        assert record_dtype(layout).itemsize == layout.record_size
        assert layout.experts_live_offset + 4 * layout.config.num_moe_layers <= layout.record_size


def test_policy_round_trip_through_control_block():
    layout = Layout(CONFIG)
    for i in range(30):
        policy = _policy(i)
        assert decode_policy(encode_policy(policy, layout, i, "auto"), layout) == (policy, i, "auto")


def test_create_is_0600_and_attach_reads_fallback(segment_name):
    fallback = Policy("fixed", 2, default_policy(5).buckets)
    segment = Segment.create(segment_name, CONFIG, fallback=fallback)
    assert os.stat(segment.path).st_mode & 0o777 == 0o600
    attached = Segment.attach(segment_name)
    assert attached.config == CONFIG
    assert attached.fallback_policy() == (fallback, 0, "engine")
    assert attached.read_policy() == (fallback, 0, "engine")
    assert attached.engine_pid == os.getpid()
    with pytest.raises(SegmentError, match="only the engine"):
        attached.unlink()
    segment.unlink()
    assert not os.path.exists(segment.path)


def _write_header_field(path: str, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(struct.pack(fmt, value))


@pytest.mark.parametrize("damage, message", [
    (lambda p: _write_header_field(p, 0, "<8s", b"NOTVCAP!"), "not a vcap segment"),
    (lambda p: _write_header_field(p, 8, "<I", ABI_VERSION + 1), "ABI version 2"),
    (lambda p: os.truncate(p, 4096), "truncated: 4096 bytes"),
    (lambda p: os.truncate(p, 17), "truncated: 17 bytes"),
    (lambda p: _write_header_field(p, 24, "<I", 1), "corrupt header: stride"),
    (lambda p: _write_header_field(p, 44, "<I", 12345), "record/control sizes"),
    (lambda p: _write_header_field(p, 16, "<Q", 99), "total size 99"),
])
def test_bad_segment_is_refused_with_a_reason(segment_name, damage, message):
    segment = Segment.create(segment_name, CONFIG)
    damage(segment.path)
    with pytest.raises(SegmentError, match=message):
        Segment.attach(segment_name)


def test_foreign_file_and_other_owner_refused(segment_name, monkeypatch):
    path = f"/dev/shm/{segment_name}"
    with open(path, "wb") as file:
        file.write(os.urandom(1 << 16))
    with pytest.raises(SegmentError, match="not a vcap segment"):
        Segment.attach(segment_name)
    os.unlink(path)
    Segment.create(segment_name, CONFIG)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(SegmentError, match="owned by uid .* not by this user"):
        Segment.attach(segment_name)


def _writer(name, ready, enough, last):
    """Writes generation after generation until the reader has seen enough of them."""
    segment = Segment.attach(name)
    ready.set()
    generation, deadline = 0, time.monotonic() + 120
    while not enough.is_set() and time.monotonic() < deadline:
        generation += 1
        segment.write_policy(_policy(generation), generation, "manual")
        last.value = generation


def test_no_torn_read_across_processes(segment_name):
    """A writer process changes the policy until the reader has seen 200 distinct generations
    (however the two are scheduled); every snapshot read is one that was written (generation i
    always comes with policy i)."""
    segment = Segment.create(segment_name, CONFIG)
    context = mp.get_context("fork")
    ready, enough, last = context.Event(), context.Event(), context.Value("q", 0)
    writer = context.Process(target=_writer, args=(segment_name, ready, enough, last))
    writer.start()
    assert ready.wait(30)
    seen, deadline = set(), time.monotonic() + 120
    while len(seen) < 200 and time.monotonic() < deadline:
        found = segment.read_policy()
        if found is None:
            continue  # a write in flight
        policy, generation, _ = found
        if generation:
            assert policy == _policy(generation), f"torn read at generation {generation}"
            seen.add(generation)
    enough.set()
    writer.join(30)
    assert len(seen) == 200, f"saw {len(seen)} generations in 120 s"
    assert segment.read_policy()[1] == last.value


def test_lease_rule_on_the_engines_clock(segment_name):
    """``ControlReader.read``: the one rule, on a clock the test moves (ns, starting at 0)."""
    segment = Segment.create(segment_name, CONFIG)
    lease = CONFIG.lease_ms * 1_000_000
    now = [0]
    reader = ControlReader(segment, clock=lambda: now[0])
    words = lambda generation: np.frombuffer(encode_policy(_policy(generation), segment.layout, generation,  # noqa: E731
                                                           "manual"), dtype="<i4")[1:]
    segment.write_policy(_policy(1), 1, "manual")
    block, state = reader.read()
    assert state == CONTROL_LIVE and np.array_equal(block[1:], words(1))
    now[0] += lease + 1  # the heartbeat did not move for a lease
    assert reader.read()[1] == CONTROL_FALLBACK
    assert np.array_equal(reader.read()[0], reader.fallback)
    segment.heartbeat[0] += 1
    assert reader.read()[1] == CONTROL_LIVE
    segment.control_words[0] += 1  # a writer stuck mid-write: the last good block is held
    segment.control_words[CONTROL_MODE] = 99
    for _ in range(2):
        now[0] += lease // 2
        segment.heartbeat[0] += 1
        block, state = reader.read()
        assert state == CONTROL_HELD and np.array_equal(block[1:], words(1))
    now[0] += lease // 2 + 1  # odd for more than a lease since it was first seen odd, heartbeat or not
    segment.heartbeat[0] += 1
    assert reader.read()[1] == CONTROL_FALLBACK
    segment.write_policy(_policy(2), 2, "manual")  # a new sidecar finishes a write
    assert reader.read()[1] == CONTROL_LIVE
    snapshot = reader.snapshot()
    assert (snapshot.policy, snapshot.generation, snapshot.state) == (_policy(2), 2, "live")


def test_a_block_never_read_whole_is_the_fallback(segment_name):
    segment = Segment.create(segment_name, CONFIG)
    segment.control_words[0] += 1  # odd before the engine's first read
    reader = ControlReader(segment, clock=lambda: 0)
    assert reader.read()[1] == CONTROL_FALLBACK
    assert reader.snapshot() == ControlSnapshot(default_policy(5), 0, "engine", "fallback")


def _die_mid_write(name, written, go, started):
    segment = Segment.attach(name)
    segment.write_policy(_policy(3), 3, "manual")
    segment.heartbeat[0] += 1
    written.set()
    go.wait(10)
    segment.write_policy(_policy(4), 4, "manual", pause=lambda: (started.set(), time.sleep(60)))


def test_writer_killed_mid_write_keeps_last_good_then_fallback(segment_name):
    segment = Segment.create(segment_name, CONFIG)
    reader = ControlReader(segment)
    written, go, started = mp.Event(), mp.Event(), mp.Event()
    writer = mp.get_context("fork").Process(target=_die_mid_write,
                                            args=(segment_name, written, go, started))
    writer.start()
    assert written.wait(10)
    assert reader.snapshot().generation == 3
    go.set()
    assert started.wait(10)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    assert segment.control_words[0] % 2 == 1  # left mid-write
    held = reader.snapshot()
    assert (held.state, held.generation, held.policy) == ("held", 3, _policy(3))
    time.sleep(CONFIG.lease_ms / 1000 + 0.05)
    expired = reader.snapshot()
    assert (expired.state, expired.generation, expired.policy.mode) == ("fallback", 0, "off")
    # a new sidecar finishes a write over the dead one's odd sequence: live again
    Segment.attach(segment_name).write_policy(_policy(5), 5, "manual")
    segment.heartbeat[0] += 1
    assert reader.snapshot().generation == 5


def test_lease_expires_without_heartbeat_and_recovers(segment_name):
    segment = Segment.create(segment_name, CONFIG)
    sidecar = Segment.attach(segment_name)
    reader = ControlReader(segment)
    sidecar.write_policy(_policy(2), 7, "manual")
    assert reader.snapshot().generation == 7
    time.sleep(CONFIG.lease_ms / 1000 + 0.05)
    assert reader.snapshot().state == "fallback"
    sidecar.heartbeat[0] += 1
    assert reader.snapshot().state == "live"


def _ring_writer(name, count):
    segment = Segment.attach(name)
    writer = RingWriter(segment, 0)
    record = np.zeros((), dtype=record_dtype(segment.layout))
    for n in range(count):
        record["step"] = n
        record["bs"] = 1 + n % 48
        record["live"][:] = n % 7
        record["confidence"][:] = n
        writer.publish(record)


def test_ring_between_processes_counts_drops_never_half_new(segment_name):
    Segment.create(segment_name, CONFIG)  # the engine side; the writer process attaches
    reader = RingReader(Segment.attach(segment_name), 0)
    process = mp.get_context("fork").Process(target=_ring_writer, args=(segment_name, 20000))
    process.start()
    received = []
    while process.is_alive():
        received.append(reader.read())
    process.join()
    received.append(reader.read())
    records = np.concatenate(received)
    steps = records["step"].astype(np.int64)
    assert np.all(np.diff(steps) > 0)
    # every record is whole: all its fields come from the same step
    assert np.all(records["bs"] == 1 + steps % 48)
    assert np.all(records["live"] == (steps % 7)[:, None])
    assert np.all(records["confidence"] == steps[:, None, None].astype(np.float32))
    assert len(records) + reader.dropped == 20000


def test_ring_overwritten_slots_are_drops(segment_name):
    segment = Segment.create(segment_name, CONFIG)
    reader = RingReader(Segment.attach(segment_name), 0)
    writer = RingWriter(segment, 0)
    record = np.zeros((), dtype=record_dtype(segment.layout))
    for n in range(CONFIG.ring_slots * 3 + 5):
        record["step"] = n
        writer.publish(record)
    records = reader.read()
    assert len(records) == CONFIG.ring_slots
    assert reader.dropped == CONFIG.ring_slots * 2 + 5
    assert records["step"][-1] == CONFIG.ring_slots * 3 + 4
    # a slot being rewritten right now (odd seq) is not returned
    record["step"] = 999
    writer.publish(record)
    slot = (CONFIG.ring_slots * 3 + 5) % CONFIG.ring_slots
    offset = slot_offset(segment.layout, 0, slot)
    segment.write_u64(offset, segment.read_u64(offset) + 1)  # as if the next lap's writer had started on it
    assert len(reader.read()) == 0 and reader.dropped == CONFIG.ring_slots * 2 + 6


@pytest.mark.parametrize("start", [0xFFFFFFFE, 0xFFFFFFFF])   # even, and left odd by a dead writer
def test_sequence_wraps_at_32_bits(segment_name, start):
    """The control block's sequence is a u32: a write at its top wraps it to an even value and
    the policy reads back whole (found by an outside review: the write raised OverflowError and
    left the block mid-write for good)."""
    segment = Segment.create(segment_name, CONFIG)
    reader = ControlReader(segment)
    segment._control_seq[0] = start
    for generation in (7, 8):
        segment.write_policy(_policy(generation), generation, "manual")
        assert int(segment._control_seq[0]) % 2 == 0
        segment.heartbeat[0] += 1
        snapshot = reader.snapshot()
        assert (snapshot.state, snapshot.generation, snapshot.policy) == ("live", generation, _policy(generation))
    assert int(segment._control_seq[0]) < 4   # it wrapped
