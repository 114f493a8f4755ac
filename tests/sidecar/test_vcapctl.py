"""vcapctl against a real sidecar on loopback: what `set` writes from each state, the flags it
refuses, and the errors a newcomer sees."""

import argparse
import itertools
import shlex
import socket
import subprocess
import sys

import numpy as np
import pytest

from vcap.policy import Bucket, Policy, resolve
from vcap.segment import Segment, SegmentConfig
from vcap.sidecar import tune, vcapctl
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.sidecar.convert import policy_from_proto
from vcap.sidecar.policy_edit import FlagConflict, check_flags, edit_policy
from vcap.v1 import controller_pb2 as pb

from .test_grpc import wait_for

CONFIG = SegmentConfig(stride=6, max_bs=32, num_moe_layers=3, ring_slots=8, lease_ms=300)
# What the controller wrote in the report of issue 12: k 5..5 from bs 64, where no threshold acts.
AUTO_POLICY = Policy("conf", 1, (Bucket(1, 1, 5, (0.2,) * 5), Bucket(64, 5, 5, (0.0,) * 5)), explore_period=16)


@pytest.fixture
def sidecar(segment_name):
    server = Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0",
                                   metrics_address="127.0.0.1:0")).start()
    segment = Segment.create(segment_name, CONFIG)
    try:
        wait_for(lambda: server.link.attached, what="attach")
        yield server
    finally:
        server.stop()
        segment.unlink()


