"""Issue 7.3: torn state. A writer process and a reader process share a segment; hypothesis picks
the policies, the delays inside each write (between the odd and the even sequence number) and
between writes, and the reader's pace. The reader (the engine's ControlReader, and the plain
seqlock read) never returns a policy other than the one written for its generation."""

import multiprocessing as mp
import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vcap.policy import Bucket, Policy
from vcap.segment import ControlReader, Segment, SegmentConfig

CONFIG = SegmentConfig(stride=6, max_bs=32, num_moe_layers=2, ring_slots=4, lease_ms=60_000)
TOTALS = {"examples": 0, "writes": 0, "reads": 0, "torn": 0}


def _spin(seconds: float) -> None:
    if seconds <= 0:
        return
    if seconds > 0.0005:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _writer(name, commands, done):
    segment = Segment.attach(name)
    while (command := commands.recv()) is not None:
        policies, schedule, first_generation = command
        for i, (inside, between) in enumerate(schedule):
            generation = first_generation + i
            segment.write_policy(policies[generation % len(policies)], generation, "manual",
                                 pause=lambda: _spin(inside))
            _spin(between)
        done.send(first_generation + len(schedule) - 1)


def _reader(name, commands, results):
    segment = Segment.attach(name)
    reader = ControlReader(segment)
    while (command := commands.recv()) is not None:
        policies, pace, first_generation, last_generation = command
        torn = reads = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for found in (segment.read_policy(), reader.snapshot()):
                if found is None:
                    continue
                policy, generation = (found[0], found[1]) if isinstance(found, tuple) else (found.policy, found.generation)
                if generation >= first_generation:  # older ones: the previous example's
                    reads += 1
                    torn += policy != policies[generation % len(policies)]
                    if generation == last_generation:
                        deadline = 0
            _spin(pace)
        results.send((reads, torn))


threshold = st.floats(0.0, 1.0, width=32)
bucket_list = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5), st.lists(threshold, min_size=5, max_size=5)),
                       min_size=1, max_size=8)


def _policy(mode, fixed_k, explore, buckets):
    return Policy(mode, fixed_k, tuple(Bucket(1 + 3 * i, min(a, b), max(a, b), tuple(t))
                                       for i, (a, b, t) in enumerate(buckets)), explore)


policies = st.lists(st.builds(_policy, st.sampled_from(["off", "fixed", "conf"]), st.integers(1, 5),
                              st.integers(0, 9), bucket_list), min_size=2, max_size=6)
delay = st.one_of(st.just(0.0), st.floats(0, 2e-5), st.floats(0, 3e-3))


class _Pair:
    def __init__(self, name):
        context = mp.get_context("spawn")
        self.to_writer, writer_end = context.Pipe()
        self.from_writer, writer_done = context.Pipe()
        self.to_reader, reader_end = context.Pipe()
        self.from_reader, reader_results = context.Pipe()
        self.processes = [context.Process(target=_writer, args=(name, writer_end, writer_done), daemon=True),
                          context.Process(target=_reader, args=(name, reader_end, reader_results), daemon=True)]
        for process in self.processes:
            process.start()

    def close(self):
        self.to_writer.send(None)
        self.to_reader.send(None)
        for process in self.processes:
            process.join(20)


def test_no_torn_read_under_random_interleavings(segment_name):
    engine = Segment.create(segment_name, CONFIG)
    pair = _Pair(segment_name)
    generation = [1]

    @settings(max_examples=int(os.environ.get("VCAP_TORN_EXAMPLES", "40")), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(policies=policies, schedule=st.lists(st.tuples(delay, delay), min_size=20, max_size=200),
           pace=delay)
    def run(policies, schedule, pace):
        first = generation[0]
        pair.to_reader.send((policies, pace, first, first + len(schedule) - 1))
        pair.to_writer.send((policies, schedule, first))
        assert pair.from_writer.poll(60), "writer stuck"
        generation[0] = pair.from_writer.recv() + 1
        assert pair.from_reader.poll(60), "reader stuck"
        reads, torn = pair.from_reader.recv()
        TOTALS["examples"] += 1
        TOTALS["writes"] += len(schedule)
        TOTALS["reads"] += reads
        TOTALS["torn"] += torn
        assert torn == 0, f"{torn} torn reads out of {reads}"

    try:
        run()
    finally:
        pair.close()
        engine.unlink()
    print(f"\ntorn-state property: {TOTALS}")
    assert TOTALS["reads"] > TOTALS["examples"]
