"""The GPU engine's code path on the CPU with tiny dims (hook kernels under Triton's interpreter,
plain-torch MoE), and, on a GPU, SGLang's MoE kernels against the torch reference."""

import os

import numpy as np
import pytest
import torch

from vcap.engine_hook.gpu_engine import (PRESETS, GpuSimulatedEngine, GpuStep, MoEPreset, align_blocks,
                                         moe_reference)
from vcap.engine_hook.sim import SimConfig
from vcap.policy import Bucket, Policy
from vcap.segment import RingReader, Segment, SegmentConfig


# the hook's Triton kernels run on CPU tensors only under the interpreter (not on a CUDA machine)
cpu_path = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _segment(name, preset, run_layers=1, max_bs=4):
    return Segment.create(name, SegmentConfig(stride=6, max_bs=max_bs, num_moe_layers=run_layers,
                                              num_experts=preset.num_experts, top_k=preset.top_k,
                                              expert_sample_period=1, lease_ms=60_000))


def _engine_config(preset, **workload):
    """A steady bs-3 workload on :func:`_segment`'s dims with one MoE layer."""
    return SimConfig(stride=6, max_bs=4, num_moe_layers=1, num_experts=preset.num_experts, top_k=preset.top_k,
                     expert_sample_period=1, lease_ms=60_000, mean_bs=3, load_noise=0.0, **workload)


@pytest.mark.parametrize("num_rows, num_experts, block_m", [(12, 16, 4), (7, 5, 16), (1, 3, 2)])
def test_align_blocks_groups_every_live_pair_by_expert(num_rows, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_rows)
    ids = torch.randint(0, num_experts, (num_rows, 2), generator=gen, dtype=torch.int32)
    ids[::3] = -1  # dropped rows
    sorted_ids, expert_ids, post_padded = align_blocks(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    numel, total = flat.numel(), int(post_padded)
    assert total % block_m == 0 and total <= sorted_ids.numel()
    for block, expert in enumerate(expert_ids.tolist()):
        pairs = sorted_ids[block * block_m:(block + 1) * block_m].tolist()
        real = [p for p in pairs if p < numel]
        if block * block_m >= total:
            continue
        assert expert >= 0 and all(int(flat[p]) == expert for p in real)
    placed = sorted(p for p in sorted_ids[:total].tolist() if p < numel)
    assert placed == sorted(torch.nonzero(flat >= 0).flatten().tolist())


def test_moe_reference_ignores_dropped_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen)
    w13, w2 = torch.randn(4, 6, 8, generator=gen), torch.randn(4, 8, 3, generator=gen)
    ids = torch.tensor([[0, 1], [-1, -1], [2, 3]], dtype=torch.int32)
    out = moe_reference(x, w13, w2, ids, torch.full((3, 2), 0.5))
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0]) > 0


@cpu_path
def test_gpu_step_on_cpu_follows_the_segment_policy(segment_name):
    preset = PRESETS["tiny"]
    segment = _segment(segment_name, preset, run_layers=2)
    try:
        step = GpuStep(segment, preset, run_layers=2, routing="zipf:1.2", other_ms=0.0, device="cpu")
        reader = RingReader(segment, 0)
        confidence = np.full((4, 5), 0.9, dtype=np.float32)
        uncapped = np.array([5, 0, 3, 1])
        live, accepted, generation, _ = step.run(4, confidence, uncapped)
        assert generation == 0 and live.tolist() == [6] * 4 and accepted.tolist() == [5, 0, 3, 1]
        segment.write_policy(Policy("fixed", 2, (Bucket(1, 1, 5, (0.0,) * 5),)), 1, "manual")
        segment.heartbeat[0] += 1
        live, accepted, generation, _ = step.run(3, confidence, uncapped)
        assert generation == 1 and live.tolist() == [3] * 3 and accepted.tolist() == [2, 0, 2]
        # dead rows got no experts: rows 3..5 of every request are -1 in every layer
        ids = step.ids[:, :18].reshape(2, 3, 6, preset.top_k)
        assert (ids[:, :, 3:] == -1).all() and (ids[:, :, :3] >= 0).all()
        step.hook.flush()
        records = reader.read()
        assert [int(r["generation"]) for r in records] == [0, 1]
        assert int(records[1]["bs"]) == 3 and records[1]["accepted"][:3].tolist() == [2, 0, 2]
        assert (records[1]["experts_live"] <= records[1]["experts_all"]).all()
        step.close()
    finally:
        segment.unlink()