def ctl(sidecar, capsys, *args):
    """``(exit status, stdout, stderr)`` of ``vcapctl --target <sidecar> ARGS``."""
    capsys.readouterr()
    rc = vcapctl.main(["--target", f"127.0.0.1:{sidecar.grpc_port}", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def policy_in_force(sidecar):
    return sidecar.control.state().policy


def enter(state, sidecar, capsys):
    if state == "auto":
        assert ctl(sidecar, capsys, "set", "--mode", "auto")[0] == 0
        sidecar.control.set_policy(AUTO_POLICY, "auto", "controller")  # as the controller writes
    else:
        assert ctl(sidecar, capsys, "set", *{"off": ["--mode", "off"], "fixed": ["--k", "3"]}[state])[0] == 0


def assert_same_policy(found: Policy, expected: Policy):
    assert (found.mode, found.explore_period, len(found.buckets)) == \
        (expected.mode, expected.explore_period, len(expected.buckets))
    for a, b in zip(found.buckets, expected.buckets):
        assert (a.min_bs, a.k_min, a.k_max) == (b.min_bs, b.k_min, b.k_max)
        np.testing.assert_array_equal(np.float32(a.thresholds), np.float32(b.thresholds))


@pytest.fixture(scope="module")
def recommendation(tmp_path_factory):
    """tune's result on a SYNTHETIC seed log whose late drafts are rarely accepted."""
    rng = np.random.default_rng(7)
    rows = 4000
    confidence = rng.random((rows, 5)).astype(np.float32) * np.float32([1.0, 0.8, 0.5, 0.3, 0.2])
    accepted = np.cumprod(rng.random((rows, 5)) < confidence, axis=1).sum(axis=1)
    path = tmp_path_factory.mktemp("seed") / "seed.bin"
    np.concatenate([confidence, np.full((rows, 1), 6), accepted[:, None]], axis=1).astype("<f4").tofile(path)
    return tune.run(argparse.Namespace(file=str(path), stride=6, bs="1,8,32,64,128", max_tokens_given_up=0.1,
                                       grid="coarse", plot=None))


@pytest.mark.parametrize("state", ["off", "fixed", "auto"])
def test_the_recommended_command_yields_the_recommended_policy_from_any_state(
        state, sidecar, capsys, recommendation):
    enter(state, sidecar, capsys)
    command = shlex.split(recommendation["command"])
    assert command[:2] == ["vcapctl", "set"]
    rc, out, err = ctl(sidecar, capsys, *command[1:])
    assert rc == 0, err
    assert ("auto -> manual" in out) == (state == "auto")
    found = policy_from_proto(vcapctl_get(sidecar).policy)
    assert_same_policy(found, resolve(recommendation["policy"], 5))
    assert sidecar.control.state().control_mode == "manual"


def vcapctl_get(sidecar):
    import grpc
    from vcap.v1 import controller_pb2_grpc as pb_grpc
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        return pb_grpc.ControllerStub(channel).GetPolicy(pb.GetPolicyRequest())


def test_the_recommendation_merges_buckets_of_one_rule(recommendation):
    buckets = recommendation["policy"].buckets
    rules = [(b.k_min, b.k_max, b.thresholds) for b in buckets]
    assert all(a != b for a, b in zip(rules, rules[1:]))
    chosen = {bs: recommendation["rules"][i] for bs, i in recommendation["recommended"].items()}
    for bs, rule in chosen.items():  # the merged policy still applies each batch size's choice
        bucket = Policy("conf", 1, buckets).bucket_for(bs)
        assert (bucket.k_min, bucket.k_max, bucket.thresholds[0]) == (rule.k_min, rule.k_max, rule.thresholds[0])
    assert len(buckets) < len(recommendation["batch_sizes"])


def test_the_pareto_plot_marks_the_recommended_and_the_recorded_policy(recommendation, tmp_path):
    pytest.importorskip("matplotlib")
    labels = tune._plot(recommendation, str(tmp_path / "front.png"))
    for bs in recommendation["batch_sizes"]:
        assert any(label.startswith(f"bs {bs} recommended") for label in labels)
        assert f"bs {bs} current (as recorded)" in labels


# -- flag combinations ----------------------------------------------------------------------------

REFUSED = [
    (["--mode", "auto", "--threshold", "0.3"], "--mode auto", "--threshold"),
    (["--bucket", "1:0.2", "--k-min", "2", "--k-max", "3"], "--bucket", "--k-min"),
    (["--bucket", "1:0.2", "--threshold", "0.5"], "--bucket", "--threshold"),
    (["--k", "2", "--threshold", "0.3"], "--k", "--threshold"),
    (["--threshold", "0.3", "--thresholds", "0,0.3"], "--threshold", "--thresholds"),
    (["--spec", "conf:0.3", "--k", "2"], "--spec", "--k"),
    (["--mode", "off", "--k", "3"], "--mode off", "--k"),
    (["--mode", "fixed", "--threshold", "0.3"], "--mode fixed", "--threshold"),
    (["--mode", "auto", "--reason", "x"], "--mode auto", "--reason"),
    (["--mode", "manual", "--reason", "x"], "--mode manual", "--reason"),
    (["--k", "2", "--force", "--expected-generation", "1"], "--expected-generation", "--force"),
    (["--spec", "3", "--k-min", "2"], "--spec 3", "--k-min"),
]


@pytest.mark.parametrize("flags,first,second", REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_conflicting_flags_are_refused_naming_both(flags, first, second, sidecar, capsys):
    before = sidecar.control.state().generation
    rc, out, err = ctl(sidecar, capsys, "set", *flags)
    assert rc == 2 and first in err and second in err and "nothing written" in err
    assert sidecar.control.state().generation == before


def test_mode_manual_with_k_applies_k(sidecar, capsys):
    enter("auto", sidecar, capsys)
    rc, out, _ = ctl(sidecar, capsys, "set", "--mode", "manual", "--k", "2")
    assert rc == 0 and "auto -> manual" in out
    policy = policy_in_force(sidecar)
    assert (policy.mode, policy.fixed_k) == ("fixed", 2)


SAMPLES = {
    "--mode": ["off", "fixed", "conf", "auto", "manual"], "--threshold": ["0.3"],
    "--thresholds": ["0,0.5,0.3,0.2,0.1"], "--k": ["2"], "--k-min": ["2"], "--k-max": ["4"],
    "--bucket": ["32:0.4:1-2"], "--spec": ["conf:0.25,0.25,0.03,0.06", "3"], "--explore-period": ["7"],
}


def _namespace(pairs):
    args = argparse.Namespace(mode=None, threshold=None, thresholds=None, k=None, k_min=None, k_max=None, bucket=[],
                              spec=None, explore_period=None, expected_generation=None, force=False, reason="")
    for flag, value in pairs:
        name = flag.removeprefix("--").replace("-", "_")
        value = {"threshold": float, "k": int, "k_min": int, "k_max": int, "explore_period": int}.get(name, str)(value)
        setattr(args, name, [value] if name == "bucket" else value)
    return args


def _options():
    return [(flag, value) for flag, values in SAMPLES.items() for value in values]


@pytest.mark.parametrize("first,second", [pair for pair in itertools.combinations(_options(), 2)
                                          if pair[0][0] != pair[1][0]])
def test_every_pair_of_flags_is_applied_as_written_or_refused(first, second):
    args = _namespace([first, second])
    current = Policy("conf", 4, (Bucket(1, 1, 5, (0.1,) * 5), Bucket(64, 1, 3, (0.2,) * 5)), explore_period=5)
    try:
        check_flags(args)
    except FlagConflict as error:
        for flag, value in (first, second):
            assert flag in str(error)
        return
    policy, _ = edit_policy(current, args, 5)
    for flag, value in (first, second):
        if flag == "--mode" and value in ("off", "fixed", "conf"):
            assert policy.mode == value
        elif flag == "--threshold":
            assert policy.mode == "conf" and all(b.thresholds == (0.3,) for b in policy.buckets)
        elif flag == "--thresholds":
            assert policy.mode == "conf" and all(b.thresholds == (0, 0.5, 0.3, 0.2, 0.1) for b in policy.buckets)
        elif flag == "--k":
            assert (policy.mode, policy.fixed_k) == ("fixed", 2)
        elif flag in ("--k-min", "--k-max"):
            attribute = flag.removeprefix("--").replace("-", "_")
            assert all(getattr(b, attribute) == int(value) for b in policy.buckets)
        elif flag == "--bucket":
            assert policy.buckets == (Bucket(32, 1, 2, (0.4,)),)
        elif flag == "--spec":
            expected = ("conf", (0.0, 0.25, 0.25, 0.03, 0.06)) if value.startswith("conf") else ("fixed", 3)
            assert policy.mode == expected[0]
            assert policy.fixed_k == 3 if expected[0] == "fixed" else policy.buckets[0].thresholds == expected[1]
        elif flag == "--explore-period":
            assert policy.explore_period == 7


# -- no change, leaving auto, a threshold after auto ---------------------------------------------

def test_a_bare_set_writes_nothing_and_says_so(sidecar, capsys):
    enter("auto", sidecar, capsys)
    before = sidecar.control.state()
    rc, out, err = ctl(sidecar, capsys, "set")
    assert rc == 2 and "nothing to change" in err and "nothing written" in err
    after = sidecar.control.state()
    assert (after.generation, after.control_mode) == (before.generation, "auto")


def test_a_threshold_after_auto_acts_in_every_bucket(sidecar, capsys):
    enter("auto", sidecar, capsys)
    rc, out, err = ctl(sidecar, capsys, "set", "--threshold", "0.3")
    assert rc == 0, err
    assert "auto -> manual" in out and "k 5..5 reset to 1..all" in out
    assert_same_policy(policy_in_force(sidecar), Policy("conf", 1, (Bucket(1, 1, 5, (0.3,) * 5),), 16))
    assert "thresholds 0.3,0.3,0.3,0.3,0.3" in out and "0.300000" not in out


@pytest.mark.parametrize("flags", [["--k-min", "2", "--k-max", "2"], ["--k-max", "3"]])
def test_bounds_over_a_fixed_policy_are_refused_not_written_to_no_effect(sidecar, capsys, flags):
    # found by an outside review: in fixed mode they wrote a new generation that changed nothing
    assert ctl(sidecar, capsys, "set", "--k", "3")[0] == 0
    before = sidecar.control.state().generation
    rc, _, err = ctl(sidecar, capsys, "set", *flags)
    assert rc == 2 and "act only in conf mode" in err and "fixed k=3" in err and "nothing written" in err, err
    assert sidecar.control.state().generation == before
    rc, _, err = ctl(sidecar, capsys, "set", "--mode", "conf", *flags)
    assert rc == 0 and policy_in_force(sidecar).mode == "conf", err


def test_a_bucket_selects_conf_mode_as_a_threshold_does(sidecar, capsys):
    assert ctl(sidecar, capsys, "set", "--k", "3")[0] == 0
    assert ctl(sidecar, capsys, "set", "--bucket", "1:0.3:1-4")[0] == 0
    assert_same_policy(policy_in_force(sidecar), Policy("conf", 3, (Bucket(1, 1, 4, (0.3,) * 5),)))


def test_a_threshold_over_manual_bounds_that_leave_no_room_says_so(sidecar, capsys):
    assert ctl(sidecar, capsys, "set", "--bucket", "1:0.1", "--bucket", "64:0:5-5")[0] == 0
    rc, out, _ = ctl(sidecar, capsys, "set", "--threshold", "0.3")
    assert rc == 0 and "bucket bs>=64: k 5..5 leaves the thresholds no room" in out


# -- errors and help -------------------------------------------------------------------------------

def test_no_sidecar_at_the_target(capsys):
    with socket.socket() as unused:   # bound, never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        assert vcapctl.main(["--target", f"127.0.0.1:{port}", "--timeout", "2", "get"]) == 1
    err = capsys.readouterr().err
    assert f"no vcap sidecar answers at 127.0.0.1:{port}: is `vcap-sidecar` running? (--target)" in err


def test_the_metrics_port_is_recognised(sidecar, capsys):
    assert vcapctl.main(["--target", f"127.0.0.1:{sidecar.metrics_port}", "--timeout", "2", "get"]) == 1
    err = capsys.readouterr().err
    assert "looks like vcap's metrics endpoint" in err and "the gRPC port is 50061 by default" in err


@pytest.mark.parametrize("target,expected", [
    ("localhost", "localhost:50061"), ("127.0.0.1:7000", "127.0.0.1:7000"), ("::1", "[::1]:50061"),
    ("[::1]", "[::1]:50061"), ("[::1]:7000", "[::1]:7000"), ("unix:/run/vcap.sock", "unix:/run/vcap.sock")])
def test_a_target_without_port_gets_50061(target, expected):
    assert vcapctl.normalized_target(target) == expected


@pytest.mark.parametrize("target", ["127.0.0.1:99999", "[::1]:0", "localhost:http", "host:-1"])
def test_a_port_out_of_range_is_a_usage_error(target, capsys):
    with pytest.raises(SystemExit) as exit_:
        vcapctl.main(["--target", target, "get"])
    assert exit_.value.code == 2 and "is not a number in 1..65535" in capsys.readouterr().err


def test_a_bad_spec_shows_the_syntax(sidecar, capsys):
    rc, _, err = ctl(sidecar, capsys, "set", "--spec", "bogus")
    assert rc == 2 and "conf:a,b,c,d (thresholds of drafts 2..5" in err


def _every_action():
    parser = vcapctl._parser()
    yield "vcapctl", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_flag_has_help_and_watch_explains_its_columns():
    for name, parser in _every_action():
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    watch_help = dict(_every_action())["watch"].format_help()
    for column in ("L ", "acc", "tok/step", "saved", "accept/pos", "seen", "drops"):
        assert column in watch_help


def test_vcap_selftest_without_torch_names_the_extra():
    # A sidecar-only install: torch cannot be imported in this process.
    script = ("import sys\n"
              "class NoTorch:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name.split('.')[0] == 'torch':\n"
              "            raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
              "sys.meta_path.insert(0, NoTorch())\n"
              "from vcap.engine_hook import cli\n"
              "sys.exit(cli.main(['selftest']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "pip install 'vcap[engine]'" in done.stderr and "Traceback" not in done.stderr


def test_watch_lines_cover_the_steps_since_the_line_before():
    from vcap.sidecar.vcapctl import _Counts, _format_stats

    def stats(steps, requests, live, accepted, tokens, saved, streamed):
        return pb.Stats(verify_steps=steps, rows_live=live, drafts_accepted=accepted, committed_tokens=tokens,
                        experts_saved=saved, experts_streamed=streamed,
                        mean_live_length=live / requests if requests else 0.0)

    first = stats(10, 80, 480, 100, 180, 0, 1000)            # off: six rows live per request
    later = stats(20, 160, 480 + 160, 100 + 60, 180 + 140, 300, 1000 + 700)   # then k=1
    assert " L 6.00 " in _format_stats(first) and "saved   0.0%" in _format_stats(first)
    line = _format_stats(later, _Counts.of(first))
    assert " L 2.00 " in line and " acc 0.75 " in line and "tok/step  14.00" in line and "saved  30.0%" in line
    assert " L 4.00 " in _format_stats(later)                 # --totals: since the sidecar started
    # no step in between: nothing to show; a sidecar restarted under the watch: its totals again
    assert " L    - " in _format_stats(later, _Counts.of(later))
    assert " L 6.00 " in _format_stats(first, _Counts.of(later))


@pytest.mark.parametrize("argv", [
    ["watch", "--interval-ms", "-1"], ["watch", "--interval-ms", "5000000000"], ["history", "--limit", "5000000000"],
    ["rollback", "--", "-1"], ["rollback", "99999999999999999999999"], ["set", "--k", "3", "--expected-generation", "-1"],
    ["--timeout", "0", "get"], ["--timeout", "nan", "get"], ["--timeout", "inf", "get"], ["--timeout", "-1", "get"]])
def test_out_of_range_numbers_are_usage_errors(argv, capsys):
    """Found by an outside review: each raised a ValueError traceback from the request's
    constructor, or (--timeout) was sent and reported as a sidecar that did not answer."""
    with pytest.raises(SystemExit) as exit:
        vcapctl.main(argv)
    assert exit.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_history_and_rejections_show_callers_text_escaped(capsys):
    """A reason or a caller name with a newline or an escape sequence cannot forge a history
    line nor hide text in the terminal (found by an outside review)."""
    forged = "routine)\n*   999  2026-12-03T07:00:00+0000  manual  admin  (approved\x1b[8m\u202e"
    history = pb.PolicyHistory(max_entries=10, entries=[pb.PolicyHistoryEntry(
        generation=1, source=pb.POLICY_SOURCE_MANUAL, who="ipv4:127.0.0.1:1\nforged", reason=forged,
        time_unix=1.0, policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2))])
    vcapctl._print_history(history, current=1)
    rejection = vcapctl._rejection_text(pb.PolicyRejection(generation=1, source=pb.POLICY_SOURCE_MANUAL,
                                                           who="x\ny", reason=forged, time_unix=1.0))
    out = capsys.readouterr().out + rejection
    assert "\x1b" not in out and "\u202e" not in out
    assert out.count("\n") == 3 and "999" not in out.splitlines()[2]   # header, the entry, its policy
    assert "\\n*   999" in out and "\\u001b[8m" in out


def test_sidecar_refuses_bad_ports_and_record_size_at_start():
    for config, message in ((dict(grpc_address="127.0.0.1:99999"), "--grpc expected HOST:PORT with a port in 0..65535"),
                            (dict(metrics_address="127.0.0.1:99999"), "--metrics expected HOST:PORT"),
                            (dict(record_max_bytes=-5), "--record-max-bytes must be at least 4096")):
        with pytest.raises(ValueError, match=message):
            SidecarConfig(**config)


@pytest.mark.parametrize("flags, message", [
    (["--state-dir", "/nonexistent/vcap-state"], "--state-dir /nonexistent/vcap-state: not a directory"),
    (["--grpc", "127.0.0.1:99999"], "--grpc expected HOST:PORT with a port in 0..65535"),
    (["--metrics", "127.0.0.1:99999"], "--metrics expected HOST:PORT"),
    (["--record-max-bytes", "-5"], "--record-max-bytes must be at least 4096"),
    (["--log-level", "BOGUS"], "invalid choice: 'BOGUS'"),
    (["--", "--load", "bursty"], "there is none without --simulate: --load bursty"),
    (["--simulate", "--", "--segment", "other"], "--segment after -- would give the simulated engine another"),
    (["--simulate", "--", "--dp-size=2"], "--dp-size after --")])
def test_vcap_sidecar_refuses_bad_flags_at_start(flags, message, segment_name):
    """One line and exit 2 at start, no traceback (found by an outside review: each started and
    failed later, quietly or with a traceback)."""
    result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name, *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_json_output_is_the_reply_and_parses(sidecar, capsys):
    # -o json: a script reads the reply's fields (proto names, enums by name); notes go to stderr
    import json

    enter("auto", sidecar, capsys)
    rc, out, err = ctl(sidecar, capsys, "-o", "json", "set", "--threshold", "0.3")
    state = json.loads(out)
    assert rc == 0 and out.count("\n") == 1
    assert state["generation"] == str(sidecar.control.state().generation)   # uint64: a string, as proto3 JSON says
    assert state["source"] == "POLICY_SOURCE_MANUAL" and state["control_mode"] == "CONTROL_MODE_MANUAL"
    assert state["policy"]["buckets"] and all(t == pytest.approx(0.3) for b in state["policy"]["buckets"]
                                              for t in b["thresholds"])
    assert "auto -> manual" in err
    rc, out, _ = ctl(sidecar, capsys, "-o", "json", "history", "--limit", "2")
    entries = json.loads(out)["entries"]
    assert rc == 0 and len(entries) == 2 and entries[0]["generation"] == state["generation"]
    rc, out, _ = ctl(sidecar, capsys, "-o", "json", "watch", "--count", "2", "--interval-ms", "100")
    assert rc == 0 and [json.loads(line)["engine_attached"] for line in out.splitlines()] == [True, True]


def test_version():
    for command in ("vcapctl", "vcap-sidecar"):
        result = subprocess.run([sys.executable, "-m", f"vcap.sidecar.{'vcapctl' if command == 'vcapctl' else 'cli'}",
                                 "--version"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.split()[0] == command
        assert result.stdout.split()[1][0].isdigit(), result.stdout
