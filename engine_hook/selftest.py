"""``vcap selftest``: map a test segment, replay the hook's kernels (snapshot + live lengths,
routers with dead rows, telemetry) in a CUDA graph while a second process rewrites the policy,
and check every step against the reference rule. Without CUDA the same kernels run under
Triton's interpreter, eagerly (no graph), with fewer steps.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vcap.segment import RingReader, Segment, SegmentConfig, encode_policy

from . import reference
from ._writer import policy_for
from .router import route
from .step import VerifyHook

__all__ = ["SelftestConfig", "run_selftest"]


@dataclass(slots=True)
class SelftestConfig:
    """What the selftest runs; the defaults are DeepSeek-V4.1-like (384 experts, top-6)."""

    steps: int = 3000
    writes: int = 1_000_000
    write_period_us: float = 50.0
    max_bs: int = 16
    stride: int = 6
    layers: int = 3
    num_experts: int = 384
    top_k: int = 6
    num_expert_group: int = 8
    topk_group: int = 4
    strategy: str = "drop"
    path: str = "staged"
    sample_period: int = 4
    device: str | None = None
    failures: list = field(default_factory=list)

    def __post_init__(self):
        if self.steps < 1 or self.writes < 1 or self.max_bs < 1 or self.layers < 1:
            raise ValueError("steps, writes, max_bs and layers must be >= 1")
        if self.strategy not in ("drop", "anchor"):
            raise ValueError(f"strategy must be 'drop' or 'anchor', got {self.strategy!r}")
        if self.path not in ("staged", "mapped"):
            raise ValueError(f"path must be 'staged' or 'mapped', got {self.path!r}")


def _start_writer(name: str, config: SelftestConfig) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, "-m", "vcap.engine_hook._writer", name, str(config.writes),
                             str(config.write_period_us)], stdout=subprocess.PIPE, env=env, text=True)


def run_selftest(config: SelftestConfig, log=print) -> dict:
    """Run the checks; returns what was measured, with ``failures`` (empty when all passed)."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    use_graph = device.type == "cuda"
    name = f"vcap-selftest-{os.getpid()}"
    segment = Segment.create(name, SegmentConfig(
        stride=config.stride, max_bs=config.max_bs, num_moe_layers=config.layers, ring_slots=256,
        lease_ms=2000, num_experts=config.num_experts, top_k=config.top_k,
        expert_sample_period=config.sample_period))
    failures, report = [], {"device": str(torch.cuda.get_device_name(device)) if use_graph else "cpu",
                            "graph": use_graph, "strategy": config.strategy, "path": config.path}
    try:
        hook = VerifyHook(segment, device=device, strategy=config.strategy, path=config.path)
        report["pointer"] = hook.mapped.pointer_source
        _check(config, segment, hook, device, use_graph, failures, report, log)
        hook.close()
    finally:
        segment.unlink()
    report["failures"] = failures
    return report


