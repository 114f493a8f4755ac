"""Sidecar resource use under telemetry load (issue 7.7).

A writer process plays the engine: it creates a segment (max_bs 256, stride 6, 43 MoE layers)
and publishes bs=256 records with ``RingWriter``; a real ``vcap-sidecar`` process attaches and
drains the ring. Two phases:

- ``flat out``: ``--records`` records as fast as the writer can publish; the sidecar's RSS is
  sampled every ``--sample-every`` records (memory must stay flat; drops are allowed here, the
  writer is faster than any reader needs to be);
- ``paced``: ``--rate`` steps/s for ``--rate-seconds``; the sidecar must drop nothing, and its
  CPU time (utime + stime from /proc) over the phase gives its share of one core.

Each phase ends when the sidecar has read, or counted as dropped, every published record.

Prints a summary, or JSON with ``--json``. Records are SYNTHETIC (random confidence, live and
accepted); the cost of aggregating them does not depend on their values.
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from vcap.segment import FLAG_EXPERTS_SAMPLED, Layout, RingWriter, Segment, SegmentConfig, record_dtype

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")


def _rss(pid):
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * _PAGE


def _cpu(pid):
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _records(layout, count, bs, rng):
    records = np.zeros(count, dtype=record_dtype(layout))
    records["bs"] = bs
    records["generation"] = 1
    records["mode"] = 2
    records["flags"] = FLAG_EXPERTS_SAMPLED
    records["step_ns"] = 4_000_000
    records["confidence"][:, :bs] = rng.random((count, bs, layout.config.num_drafts), dtype=np.float32)
    live = rng.integers(1, layout.config.stride + 1, (count, bs))
    records["live"][:, :bs] = live
    records["accepted"][:, :bs] = rng.integers(0, 6, (count, bs)) % live
    records["experts_all"] = 300
    records["experts_live"] = 200
    return records


def _writer(name, config, phases, progress):
    """Child: the engine. ``phases``: list of (count, rate or 0 for flat out)."""
    segment = Segment.create(name, config)
    try:
        writer = RingWriter(segment, 0)
        pool = _records(segment.layout, 64, 256, np.random.default_rng(0))
        progress.send("created")
        step = 0
        for count, rate in phases:
            progress.recv()  # go: the sidecar attached / the previous phase was measured
            started = time.perf_counter()
            for n in range(count):
                if rate:
                    delay = started + n / rate - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                record = pool[step % len(pool)]
                record["step"] = step
                record["time_ns"] = time.monotonic_ns()
                writer.publish(record)
                step += 1
                if n % 10_000 == 0:
                    progress.send(("at", step))
            progress.send(("done", step, time.perf_counter() - started))
        progress.recv()  # measurements taken
    finally:
        segment.unlink()


def _metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _drained(port, published, timeout_s=60.0):
    """``(read, dropped)`` once the sidecar has read or counted as dropped every published record."""
    deadline = time.monotonic() + timeout_s
    while True:
        read, dropped = _metric(port, "vcap_telemetry_records_total"), _metric(port, "vcap_telemetry_dropped_total")
        if read + dropped >= published or time.monotonic() > deadline:
            return read, dropped
        time.sleep(0.1)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(records, sample_every, rate, rate_seconds, ring_slots):
    name = f"vcap-bench-{os.getpid()}"
    config = SegmentConfig(stride=6, max_bs=256, num_moe_layers=43, ring_slots=ring_slots)
    phases = [(records, 0), (int(rate * rate_seconds), rate)]
    ours, theirs = mp.get_context("spawn").Pipe()
    writer = mp.get_context("spawn").Process(target=_writer, args=(name, config, phases, theirs), daemon=True)
    writer.start()
    assert ours.recv() == "created"
    metrics_port = _free_port()
    sidecar = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", name,
                                "--grpc", "127.0.0.1:0", "--metrics", f"127.0.0.1:{metrics_port}",
                                "--log-level", "WARNING"])
    result = {"records_flat_out": records, "rate": rate, "rate_seconds": rate_seconds, "bs": 256,
              "ring_slots": ring_slots, "record_bytes": Layout(config).record_size}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _metric(metrics_port, "vcap_engine_attached") == 1:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("sidecar did not attach")
            time.sleep(0.1)
        ours.send("go")
        # phase 1: flat out, RSS every sample_every records
        rss, next_sample, cpu0, t0 = [], 0, _cpu(sidecar.pid), time.monotonic()
        while True:
            message = ours.recv()
            if message[0] == "at" and message[1] >= next_sample:
                rss.append((message[1], _rss(sidecar.pid)))
                next_sample += sample_every
            if message[0] == "done":
                flat_seconds = message[2]
                break
        read_1, dropped_1 = _drained(metrics_port, records)
        rss.append((records, _rss(sidecar.pid)))
        result.update(flat_out_records_per_s=records / flat_seconds,
                      flat_out_sidecar_cpu_s=_cpu(sidecar.pid) - cpu0, flat_out_wall_s=time.monotonic() - t0,
                      flat_out_read=read_1, flat_out_dropped=dropped_1,
                      rss_mib=[(n, round(r / 2**20, 2)) for n, r in rss])
        # phase 2: paced
        cpu1, t1 = _cpu(sidecar.pid), time.monotonic()
        ours.send("go")
        while (message := ours.recv())[0] != "done":
            pass
        read_2, dropped_2 = _drained(metrics_port, records + phases[1][0])
        read_2, dropped_2 = read_2 - read_1, dropped_2 - dropped_1
        paced_wall = time.monotonic() - t1
        paced_cpu = _cpu(sidecar.pid) - cpu1
        ours.send("measured")
        result.update(paced_steps=phases[1][0], paced_achieved_rate=phases[1][0] / message[2],
                      paced_read=read_2, paced_dropped=dropped_2, paced_cpu_s=paced_cpu,
                      paced_wall_s=paced_wall, paced_core_fraction=paced_cpu / paced_wall,
                      # after the first sample past warm-up: the latest against the earliest peak
                      rss_growth_mib=round((max(r for _, r in rss[len(rss) // 2:])
                                            - max(r for _, r in rss[1:len(rss) // 2 + 1])) / 2**20, 2))
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=20)
        writer.join(20)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000, help="flat-out phase records")
    parser.add_argument("--sample-every", type=int, default=100_000, help="RSS sample period (records)")
    parser.add_argument("--rate", type=float, default=1000.0, help="paced phase steps/s")
    parser.add_argument("--rate-seconds", type=float, default=30.0)
    parser.add_argument("--ring-slots", type=int, default=1024)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.records, args.sample_every, args.rate, args.rate_seconds, args.ring_slots)
    if args.json:
        print(json.dumps(result))
        return 0
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
