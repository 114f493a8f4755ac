"""Tests of vcap-sim, the simulated engine. Every workload here is SYNTHETIC (vcap.engine_hook.workload)."""

import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from vcap.engine_hook import reference
from vcap.engine_hook.sim import SimConfig, SimulatedEngine, create_segment
from vcap.engine_hook.workload import LOAD_PATTERNS, AcceptanceModel, PairedTokenDraws, Router
from vcap.policy import Bucket, Policy, default_policy
from vcap.segment import (FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, FLAG_FALLBACK, MODE_CODES, RingReader, Segment,
                          segment_path)

# Small dimensions keep each synthetic step well under a millisecond.
SMALL = dict(max_bs=64, num_moe_layers=8, num_experts=64, top_k=4, mean_bs=24)
CONF_POLICY = Policy(mode="conf", fixed_k=5, explore_period=5, buckets=(
    Bucket(1, 1, 5, (0.5, 0.35, 0.2, 0.1, 0.05)),
    Bucket(20, 1, 3, (0.6, 0.45, 0.3, 0.2, 0.1)),
))


@pytest.fixture
def engine_and_sidecar(segment_name):
    """A synthetic engine on a real segment (engine-time clock) and the sidecar's handle."""
    config = SimConfig(**SMALL, fallback_mode="conf")
    segment = create_segment(segment_name, config)
    sidecar = Segment.attach(segment_name)
    try:
        yield SimulatedEngine(config, segment), sidecar
    finally:
        sidecar.close()
        segment.unlink()
        segment.close()


def run_steps(engine, num_steps, sidecar=None):
    """Step the engine, renewing the lease first when a sidecar is given."""
    records = []
    for _ in range(num_steps):
        if sidecar is not None:
            sidecar.heartbeat[0] += 1
        records.append(engine.step())
    return np.concatenate(records)


def test_config_rejects_bad_values():
    for bad in (dict(accept_first=0.05, accept_last=0.5), dict(mean_bs=0), dict(peak_bs=0),
                dict(load="spiky"), dict(fallback_mode="auto"), dict(top_k=500), dict(router_skew=-1)):
        with pytest.raises(ValueError):
            SimConfig(**bad)