@cpu_path
def test_gpu_simulated_engine_on_cpu_commits_tokens(segment_name):
    preset = PRESETS["tiny"]
    segment = _segment(segment_name, preset)
    try:
        config = _engine_config(preset)
        engine = GpuSimulatedEngine(config, segment, GpuStep(segment, preset, run_layers=1, device="cpu"))
        records = [engine.step()[0] for _ in range(3)]
        assert [int(r["bs"]) for r in records] == [3, 3, 3]
        assert all(int(r["step_ns"]) > 0 for r in records)
        engine.close()
    finally:
        segment.unlink()


@cpu_path
def test_gpu_simulated_engine_stamps_its_ring_records_with_engine_time(segment_name):
    preset = PRESETS["tiny"]
    segment = _segment(segment_name, preset)
    try:
        config = _engine_config(preset)
        step = GpuStep(segment, preset, run_layers=1, device="cpu")
        reader = RingReader(segment, 0)
        earlier = GpuSimulatedEngine(config, segment, step)
        earlier.step()   # a step of another engine on the same hook: its record is not this engine's
        engine = GpuSimulatedEngine(config, segment, step)
        ends = []
        for _ in range(4):
            engine.step()
            ends.append(engine.engine_time_ns)
        step.hook.flush()
        raw = reader.read()
        stamped = engine.on_engine_clock(raw)
        assert len(raw) == 5 and len(stamped) == 4
        assert stamped["time_ns"].tolist() == ends            # each step's end on the engine's clock
        assert stamped["step"].tolist() == raw["step"][1:].tolist()
        assert len(engine.on_engine_clock(raw)) == 0          # stamped once
        step.close()
    finally:
        segment.unlink()


def test_step_checks_its_segment(segment_name):
    preset = PRESETS["tiny"]
    segment = _segment(segment_name, preset, run_layers=1)
    try:
        with pytest.raises(ValueError, match="does not match"):
            GpuStep(segment, MoEPreset(32, 2, 64, 32, 4), run_layers=1, device="cpu")
        with pytest.raises(ValueError, match="routing"):
            GpuStep(segment, preset, run_layers=1, routing="pareto", device="cpu")
    finally:
        segment.unlink()


def _require_sglang_kernels():
    from vcap.engine_hook.gpu_engine import _sgl_kernels
    try:
        _sgl_kernels()
    except ImportError as error:
        pytest.skip(f"SGLang's fused-MoE kernels: neither vendored (bench/vendor_sgl.py) nor installed ({error})")


@pytest.mark.gpu
def test_sglang_moe_kernels_match_the_reference(segment_name):
    from vcap.engine_hook.gpu_engine import _SglMoE
    _require_sglang_kernels()
    preset = MoEPreset(16, 2, 256, 128, 4)
    gen = torch.Generator().manual_seed(0)
    rows = 24
    x = (torch.randn(rows, 256, generator=gen) * 0.5).cuda().bfloat16()
    w13 = (torch.randn(16, 256, 256, generator=gen) * 0.05).cuda().bfloat16()
    w2 = (torch.randn(16, 256, 128, generator=gen) * 0.05).cuda().bfloat16()
    ids = torch.randint(0, 16, (rows, 2), generator=gen, dtype=torch.int32)
    ids[ids[:, 0] == ids[:, 1], 1] = (ids[ids[:, 0] == ids[:, 1], 0] + 1) % 16
    ids[5::6] = -1
    ids = ids.cuda()
    weights = torch.rand(rows, 2, generator=gen).cuda()
    weights[5::6] = 0
    out = torch.empty(rows, 256, device="cuda", dtype=torch.bfloat16)
    got = _SglMoE(preset, rows, "cuda")(x, w13, w2, ids, weights, out).float()
    want = moe_reference(x.float(), w13.float(), w2.float(), ids, weights).float()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


