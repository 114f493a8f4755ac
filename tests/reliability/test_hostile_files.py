"""The files an operator names to the sidecar, made hostile (found by an outside review): a FIFO
where a file should be must not hang the start, a recording that cannot be written must stop
the recording and never the engine link, a torn or crafted recording must not make the next one
unreadable nor inflate without bound, a prior must cost only the steps it uses, and a hand-edited
history line must not reach SetPolicy.

Recordings come from the SYNTHETIC simulated engine."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

from vcap.engine_hook.sim import SimConfig, SimulatedEngine
from vcap.segment import Layout
from vcap.sidecar.auth import read_token
from vcap.sidecar.controller.auto import AutoController
from vcap.sidecar.controller.config import ControllerConfig
from vcap.sidecar.history import HistoryEntry, PolicyHistory
from vcap.sidecar.policy_control import PolicyControl
from vcap.sidecar.policy_file import PolicyFileWatcher
from vcap.sidecar.recorder import (Recorder, Recording, check_recording, encode_chunk, read_newest,
                                   read_recording)
from vcap.policy import Bucket, Policy

from ..utils import free_ports
from ._helpers import start_sim, stop_process, wait_for


def _returns(function, what: str, timeout: float = 30.0):
    """``function()``'s result or exception; fails the test (not hangs it) when it blocks."""
    result = {}

    def run():
        try:
            result["value"] = function()
        except BaseException as error:  # handed to the test
            result["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{what} blocked on a FIFO"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _records(steps: int, seed: int = 3, **kw):
    config = SimConfig(**{"max_bs": 16, "mean_bs": 8, "num_moe_layers": 4, "seed": seed, **kw})
    engine = SimulatedEngine(config)
    return Layout(config.segment_config()), np.concatenate([engine.step() for _ in range(steps)])


# -- FIFOs -------------------------------------------------------------------------------------

def test_a_fifo_where_a_file_belongs_is_refused_not_waited_on(tmp_path, caplog):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    history = _returns(lambda: PolicyHistory(fifo), "the policy history")
    assert history.path is None and "is a FIFO, not a regular file" in caplog.text   # memory only, said
    with pytest.raises(OSError, match="is a FIFO"):
        _returns(lambda: read_token(fifo), "the token file")
    with pytest.raises(OSError, match="is a FIFO"):
        _returns(lambda: Recording(fifo), "--record")
    with pytest.raises(ValueError, match="--controller-prior: .*is a FIFO"):
        _returns(lambda: AutoController(None, ControllerConfig(prior_recording=fifo)), "--controller-prior")
    with pytest.raises(ValueError, match="is a FIFO"):
        _returns(lambda: AutoController(None, ControllerConfig(sps_table=fifo)), "--controller-sps-table")
    watcher = PolicyFileWatcher(fifo, control=None)
    _returns(watcher.poll, "the policy file")
    assert "is a FIFO" in watcher.last_error


def test_a_fifo_at_the_default_history_path_does_not_hang_the_sidecar_s_start(segment_name, tmp_path):
    # a real vcap-sidecar: the history beside the segment, /dev/shm/<segment>.history, is a FIFO
    fifo = f"/dev/shm/{segment_name}.history"
    os.mkfifo(fifo)
    grpc_port, metrics_port = free_ports(2)
    with open(tmp_path / "sidecar.log", "w") as log:
        sidecar = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                                    "--grpc", f"127.0.0.1:{grpc_port}", "--metrics", f"127.0.0.1:{metrics_port}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _scrape(metrics_port) is not None or sidecar.poll() is not None, 60, "metrics served")
        assert sidecar.poll() is None
        assert "is a FIFO, not a regular file" in (tmp_path / "sidecar.log").read_text()
    finally:
        stop_process(sidecar)


# -- --record ----------------------------------------------------------------------------------

@pytest.mark.parametrize("target, message", [
    ("missing/trace.vcaprec", "its directory .* does not exist"),
    ("a-directory", "Is a directory|is a directory"),
    ("not-a-recording", "not a vcap recording"),
    ("a-symlink", "symbolic link"),
])
def test_a_record_file_that_cannot_be_written_is_refused_at_the_start(tmp_path, target, message):
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "not-a-recording").write_text("hello\n")
    (tmp_path / "a-symlink").symlink_to(tmp_path / "elsewhere.vcaprec")
    result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", "vcap-never-started",
                             "--grpc", "127.0.0.1:0", "--metrics", "", "--record", str(tmp_path / target)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("vcap-sidecar: --record: ") and "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))   # a full disk, for this process
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)                       # writes fail with EFBIG instead


