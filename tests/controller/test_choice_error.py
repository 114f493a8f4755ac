"""bench/choice_error.py splits the prediction of two rules' goodput into committed tokens, live rows
and step time, against what the runs measured. SYNTHETIC files whose ratios are known by hand."""

import json
import subprocess
import sys

import pytest

from tests.utils import BENCH, import_bench

(choice_error,) = import_bench("choice_error")


def _run(tokens_per_step, live, step_ns, bs=4, seconds=range(60, 90)):
    steps = 10
    return {"sizes": [[s, bs, tokens_per_step * bs * steps, step_ns * steps] for s in seconds]
            + [[50, bs, 1.0, 1.0], [70, 8, 1.0, 1.0]],   # outside the window or the batch size: not read
            "size_live": [[s, bs, steps, live * bs * steps] for s in seconds] + [[50, bs, 1, 99.0], [70, 8, 1, 99.0]]}


def _files(tmp_path, with_tokens):
    auto = _run(1.9, 2.3, 30e6)
    auto["cost_probes"] = [[61.0, 4, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]]   # a fitted step linear in live rows
    auto["from_state"] = {"30": {"conf0.6": _run(2.09, 2.76, 33e6)}}
    (tmp_path / "eval.json").write_text(json.dumps({"results": {"trace": {"auto": auto}}}))

    def rule(name, goodput, live, tokens, fix):
        return f"{name} {goodput} tok/s (L {live}" + (f", T {tokens}" if with_tokens else "") + f" x{fix})"
    best = "; ".join([rule("0.7:1-3", 1000.0, 2.0, 2.0, 1.0), rule("0.6:1-5", 1010.0, 2.5, 2.4, 1.02)])
    log = ["=== trace auto seed 1", "tick at 55.00 s of engine time, bs 4",
           f"bucket 2 (bs 4.0, share 1.00): judged x; chose x; gain se 0.0; best: {rule('0.1:1-2', 1.0, 1.0, 1.0, 1.0)}",
           "tick at 61.00 s of engine time, bs 4",
           f"bucket 2 (bs 4.0, share 1.00): judged x; chose x; gain se 0.0; best: {best}",
           "=== trace auto-bounded seed 1",   # never read
           "tick at 62.00 s of engine time, bs 4", "bucket 2 (bs 4.0, share 1.00): best: " + best.replace("1010.0", "8.0"),
           "=== trace auto seed 1",   # the first replica's block: read for run 1 only
           "tick at 63.00 s of engine time, bs 4", "bucket 2 (bs 4.0, share 1.00): best: " + best.replace("1010.0", "9.0")]
    (tmp_path / "controller.log").write_text("\n".join(log) + "\n")
    return str(tmp_path / "eval.json"), str(tmp_path / "controller.log")


def test_measured_parts_are_read_at_the_batch_size_and_window_only():
    parts = choice_error.measured(_run(1.9, 2.3, 30e6), 60, 90, 4)
    assert parts["tokens"] == pytest.approx(1.9) and parts["live"] == pytest.approx(2.3)
    assert parts["step"] == pytest.approx(30e6) and parts["steps"] == 300


@pytest.mark.parametrize("with_tokens", [True, False])
def test_predicted_parts_come_from_the_first_runs_ticks_in_the_window(tmp_path, with_tokens):
    _, log = _files(tmp_path, with_tokens)
    ticks = choice_error.predicted(log, "0.7:1-3", "0.6:1-5", 60, 90)
    assert [tick["at"] for tick in ticks] == [61.0]
    assert ticks[0]["other"] == {"goodput": 1010.0, "live": 2.5, "tokens": 2.4 if with_tokens else None, "x": 1.02}
    replica = choice_error.predicted(log, "0.7:1-3", "0.6:1-5", 60, 90, run=1)
    assert [(tick["at"], tick["other"]["goodput"]) for tick in replica] == [(63.0, 9.0)]