@pytest.mark.gpu
def test_gpu_step_graph_replays_follow_the_policy(segment_name):
    _require_sglang_kernels()
    preset = MoEPreset(32, 6, 256, 128, 43)
    segment = _segment(segment_name, preset, run_layers=2, max_bs=8)
    try:
        step = GpuStep(segment, preset, run_layers=2, routing="uniform", other_ms=1.0)
        confidence = np.full((8, 5), 0.9, dtype=np.float32)
        live, _, _, device_ns = step.run(8, confidence, np.full(8, 5))
        assert live.tolist() == [6] * 8 and device_ns > 0
        segment.write_policy(Policy("fixed", 1, (Bucket(1, 1, 5, (0.0,) * 5),)), 7, "manual")
        segment.heartbeat[0] += 1
        live, accepted, generation, _ = step.run(8, confidence, np.full(8, 5))
        assert generation == 7 and live.tolist() == [2] * 8 and accepted.tolist() == [1] * 8
        step.close()
    finally:
        segment.unlink()


def test_device_presets_are_the_engine_presets():
    from vcap.engine_hook.sim_cli import DEVICE_PRESETS
    assert sorted(DEVICE_PRESETS) == sorted(PRESETS)


def test_sidecar_simulate_device_cpu_follows_set_policy(segment_name, tmp_path):
    """``vcap-sidecar --simulate -- --device cpu``: the GPU engine's code path (hook, router, MoE,
    tiny dims) in its own process; a SetPolicy over gRPC changes the live lengths it runs."""
    import subprocess
    import sys

    import grpc

    from vcap.sidecar.convert import policy_to_proto
    from vcap.v1 import controller_pb2 as pb
    from vcap.v1 import controller_pb2_grpc as pb_grpc

    from .utils import free_port, wait_until

    port = free_port()
    step_log = tmp_path / "steps.csv"
    log = open(tmp_path / "sidecar.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vcap.sidecar.cli", "--simulate", "--segment", segment_name,
         "--grpc", f"127.0.0.1:{port}", "--metrics", "", "--", "--device", "cpu", "--max-bs", "4",
         "--mean-bs", "3", "--load-noise", "0", "--time-scale", "0", "--log-every", "0", "--sample-period", "1",
         "--step-log", str(step_log)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            state = wait_until(lambda: (s := stub.GetPolicy(pb.GetPolicyRequest())).engine_attached and s, 120,
                               "engine attached", ignore=(OSError, grpc.RpcError))
            assert state.num_drafts == 5 and state.max_bs == 4
            engine = Segment.attach(segment_name)
            assert (engine.config.num_moe_layers, engine.config.num_experts, engine.config.top_k) == (2, 16, 2)
            ring = RingReader(engine, 0)
            seen = []

            def records_of(generation):
                records = ring.read()
                seen.extend(r for r in records if int(r["generation"]) == generation)
                return len(seen) >= 2

            wait_until(lambda: records_of(0), 120, "records under the engine's own policy")
            assert all(r["live"][:int(r["bs"])].tolist() == [6] * int(r["bs"]) for r in seen)
            for k in (2, 1):
                policy = Policy("fixed", k, (Bucket(1, 1, 5, (0.0,) * 5),))
                reply = stub.SetPolicy(pb.SetPolicyRequest(policy=policy_to_proto(policy), reason="test"))
                seen.clear()
                wait_until(lambda: records_of(int(reply.generation)), 120, f"records of generation {reply.generation}")
                for r in seen:
                    bs = int(r["bs"])
                    assert bs == 3 and r["live"][:bs].tolist() == [k + 1] * bs
                    assert (r["accepted"][:bs] <= k).all()
                    assert (r["experts_live"] <= r["experts_all"]).all()
            engine.close()
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
        print((tmp_path / "sidecar.log").read_text()[-3000:])
    lines = step_log.read_text().splitlines()
    assert lines[0] == "step,generation,read_ns,done_ns" and len(lines) > 4


def _eval_controller_on_a_tiny_loop():
    """bench/eval_controller.py and a ``bench_loop.Loop`` of tiny dims (the GPU engine on the CPU)."""
    import argparse
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path.insert(0, bench)
    try:
        import bench_loop
        import eval_controller
    finally:
        sys.path.remove(bench)
    return eval_controller, bench_loop.Loop(argparse.Namespace(preset="tiny", run_layers=1, other_ms=0.0, max_bs=8))


@cpu_path
def test_eval_controller_runs_a_trace_on_the_gpu_engine():
    # bench/eval_controller.py --device cuda's path on the CPU with tiny dims: the policy a run
    # writes reaches the hook through the loop's segment (k=2: 3 live rows per request; auto
    # starts from every row live), and the trace's accounting comes from the GPU engine's steps
    eval_controller, loop = _eval_controller_on_a_tiny_loop()
    try:
        trace = dict(load="steady", mean_bs=4, load_noise=0.0, accept_first=0.8, accept_last=0.2,
                     router_skew=1.5, moe_b_us=5.0, seconds=0.003)   # moe_b_us: modelled, not used here
        capped = eval_controller.run_trace(trace, eval_controller.STATIC["k=2"], seed=1, loop=loop)
        auto = eval_controller.run_trace(trace, None, seed=1, loop=loop)
    finally:
        loop.close()
    for result, live_per_request in ((capped, 3), (auto, 6)):
        second = result["second"]
        assert result["steps"] > 10 and second["requests"][0] == 4 * result["steps"]
        assert second["live"][0] == live_per_request * second["requests"][0]
        assert result["tokens"] > second["requests"][0]   # one token per request-step, plus accepted drafts
    assert capped["given_up"] > 0 and auto["given_up"] == 0   # the cap gave up accepted drafts; all-live none


@cpu_path
def test_eval_controller_replays_a_schedule_on_the_gpu_engine():
    # eval_controller's runs from auto's state on the GPU engine: each scheduled policy reaches the
    # hook through the loop's segment at its step (k=2 for 6 steps: 3 live rows a request; then k=1: 2)
    eval_controller, loop = _eval_controller_on_a_tiny_loop()
    try:
        trace = dict(load="steady", mean_bs=4, load_noise=0.0, accept_first=0.8, accept_last=0.2,
                     router_skew=1.5, seconds=0.003)
        static = eval_controller.STATIC
        run = eval_controller.run_trace(trace, None, seed=1, loop=loop, schedule=[(0, static["k=2"]), (6, static["k=1"])])
    finally:
        loop.close()
    second = run["second"]
    assert run["steps"] > 10 and run["writes"] == [] and second["requests"][0] == 4 * run["steps"]
    assert second["live"][0] == 4 * (3 * 6 + 2 * (run["steps"] - 6))


def _routes_alike_from_the_seed(segment_name, preset, device):
    # two runs of one trace draw the same SYNTHETIC routing while their batch sizes agree (on the
    # GPU inside the CUDA graphs), so the routing's noise is not part of two rules' step times apart
    segment = _segment(segment_name, preset)
    try:
        step = GpuStep(segment, preset, run_layers=1, routing="zipf:1.2", device=device)

        def routed(seed):
            engine = GpuSimulatedEngine(_engine_config(preset, seed=seed, paired_requests=True), segment, step)
            ids = []
            for _ in range(3):
                engine.step()
                ids.append(step.ids.clone())
            torch.rand(100, device=device)   # draws between runs do not leak into the next one
            return torch.stack(ids)

        first = routed(1)
        assert torch.equal(routed(1), first)
        assert not torch.equal(routed(2), first)
        step.close()
    finally:
        segment.unlink()


@cpu_path
def test_paired_gpu_engines_route_alike_from_their_seed(segment_name):
    _routes_alike_from_the_seed(segment_name, PRESETS["tiny"], "cpu")


@pytest.mark.gpu
def test_paired_gpu_engines_route_alike_in_cuda_graphs(segment_name):
    _require_sglang_kernels()
    _routes_alike_from_the_seed(segment_name, MoEPreset(32, 6, 256, 128, 43), "cuda")