def _scrape(port: int) -> dict[str, float] | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return None
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _records_read(samples: dict[str, float]) -> float:
    return sum(value for name, value in samples.items() if name.startswith("vcap_telemetry_records_total"))


def test_a_recording_that_fails_mid_run_stops_and_the_engine_link_stays(segment_name, tmp_path):
    # found by an outside review: a failing --record write reached the engine link, which
    # detached and re-attached ~40 times a second. Here the disk "fills" at 64 KiB.
    engine = start_sim(segment_name, "--mean-bs", "16")
    grpc_port, metrics_port = free_ports(2)
    record = tmp_path / "trace.vcaprec"
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "w") as log:
        sidecar = subprocess.Popen([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                                    "--grpc", f"127.0.0.1:{grpc_port}", "--metrics", f"127.0.0.1:{metrics_port}",
                                    "--state-dir", "", "--record", str(record)],
                                   stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_file_size)
    try:
        wait_for(lambda: "recording to" in log_path.read_text() or sidecar.poll() is not None, 120,
                 "the recording to fail")
        assert "stopped" in log_path.read_text() and sidecar.poll() is None
        read = _records_read(_scrape(metrics_port))
        wait_for(lambda: _records_read(_scrape(metrics_port)) > read + 500, 120, "500 more records read")
        after = _scrape(metrics_port)
        assert after['vcap_engine_attaches_total{dp_rank="0"}'] == 1.0
        assert after['vcap_engine_attached{dp_rank="0"}'] == 1.0
        assert "detaching" not in log_path.read_text()
        # what was written before the disk filled is still a readable recording
        _, records = read_recording(str(record))
        assert len(records) > 0 and record.stat().st_mode & 0o777 == 0o600
    finally:
        stop_process(sidecar)
        stop_process(engine)