def _check(config, segment, hook, device, use_graph, failures, report, log):
    stride, num_drafts, max_bs = config.stride, config.stride - 1, config.max_bs
    rows = max_bs * stride
    gen = torch.Generator(device="cpu").manual_seed(1234)
    scores = torch.randn(config.layers, rows, config.num_experts, generator=gen).to(device)
    bias = (0.1 * torch.randn(config.num_experts, generator=gen)).to(device)
    conf_bank = torch.rand(64, max_bs, num_drafts, generator=gen)
    conf_bank[::7] = conf_bank[::7] ** 0.1  # some confident rows
    conf_bank = conf_bank.to(device)
    confidence = torch.zeros(max_bs, num_drafts, device=device)
    accepted = torch.zeros(max_bs, dtype=torch.int32, device=device)
    gate = dict(num_expert_group=config.num_expert_group, topk_group=config.topk_group)
    weights = torch.zeros(config.layers, rows, config.top_k, device=device)
    ids = torch.zeros(config.layers, rows, config.top_k, dtype=torch.int32, device=device)
    all_live = [route(scores[l], bias, config.top_k, **gate) for l in range(config.layers)]
    all_w = [w.cpu().numpy() for w, _ in all_live]
    all_ids = [i.cpu().numpy() for _, i in all_live]

    def body():
        hook.begin(confidence)
        for layer in range(config.layers):
            hook.route(layer, scores[layer], bias, config.top_k, out=(weights[layer], ids[layer]), **gate)
        hook.end(confidence, accepted)

    hook.prepare(max_bs, True)
    body()  # compile; its record is step 0
    graph = None
    if use_graph:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
    replay = graph.replay if graph is not None else body
    writer = _start_writer(segment.path, config)
    while int(segment.heartbeat[0]) == 0:
        time.sleep(0.001)
    first_seen = _watch(graph, hook) if use_graph else {}
    # the step number the next replay gets (records carry it; the staged path publishes a step's
    # record during the next replay, or at flush)
    hook.flush()  # the warm-up's last record, before the checked steps' reader starts
    if use_graph:
        torch.cuda.synchronize()
    step0 = hook.host.step if config.path == "staged" else int(hook.state.state[4].item())
    expected_records = {}
    reader = RingReader(segment, hook.mapped.ring)
    steps = config.steps
    rng = np.random.default_rng(5)
    seen_gens, last_gen, records_checked = set(), 0, 0
    for i in range(steps):
        bs = int(rng.integers(1, max_bs + 1))
        present = i % 17 != 5
        confidence.copy_(conf_bank[i % 64])
        hook.prepare(bs, present)
        replay()
        info = hook.info.cpu().numpy()
        snapshot = hook.snapshot_words.cpu().numpy()
        live = hook.live.cpu().numpy()
        got_w, got_ids = weights.cpu().numpy(), ids.cpu().numpy()
        step = step0 + i
        generation, source = int(info[0]), int(info[5])
        where = f"step {i} (bs {bs}, generation {generation})"
        if source == 2:
            failures.append(f"{where}: fallback while the writer was alive")
            continue
        if generation < last_gen:
            failures.append(f"{where}: generation went from {last_gen} to {generation}")
        last_gen = max(last_gen, generation)
        seen_gens.add(generation)
        # generation 0 is the block the engine wrote at creation (held until a read succeeds)
        policy = (policy_for(generation, num_drafts, segment.config.max_buckets) if generation
                  else segment.fallback_policy()[0])
        expected_words = np.frombuffer(encode_policy(policy, segment.layout, generation,
                                                     "auto" if generation else "engine"), dtype="<i4")
        if not np.array_equal(snapshot[1:], expected_words[1:]):
            failures.append(f"{where}: the snapshot is not the block the writer wrote (torn read)")
        explore = policy.explore_period > 0 and step % policy.explore_period == 0
        conf_np = confidence.cpu().numpy() if present else None
        expected_live = reference.live_lengths(conf_np, policy, bs, stride, explore)
        if not np.array_equal(live[:bs], expected_live) or (live[bs:] != 1).any():
            failures.append(f"{where}: live {live.tolist()} != reference {expected_live.tolist()} (+ 1 padding)")
        for layer in range(config.layers):
            ref_ids, ref_w = reference.remap_dead_rows(all_ids[layer], all_w[layer], live[:bs], stride,
                                                       config.strategy)
            if not (np.array_equal(got_ids[layer], ref_ids) and np.array_equal(got_w[layer], ref_w)):
                bad = np.nonzero((got_ids[layer] != ref_ids).any(1) | (got_w[layer] != ref_w).any(1))[0]
                failures.append(f"{where}: layer {layer} router rows {bad[:8].tolist()} differ from the reference remap")
        expected_records[step] = (generation, bs, live.copy(), where)
        records_checked += _check_records(reader.read(), expected_records, all_ids, config, failures)
        if writer.poll() is not None:
            failures.append(f"the writer stopped after {i} steps")
            break
        if len(failures) > 20:
            failures.append("stopping after 20 failures")
            break
    hook.flush()
    if use_graph:
        torch.cuda.synchronize()
    records_checked += _check_records(reader.read(), expected_records, all_ids, config, failures)
    if expected_records and not failures:
        failures.append(f"{len(expected_records)} steps never got a telemetry record")
    report.update(steps=steps, distinct_generations_used=len(seen_gens), records_checked=records_checked)
    report["reader_drops"] = reader.dropped
    writer.terminate()
    out, _ = writer.communicate(timeout=60)
    report["writes"] = len(json.loads(out.strip().splitlines()[-1]))
    if use_graph:
        report.update(_latency(first_seen, out))
        report.update(_timing(graph, lambda: hook.prepare(max_bs, True), body_plain=lambda: [route(scores[l], bias, config.top_k, out=(
            weights[l], ids[l]), **gate) for l in range(config.layers)]))
    log(json.dumps({k: v for k, v in report.items() if k != "failures"}))