def test_the_table_gives_each_part_against_the_measurement(tmp_path):
    path, log = _files(tmp_path, with_tokens=True)
    out = subprocess.run([sys.executable, f"{BENCH}/choice_error.py", path, log, "--kept", "0.7:1-3",
                          "--other", "0.6:1-5", "--other-run", "conf0.6"], capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line and "part" not in line}
    assert rows["tokens"][:2] == [f"{2.09 / 1.9:.4f}", f"{2.4 / 2.0:.4f}"]
    assert rows["live"][:2] == [f"{2.76 / 2.3:.4f}", f"{2.5 / 2.0:.4f}"]
    # the fit's step at the predicted live rows (2.5 over 2.0), times the corrections (1.02 over 1.0)
    assert rows["step"][:2] == [f"{33 / 30:.4f}", f"{2.5 / 2.0 * 1.02:.4f}"]
    assert rows["goodput"][1] == f"{1010 / 1000:.4f}"
    assert rows["goodput"][2] == f"{(1010 / 1000) / ((2.09 / 33) / (1.9 / 30)) - 1:+.2%}"


def test_a_range_of_batch_sizes_is_read_size_by_size_never_across_sizes():
    # SYNTHETIC: at each size the other rule's step is 10% longer and its tokens 5% more, but the
    # two runs spend their steps at different sizes (the kept one mostly at bs 6, where steps are
    # twice as long): pooled across sizes the steps would compare 30e6 against ~55e6
    kept = _run(1.9, 2.3, 30e6, bs=4, seconds=range(60, 62))
    for part, extra in zip(("sizes", "size_live"), _run(1.9, 2.3, 60e6, bs=6, seconds=range(60, 90)).values()):
        kept[part] += extra
    other = _run(1.995, 2.3, 33e6, bs=4, seconds=range(60, 90))
    for part, extra in zip(("sizes", "size_live"), _run(1.995, 2.3, 66e6, bs=6, seconds=range(60, 62)).values()):
        other[part] += extra
    seen = choice_error.measured_ratios(kept, other, 60, 90, range(3, 7))   # bs 8 (the files' noise) left out
    assert seen["step"] == pytest.approx(1.1) and seen["tokens"] == pytest.approx(1.05)
    assert seen["goodput"] == pytest.approx(1.05 / 1.1) and seen["steps"] == 20 + 20   # the thinner run's steps at each size
    with pytest.raises(SystemExit, match="no batch size in 16-31"):
        choice_error.measured_ratios(kept, other, 60, 90, range(16, 32))


def test_a_window_before_any_change_compares_two_static_runs_from_time_0(tmp_path):
    path, log = _files(tmp_path, with_tokens=True)
    stored = json.loads(open(path).read())
    runs = stored["results"]["trace"]
    runs["conf0.7"], runs["conf0.6"] = _run(2.0, 2.0, 30e6), _run(2.3, 2.6, 36e6)   # from time 0
    (tmp_path / "eval.json").write_text(json.dumps(stored))
    out = subprocess.run([sys.executable, f"{BENCH}/choice_error.py", path, log, "--kept", "0.7:1-3",
                          "--other", "0.6:1-5", "--kept-run", "conf0.7", "--other-run", "conf0.6", "--bs", "2-6"],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line and "part" not in line}
    # the static runs' ratios, not auto's run against the run from its state (2.09 / 1.9)
    assert rows["tokens"][0] == f"{2.3 / 2.0:.4f}" and rows["step"][0] == f"{36 / 30:.4f}"
    assert rows["goodput"][0] == f"{(2.3 / 2.0) / (36 / 30):.4f}"


def test_live_rows_by_window_show_whether_a_windows_rows_stay_as_they_were():
    run = _run(1.9, 2.0, 30e6, seconds=range(0, 10))
    for part, extra in zip(("sizes", "size_live"), _run(1.9, 3.0, 30e6, seconds=range(10, 20)).values()):
        run[part] += extra
    # SYNTHETIC: 2.0 live rows per request in 0-10 s, 3.0 in 10-20 s, no step at bs 4 in 20-30 s
    # (the file's noise at bs 8 is outside the sizes read)
    assert choice_error.live_by_window(run, 0, 30, range(4, 5), 10) == [pytest.approx(2.0), pytest.approx(3.0), None]