def test_a_torn_chunk_is_cut_before_the_next_append(tmp_path, caplog):
    # found by an outside review: after a crash mid-chunk, the next run appended behind the torn
    # chunk and every later step was unreadable
    layout, written = _records(3000)
    path = str(tmp_path / "trace.vcaprec")
    with Recorder(path, layout) as recorder:
        recorder.write(written[:1500])
    chunk = encode_chunk(written[1500:2000])
    with open(path, "ab") as file:
        file.write(chunk[:len(chunk) // 2])   # the crash
    with Recorder(path, layout) as recorder:
        recorder.write(written[2000:])
    assert "partial chunk" in caplog.text and "cut off" in caplog.text
    _, records = read_recording(path)
    np.testing.assert_array_equal(records["step"], np.concatenate([written[:1500], written[2000:]])["step"])


def test_corruption_mid_file_is_named_not_hidden(tmp_path):
    layout, written = _records(3000)
    path = str(tmp_path / "trace.vcaprec")
    with Recorder(path, layout) as recorder:
        recorder.write(written)
    first_chunk = _first_chunk_offset(path)
    with open(path, "r+b") as file:
        file.seek(first_chunk)
        file.write(b"JUNK")
    with pytest.raises(ValueError, match=f"no chunk at byte {first_chunk} .*corrupt"):
        read_recording(path)
    with pytest.raises(ValueError, match="corrupt"):
        check_recording(path)
    with pytest.raises(ValueError, match="record into a new file"):
        Recorder(path, layout)


def _first_chunk_offset(path: str) -> int:
    data = open(path, "rb").read()
    return data.index(b"VCH2")


@pytest.mark.parametrize("craft", ["claims too much", "inflates past its header"])
def test_a_crafted_chunk_cannot_inflate_without_bound(tmp_path, craft):
    import struct
    import zlib

    layout, written = _records(10)
    path = str(tmp_path / "trace.vcaprec")
    with Recorder(path, layout) as recorder:
        recorder.write(written)
    offset = _first_chunk_offset(path)
    with open(path, "r+b") as file:
        file.truncate(offset)
        file.seek(offset)
        if craft == "claims too much":
            body = zlib.compress(b"\0" * 1024)
            file.write(struct.pack("<4sIII", b"VCH2", 10, 1 << 31, len(body)) + body)
        else:   # 64 MiB of zeros behind a header that says 1 KiB
            body = zlib.compress(b"\0" * (64 << 20), 9)
            file.write(struct.pack("<4sIII", b"VCH2", 10, 1024, len(body)) + body)
    with pytest.raises(ValueError, match="more than a recorder writes|does not inflate"):
        read_recording(path)


# -- --controller-prior --------------------------------------------------------------------------

def test_the_prior_decodes_only_the_newest_steps(tmp_path):
    # found by an outside review: a 256 MiB recording was decoded whole (4.85 GB). The oldest
    # chunk is damaged inside its compressed body (framing intact): a reader that decodes it fails.
    layout, written = _records(6 * 1024, seed=5)
    path = str(tmp_path / "trace.vcaprec")
    max_bytes = int(2.5 * len(encode_chunk(written[:1024])))
    with Recorder(path, layout, max_bytes=max_bytes, keep=3) as recorder:
        for start in range(0, len(written), 1024):
            recorder.write(written[start:start + 1024])
    oldest = f"{path}.2"
    body = _first_chunk_offset(oldest) + 16
    with open(oldest, "r+b") as file:
        file.seek(body + 8)
        file.write(b"\xff" * 64)
    with pytest.raises(ValueError):
        read_recording(oldest)
    config, records = read_newest(path, 3000)
    assert config == layout.config and len(records) == 3000
    np.testing.assert_array_equal(records["step"], written["step"][-3000:])


def test_a_prior_of_another_routing_geometry_is_not_used(tmp_path, caplog):
    layout, written = _records(2000, num_experts=64, top_k=4)
    path = str(tmp_path / "last.vcaprec")
    with Recorder(path, layout) as recorder:
        recorder.write(written)
    engine = SimConfig(max_bs=16, mean_bs=8, num_moe_layers=4, num_experts=128, top_k=8).segment_config()
    controller = AutoController(PolicyControl("vcap-unused"), ControllerConfig(),
                                engine_config=lambda: engine)
    assert controller.prime_from_recording(path) == 0
    assert "another engine geometry" in caplog.text


def test_a_prior_that_is_not_a_recording_is_refused_at_the_start(tmp_path):
    bad = tmp_path / "last.vcaprec"
    bad.write_bytes(b"VCAPREC\0" + b"\xff" * 64)
    result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", "vcap-never-started",
                             "--grpc", "127.0.0.1:0", "--metrics", "", "--controller-prior", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("vcap-sidecar: --controller-prior: "), result.stderr


# -- the policy history --------------------------------------------------------------------------

def _line(generation, rollback_of=0, policy=None) -> str:
    policy = policy or {"mode": "fixed", "fixed_k": 2, "explore_period": 0,
                        "buckets": [{"min_bs": 1, "k_min": 1, "k_max": 0, "thresholds": [0.0]}]}
    return json.dumps({"generation": generation, "source": "manual", "who": "hand edit", "reason": "",
                       "time_unix": 1.7e9, "policy": policy, "rollback_of": rollback_of})


def test_hand_edited_history_lines_out_of_range_are_skipped(tmp_path):
    # found by an outside review: generation 5e9 (past the control block's u32) or -5 in the
    # history broke every later SetPolicy
    path = tmp_path / "seg.history"
    bad_policy = {"mode": "conf", "fixed_k": 0, "buckets": [{"min_bs": 1, "k_min": 9, "k_max": 2,
                                                               "thresholds": [2.0]}], "explore_period": 0}
    path.write_text("\n".join([_line(3), _line(5e9), _line(-5), _line(4, rollback_of=-1),
                               _line(6, policy=bad_policy)]) + "\n")
    history = PolicyHistory(str(path))
    assert [entry.generation for entry in history.entries] == [3]
    control = PolicyControl("vcap-unused", history=history)
    state = control.set_policy(Policy("fixed", 1, (Bucket(1, 1, 0, (0.0,)),)), "manual", who="test")
    assert state.generation == 4


def test_a_torn_history_line_does_not_swallow_the_next_entry(tmp_path):
    path = tmp_path / "seg.history"
    path.write_text(_line(3) + "\n" + _line(4)[:40])   # the crash cut the last line
    history = PolicyHistory(str(path))
    history.append(HistoryEntry(5, "manual", "test", "after the crash", 1.7e9, Policy("fixed", 3, (Bucket(1, 1, 0, (0.0,)),))))
    again = PolicyHistory(str(path))
    assert [entry.generation for entry in again.entries] == [3, 5]


# -- vcapctl tune ----------------------------------------------------------------------------------

def test_tune_on_a_file_that_is_neither_kind_says_so(tmp_path, capsys):
    # found by an outside review: random bytes read as a seed log gave a recommendation
    from vcap.sidecar import vcapctl

    noise = tmp_path / "noise.bin"
    noise.write_bytes(np.random.default_rng(0).bytes(28 * 1000))
    assert vcapctl.main(["tune", str(noise)]) != 0
    assert "not a vcap recording, nor a seed log" in capsys.readouterr().err