def _check_records(records, expected, all_ids, config, failures) -> int:
    """Each record against the step it names; returns how many were checked."""
    stride = config.stride
    for record in records:
        want = expected.pop(int(record["step"]), None)
        if want is None:
            failures.append(f"telemetry record of step {int(record['step'])} was not expected")
            continue
        generation, bs, live, where = want
        if int(record["generation"]) != generation or int(record["bs"]) != bs \
                or not np.array_equal(record["live"], live.astype(np.uint8)):
            failures.append(f"{where}: telemetry record {int(record['seq'])} disagrees with the step")
        if record["flags"] & 4:
            real = np.arange(bs * stride)
            dead = reference.dead_row_mask(live[:bs], stride, bs * stride)
            want_all = [reference.distinct_experts(all_ids[l][:bs * stride]) for l in range(config.layers)]
            want_live = [reference.distinct_experts(all_ids[l][real[~dead]]) for l in range(config.layers)]
            if record["experts_all"].tolist() != want_all or record["experts_live"].tolist() != want_live:
                failures.append(f"{where}: expert counts {record['experts_all'].tolist()}/"
                                f"{record['experts_live'].tolist()} != {want_all}/{want_live}")
    return len(records)


def _watch(graph, hook, seconds: float = 1.0) -> dict:
    """Replays back to back for ``seconds``: host time each generation was first seen used."""
    first_seen, info_host = {}, torch.zeros(8, dtype=torch.int32).pin_memory()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hook.prepare(1, True)
        graph.replay()
        info_host.copy_(hook.info, non_blocking=True)
        torch.cuda.synchronize()
        first_seen.setdefault(int(info_host[0]), time.monotonic_ns())
    return first_seen


def _latency(first_seen: dict, out: str) -> dict:
    """Write-to-use: write completed -> first completed replay whose snapshot has that generation
    (an upper bound: it includes the replay and the host's sync)."""
    times = json.loads(out.strip().splitlines()[-1])
    lat = [(first_seen[g] - times[g - 1]) / 1e3 for g in first_seen if 1 <= g <= len(times)
           and first_seen[g] >= times[g - 1]]
    if not lat:
        return {"write_to_use_us": None}
    lat = np.array(lat)
    return {"write_to_use_us": {"median": float(np.median(lat)), "p90": float(np.percentile(lat, 90)),
                                "p99": float(np.percentile(lat, 99)), "n": int(lat.size)}}


def _timing(graph, prepare, body_plain, reps: int = 200) -> dict:
    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        body_plain()

    def per_replay(g, pre=lambda: None):
        for _ in range(20):
            pre()
            g.replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            pre()
            g.replay()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) * 1000 / reps

    # the hooked step includes prepare's eager work on the stream (fills or the staging copy)
    hooked, baseline = per_replay(graph, prepare), per_replay(plain)
    return {"step_us_hooked": hooked, "step_us_routers_only": baseline, "hook_cost_us": hooked - baseline}
