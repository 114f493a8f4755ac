"""Host cost of reaching the segment through the file (``pread``/``pwrite``, which a truncation
cannot turn into SIGBUS) against the mapping (numpy views, as before), in the same run.

    python bench/bench_segment_io.py --out bench/runs/segment_io.json

Per step of the engine: the damage check, the lease and the control block read (the GPU hook's
host work),
and a record published (the simulated engine's); per tick of the sidecar: a pass over a ring
with ``--records`` new records. The mapping's figures are the same operations written as views,
kept here only as the baseline. Results: bench/SIDECAR_RESULTS.md.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from vcap.ring import RingReader, RingWriter
from vcap.segment import Segment, SegmentConfig, record_dtype


def per_call_us(function, repeats: int) -> float:
    """Median over 5 rounds of ``repeats`` calls, in microseconds per call."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(repeats):
            function()
        rounds.append((time.perf_counter_ns() - start) / repeats / 1e3)
    return float(np.median(rounds))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-bs", type=int, default=256)
    p.add_argument("--records", type=int, default=16, help="new records per ring pass")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    name = f"vcap-bench-io-{os.getpid()}"
    config = SegmentConfig(stride=6, max_bs=args.max_bs, num_moe_layers=43)
    engine = Segment.create(name, config)
    sidecar = Segment.attach(name)
    try:
        layout = engine.layout
        record = np.zeros((), dtype=record_dtype(layout))
        record["bs"] = args.max_bs
        writer = RingWriter(engine, 0)
        views = engine.buffer
        heartbeat_view = np.frombuffer(views, dtype="<u8", count=1, offset=layout.lease_offset)
        seq_view = np.frombuffer(views, dtype="<u4", count=1, offset=layout.control_offset)
        block_view = np.frombuffer(views, dtype="<u4", count=layout.control_size // 4, offset=layout.control_offset)

        def mapped_engine_step():  # as before: size, lease and seqlock read through the mapping
            if views.size() < layout.total_size:
                raise RuntimeError
            heartbeat = int(heartbeat_view[0])
            before = int(seq_view[0])
            words = block_view.copy()
            return heartbeat, (words if int(seq_view[0]) == before else None)

        def file_engine_step():
            if not engine.intact():
                raise RuntimeError
            return engine.lease_heartbeat(), engine.read_control_words()

        slots = np.frombuffer(views, dtype=record_dtype(layout), count=config.ring_slots,
                              offset=layout.ring_offset(0) + 64)
        slot_seqs = np.ndarray((config.ring_slots,), dtype="<u8", buffer=views,
                               offset=layout.ring_offset(0) + 64, strides=(layout.record_size,))
        published = np.frombuffer(views, dtype="<u8", count=1, offset=layout.ring_offset(0))

        def mapped_publish():
            n = int(published[0])
            slot = n % config.ring_slots
            slot_seqs[slot] = 2 * n + 1
            data = record.copy()
            data["seq"] = 2 * n + 1
            slots[slot] = data
            slot_seqs[slot] = 2 * n + 2
            published[0] = n + 1

        def mapped_ring_pass():
            first = int(published[0]) - args.records
            index = (np.arange(first, first + args.records) % config.ring_slots).astype(np.int64)
            before, data, after = slot_seqs[index], slots[index], slot_seqs[index]
            return data[(before == after)]

        reader = RingReader(sidecar, 0)

        def file_ring_pass():
            reader.position = sidecar.ring_next_record(0) - args.records
            return reader.read()

        for _ in range(args.records):
            writer.publish(record)
        assert len(file_ring_pass()) == args.records and len(mapped_ring_pass()) == args.records
        results = {}
        for what, mapped, through_file in (
                ("engine step: damage check + lease + control block read", mapped_engine_step, file_engine_step),
                ("engine step: one record published", mapped_publish, lambda: writer.publish(record)),
                (f"sidecar tick: one ring pass of {args.records} records", mapped_ring_pass, file_ring_pass)):
            mapped_us, file_us = per_call_us(mapped, args.repeats), per_call_us(through_file, args.repeats)
            results[what] = {"mapping_us": round(mapped_us, 2), "file_us": round(file_us, 2),
                             "ratio": round(file_us / mapped_us, 2)}
            print(f"{what}: mapping {mapped_us:.2f} us, file {file_us:.2f} us ({file_us / mapped_us:.2f}x)")
        report = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
                  "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
                  "record_bytes": layout.record_size, "results": results}
        if args.out:
            with open(args.out, "w") as out:
                json.dump(report, out, indent=1)
    finally:
        engine.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