def test_subprocess_runs_steps_and_unlinks(segment_name):
    done = subprocess.run([sys.executable, "-m", "vcap.engine_hook.sim", "--segment", segment_name,
                           "--steps", "20", "--time-scale", "0", "--layers", "4", "--max-bs", "32",
                           "--mean-bs", "8"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "SYNTHETIC" in done.stdout and "stopped after 20 steps" in done.stdout
    assert not os.path.exists(segment_path(segment_name))


def test_subprocess_segment_is_private_and_removed_on_sigterm(segment_name):
    path = segment_path(segment_name)
    process = subprocess.Popen([sys.executable, "-m", "vcap.engine_hook.sim", "--segment", segment_name,
                                "--steps", "1000000", "--time-scale", "0.05", "--log-every", "0",
                                "--layers", "4", "--max-bs", "32", "--mean-bs", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        sidecar = Segment.attach(segment_name)
        assert sidecar.engine_pid == process.pid
        reader = RingReader(sidecar, 0, from_start=True)
        while len(records := reader.read()) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert records["bs"].min() >= 1 and int(sidecar.status_u64[3]) >= 1
        sidecar.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert not os.path.exists(path)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_dp_ranks_each_create_a_segment_follow_their_own_policy_and_state_the_dispatch_row(segment_name):
    """``--dp-size 2``: ``<segment>`` and ``<segment>-dp1``, each with its own requests, policy and
    records, the dispatch row size in each header; both removed at the end."""
    names = [segment_name, f"{segment_name}-dp1"]
    process = subprocess.Popen([sys.executable, "-m", "vcap.engine_hook.sim", "--segment", segment_name,
                                "--dp-size", "2", "--dispatch-row-bytes", "7296", "--steps", "1000000",
                                "--time-scale", "0.05", "--log-every", "0", "--layers", "4", "--max-bs", "32",
                                "--mean-bs", "8", "--lease-ms", "60000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not all(os.path.exists(segment_path(name)) for name in names) and time.monotonic() < deadline:
            time.sleep(0.02)
        segments = [Segment.attach(name) for name in names]
        assert [s.config.dispatch_row_bytes for s in segments] == [7296, 7296]
        # only rank 1 is told to cut at one draft: rank 0 keeps its fallback (every row live)
        segments[1].write_policy(Policy(mode="fixed", fixed_k=1, buckets=default_policy().buckets), 5, "manual")
        segments[1].heartbeat[0] += 1
        readers = [RingReader(segment, 0) for segment in segments]
        seen = [[], []]
        while not all(len(r) > 20 for r in seen) and time.monotonic() < deadline:
            for rank, reader in enumerate(readers):
                records = reader.read()
                seen[rank].extend(records[records["generation"] == (5 if rank else 0)])
            time.sleep(0.02)
        seen[0].extend(readers[0].read())   # rank 0 up to the steps rank 1 reached
        first, second = (np.array(records) for records in seen)
        assert all((r["live"][:r["bs"]] == 6).all() for r in first)
        assert all((r["live"][:r["bs"]] == 2).all() for r in second)
        # each rank its own requests: the same step of the two ranks has other confidences
        ranks = [{int(r["step"]): r for r in records} for records in (first, second)]
        steps = ranks[0].keys() & ranks[1].keys()
        assert len(steps) > 10
        assert not any(np.array_equal(ranks[0][step]["confidence"], ranks[1][step]["confidence"]) for step in steps)
        for segment in segments:
            segment.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert not any(os.path.exists(segment_path(name)) for name in names)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for name in names[1:]:
            if os.path.exists(segment_path(name)):
                os.unlink(segment_path(name))


def test_records_follow_reference_rule(engine_and_sidecar):
    engine, sidecar = engine_and_sidecar
    sidecar.write_policy(CONF_POLICY, 7, "manual")
    run_steps(engine, 40, sidecar)
    records = RingReader(sidecar, 0, from_start=True).read()
    assert len(records) == 40 and list(records["step"]) == list(range(40))
    stride = engine.config.stride
    for record in records:
        bs = int(record["bs"])
        explore = bool(record["flags"] & FLAG_EXPLORE)
        assert explore == (record["step"] % CONF_POLICY.explore_period == 0)
        assert record["generation"] == 7 and record["mode"] == MODE_CODES["conf"]
        assert not record["flags"] & FLAG_FALLBACK
        expected = reference.live_lengths(record["confidence"][:bs], CONF_POLICY, bs, stride, explore)
        np.testing.assert_array_equal(record["live"][:bs], expected)
        assert np.all(record["accepted"][:bs] <= record["live"][:bs] - 1)
        assert not record["confidence"][bs:].any() and not record["live"][bs:].any()
    assert (records["live"] < stride).any(), "the synthetic conf policy never cut a draft"
    assert int(sidecar.status_u64[0]) == 40 and int(sidecar.status_u64[3]) == 40
    assert int(sidecar.status_u32[2]) == 0


def test_generation_follows_written_policy(engine_and_sidecar):
    engine, sidecar = engine_and_sidecar
    sidecar.write_policy(Policy("fixed", 2, CONF_POLICY.buckets), 1, "manual")
    first = run_steps(engine, 5, sidecar)
    sidecar.write_policy(CONF_POLICY, 2, "auto")
    second = run_steps(engine, 5, sidecar)
    assert set(first["generation"]) == {1} and set(second["generation"]) == {2}
    for record in first:
        assert np.all(record["live"][:record["bs"]] == 3)


def test_fallback_after_lease_expires(engine_and_sidecar):
    engine, sidecar = engine_and_sidecar
    sidecar.write_policy(Policy("fixed", 1, CONF_POLICY.buckets), 4, "manual")
    lease_ns = engine.config.lease_ms * 1_000_000
    records = run_steps(engine, 120)  # no heartbeat
    started_ns = records["time_ns"] - records["step_ns"]  # the policy is read at the step's start
    fallback = (records["flags"] & FLAG_FALLBACK) != 0
    assert fallback.any() and not fallback.all()
    first = int(np.argmax(fallback))
    assert fallback[first:].all()
    assert started_ns[first] > lease_ns >= started_ns[first - 1]
    assert set(records["generation"][:first]) == {4} and set(records["generation"][first:]) == {0}
    after = records[first:]
    assert set(after["mode"]) == {MODE_CODES["conf"]}  # the segment's fallback, all drafts live
    assert all(np.all(r["live"][:r["bs"]] == engine.config.stride) for r in after)
    assert int(sidecar.status_u32[2]) == 1
    resumed = run_steps(engine, 1, sidecar)
    assert resumed["generation"][0] == 4 and not resumed["flags"][0] & FLAG_FALLBACK
    assert int(sidecar.status_u32[2]) == 0


def test_synthetic_acceptance_decays_along_the_block():
    config = SimConfig(**{**SMALL, "mean_bs": 64}, request_spread=0.0, seed=3)
    engine = SimulatedEngine(config)
    records = run_steps(engine, 150)
    accepted = np.concatenate([r["accepted"][:r["bs"]] for r in records]).astype(np.int64)
    base = engine.acceptance.base_accept
    assert np.all(np.diff(base) < 0) and base[0] == pytest.approx(0.75) and base[-1] == pytest.approx(0.08)
    for position, expected in enumerate(base):
        reached = int((accepted >= position).sum())
        measured = (accepted >= position + 1).sum() / reached
        tolerance = 4 * np.sqrt(expected * (1 - expected) / reached) + 0.01
        assert abs(measured - expected) < tolerance, (position, measured, expected)


def test_accepted_capped_by_fixed_policy():
    engine = SimulatedEngine(SimConfig(**SMALL, accept_first=0.95, accept_last=0.9))
    engine.set_policy(Policy("fixed", 2, CONF_POLICY.buckets), generation=3)
    records = run_steps(engine, 30)
    accepted = np.concatenate([r["accepted"][:r["bs"]] for r in records])
    assert accepted.max() == 2 and set(records["generation"]) == {3}


def test_capped_policy_streams_fewer_experts_and_step_time_follows_cost_model():
    config = SimConfig(**SMALL, seed=5)
    off, capped = SimulatedEngine(config), SimulatedEngine(config)
    capped.set_policy(Policy("fixed", 1, CONF_POLICY.buckets))
    off_records, capped_records = run_steps(off, 30), run_steps(capped, 30)
    for records in (off_records, capped_records):
        assert np.all(records["flags"] & FLAG_EXPERTS_SAMPLED)
        assert np.all(records["experts_live"] <= records["experts_all"])
        assert np.all(records["experts_live"] >= config.top_k)
        moe_us = config.num_moe_layers * config.moe_a_us + config.moe_b_us * records["experts_live"].sum(axis=1)
        np.testing.assert_allclose(records["step_ns"], moe_us * 1e3 + config.other_ms * 1e6, atol=1)
    np.testing.assert_array_equal(off_records["experts_live"], off_records["experts_all"])
    assert capped_records["experts_live"].sum() < 0.8 * off_records["experts_live"].sum()
    assert capped_records["step_ns"].mean() < off_records["step_ns"].mean()
    assert off.engine_time_ns == off_records["step_ns"].sum()


def test_experts_only_on_sampled_steps():
    engine = SimulatedEngine(SimConfig(**SMALL, expert_sample_period=3))
    records = run_steps(engine, 9)
    sampled = records["step"] % 3 == 0
    assert np.array_equal((records["flags"] & FLAG_EXPERTS_SAMPLED) != 0, sampled)
    assert records["experts_all"][sampled].all() and not records["experts_all"][~sampled].any()


@pytest.mark.parametrize("load", LOAD_PATTERNS)
def test_synthetic_load_keeps_bs_in_range(load):
    # 50 ms per step and short requests: the pool follows the pattern within a few steps
    config = SimConfig(max_bs=32, num_moe_layers=1, num_experts=16, top_k=2, mean_bs=4, shift_bs=28,
                       peak_bs=28, shift_after_s=5, period_s=10, mean_output_tokens=8, other_ms=50,
                       load=load)
    engine = SimulatedEngine(config)
    records = run_steps(engine, 400)
    assert records["bs"].min() >= 1 and records["bs"].max() <= config.max_bs
    started_s = (records["time_ns"] - records["step_ns"]) / 1e9
    demand = np.array([engine.load.demand(t) for t in started_s])
    if load == "steady":
        assert abs(records["bs"].mean() - 4) < 1.5
    else:
        assert np.corrcoef(demand, records["bs"])[0, 1] > 0.8


def test_queue_builds_when_demand_exceeds_max_bs():
    config = SimConfig(max_bs=16, num_moe_layers=1, num_experts=16, top_k=2, mean_bs=24)
    records = run_steps(SimulatedEngine(config), 200)
    assert records["bs"].max() == 16 and records["num_queued"].max() > 0


def test_same_seed_same_trace_and_rings_step_together(segment_name):
    config = SimConfig(**SMALL, num_rings=2, seed=11)
    first, second = run_steps(SimulatedEngine(config), 20), run_steps(SimulatedEngine(config), 20)
    assert first.tobytes() == second.tobytes()
    by_ring = first.reshape(20, 2)
    assert np.array_equal(by_ring["step"][:, 0], by_ring["step"][:, 1])
    assert not np.array_equal(by_ring["bs"][:, 0], by_ring["bs"][:, 1])
    segment = create_segment(segment_name, config)
    try:
        engine = SimulatedEngine(config, segment)
        run_steps(engine, 5)
        assert [segment.ring_next_record(ring) for ring in (0, 1)] == [5, 5]
        assert engine.engine_time_ns == by_ring["step_ns"][:5].max(axis=1).sum()
    finally:
        segment.unlink()
        segment.close()


def test_jitter_seed_draws_other_step_time_noise_and_nothing_else():
    # runs of one seed that differ only in their step-time noise, as runs on a GPU do
    def steps(**knobs):
        return run_steps(SimulatedEngine(SimConfig(**SMALL, seed=11, **knobs)), 30)

    assert steps(jitter_seed=4).tobytes() == steps().tobytes()          # no jitter: nothing to draw
    first, again, other = steps(step_noise=0.05), steps(step_noise=0.05, jitter_seed=0), steps(step_noise=0.05, jitter_seed=4)
    assert first.tobytes() == again.tobytes()
    assert not np.array_equal(first["step_ns"], other["step_ns"])
    # the same draws of load and acceptance; the load follows engine time, so the noise moves the
    # later batches too (which is how two runs on a GPU drain apart)
    for field in ("bs", "accepted"):
        assert np.array_equal(first[field][:5], other[field][:5])
    assert not np.array_equal(first["bs"], other["bs"])
    with pytest.raises(ValueError, match="jitter_seed"):
        SimConfig(jitter_seed=-1)


def _request_shifts(engine, count: int) -> list:
    """The logit shifts of the first ``count`` requests the engine runs (bs 1), in order."""
    shifts = []
    while len(shifts) < count:
        engine.step()
        shift = float(engine.pools[0].logit_shift[0])
        if not shifts or shifts[-1] != shift:
            shifts.append(shift)
    return shifts


@pytest.mark.parametrize("paired", [False, True])
def test_paired_requests_give_every_policy_the_same_requests(paired):
    # one request at a time: all-live and k=1 take different numbers of steps per request, so
    # unpaired draws hand them other requests; paired draws the same n-th request
    config = SimConfig(**{**SMALL, "mean_bs": 1}, load_noise=0.0, seed=3, mean_output_tokens=20, paired_requests=paired)
    runs = []
    for policy in (default_policy(5), Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),))):
        engine = SimulatedEngine(config)
        engine.set_policy(policy)
        runs.append(_request_shifts(engine, 12))
    assert (runs[0] == runs[1]) == paired


def test_paired_token_draws_follow_the_token_not_the_step():
    draws = PairedTokenDraws(seed=3, pool=0)
    # request 7 at token 10, then (another policy, another step) at token 12; request 8 at token 10
    a = draws.at(np.array([7, 8]), np.array([10, 10]), 5)
    b = draws.at(np.array([7]), np.array([12]), 5)
    np.testing.assert_array_equal(a.random((2, 5))[0, 2:], b.random((1, 5))[0, :3])
    np.testing.assert_array_equal(a.normal(0.0, 1.0, (2, 5))[0, 2:], b.normal(0.0, 1.0, (1, 5))[0, :3])
    assert not np.isin(a.random((2, 5))[1], a.random((2, 5))[0]).any()       # another request, other draws
    assert not np.array_equal(PairedTokenDraws(seed=4, pool=0).at(np.array([7]), np.array([10]), 5).random((1, 5)),
                              a.random((2, 5))[:1])
    with pytest.raises(ValueError, match="keyed to"):
        a.random((3, 5))


def test_paired_token_draws_keep_the_acceptance_model():
    # the keyed draws stand in for a generator: uniform and normal, independent across drafts,
    # tokens and streams, so the acceptance rates and the confidence noise are the model's
    rows = 40_000
    step = PairedTokenDraws(seed=11, pool=1).at(np.arange(rows) // 8, (np.arange(rows) % 8) * 5, 5)
    uniform, normal = step.random((rows, 5)), step.normal(0.0, 1.0, (rows, 5))
    assert abs(uniform.mean() - 0.5) < 0.005 and abs(uniform.var() * 12 - 1) < 0.02
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01
    assert np.abs(np.corrcoef(np.hstack([uniform, normal]).T) - np.eye(10)).max() < 0.02
    model = AcceptanceModel(5, 0.8, 0.2, 1.0, 0.0, 0.5)
    true_accept = model.true_accept(np.zeros(rows))
    accepted = model.accepted_drafts(true_accept, step)
    expected = np.cumprod(true_accept[0])   # draft j accepted with all before it
    observed = np.array([(accepted > j).mean() for j in range(5)])
    np.testing.assert_allclose(observed, expected, atol=0.01)


def test_pool_tracks_each_requests_id_and_position():
    config = SimConfig(**SMALL, seed=5, mean_output_tokens=30, paired_requests=True)
    engine = SimulatedEngine(config)
    engine.set_policy(default_policy(5))
    pool, committed = engine.pools[0], {}
    for _ in range(200):
        before = dict(zip(pool.request_id[:pool.num_running].tolist(), pool.position[:pool.num_running].tolist()))
        engine.step()
        running = pool.request_id[:pool.num_running].tolist()
        assert len(set(running)) == len(running) and running == sorted(running)   # admission order, compacted
        for request, position in zip(running, pool.position[:pool.num_running].tolist()):
            assert position > before.get(request, 0)   # every running request commits a token a step
            committed[request] = position
    assert pool.num_admitted > pool.num_running > 0 and max(committed) < pool.num_admitted


def test_router_distinct_matches_reference_and_popularity():
    rng = np.random.default_rng(0)
    router = Router(num_layers=3, num_experts=32, top_k=4, skew=1.0, rng=rng)
    ids = router.route(500, rng)
    assert ids.shape == (3, 500, 4) and ids.min() >= 0 and ids.max() < 32
    rows = rng.random(500) < 0.3
    for layer in range(3):
        assert router.distinct_per_layer(ids)[layer] == reference.distinct_experts(ids[layer])
        assert router.distinct_per_layer(ids, rows)[layer] == reference.distinct_experts(ids[layer], rows)
    assert (np.sort(ids, axis=2)[:, :, 1:] == np.sort(ids, axis=2)[:, :, :-1]).any(axis=2).mean() < 0.01
    single = Router(num_layers=1, num_experts=32, top_k=1, skew=1.0, rng=rng)
    frequency = np.bincount(single.route(100_000, rng).ravel(), minlength=32) / 100_000
    np.testing.assert_allclose(frequency, single.probability[0], atol=0.005)


def test_control_latency_bench_counts_every_change_on_the_modelled_engine():
    """bench/bench_control_latency.py through a real sidecar process and vcap-sim (counts only:
    timings on a shared CI machine say nothing)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_control_latency
    result = bench_control_latency.main(["--changes", "6", "--gap-ms", "20,40", "--warmup-steps", "5",
                                         "--start-timeout", "60", "--", "--time-scale", "0.05", "--mean-bs", "8"])
    assert result["changes"] == result["measured"] == 6 and result["missed"] == 0
    assert sum(result["steps"]["histogram"].values()) == 6
    assert result["ring_records_checked"] > 0 and result["ring_generation_mismatches"] == 0
    assert result["engine_steps"] > 5


def test_control_latency_analysis_finds_the_first_step_of_each_generation():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from bench_control_latency import analyse
    # step, generation, read_ns, done_ns
    log = np.array([[0, 0, 0, 10], [1, 0, 10, 20], [2, 1, 20, 30], [3, 1, 30, 40], [4, 3, 40, 50]])
    result = analyse([(1, 15), (2, 25), (3, 35), (4, 45)], log)
    assert result["measured"] == 3 and result["missed"] == 1
    # generation 1 returned at 15: step 2 (read 20) is the first to use it, 1 step after
    # generation 2 returned at 25: skipped, first step with >= 2 is step 4 (read 40): steps 3 and 4
    # generation 3 returned at 35: step 4 again, the next to start
    assert result["steps"]["histogram"] == {"1": 2, "2": 1}
    assert result["used_ms"]["max"] == pytest.approx((50 - 25) / 1e6)
