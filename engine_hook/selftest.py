"""``vcap selftest``: map a test segment, replay the hook's kernels (host read + live lengths,
routers with dead rows, telemetry) in a CUDA graph while a second process rewrites the policy,
and check every step against the reference rule. Without CUDA the same kernels run under
Triton's interpreter, eagerly (no graph), with fewer steps.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from vcap.segment import (CONTROL_FALLBACK, FLAG_EXPERTS_SAMPLED, RingReader, Segment, SegmentConfig,
                          encode_policy)

from . import reference
from ._writer import policy_for
from .hook import VerifyHook
from .buffers import INFO_CONTROL, INFO_GENERATION
from .router import route

__all__ = ["SelftestConfig", "run_selftest"]

_MAX_FAILURES = 20


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
    sample_period: int = 4
    device: str | None = None

    def __post_init__(self):
        if self.steps < 1 or self.writes < 1 or self.max_bs < 1 or self.layers < 1:
            raise ValueError("steps, writes, max_bs and layers must be >= 1")
        if self.strategy not in ("drop", "anchor"):
            raise ValueError(f"strategy must be 'drop' or 'anchor', got {self.strategy!r}")


def run_selftest(config: SelftestConfig, log=print) -> dict:
    """Run the checks; returns what was measured, with ``failures`` (empty when all passed)."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    segment = Segment.create(f"vcap-selftest-{os.getpid()}", SegmentConfig(
        stride=config.stride, max_bs=config.max_bs, num_moe_layers=config.layers, ring_slots=256,
        lease_ms=2000, num_experts=config.num_experts, top_k=config.top_k,
        expert_sample_period=config.sample_period))
    try:
        hook = VerifyHook(segment, device=device, strategy=config.strategy)
        run = _Run(config, segment, hook, device)
        report = run.check()
        hook.close()
    finally:
        segment.unlink()
    log(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    return report


class _Run:
    """One selftest: the inputs, the captured step, the concurrent writer and the checks."""

    def __init__(self, config: SelftestConfig, segment: Segment, hook: VerifyHook, device: torch.device):
        self.config, self.segment, self.hook, self.device = config, segment, hook, device
        self.use_graph = device.type == "cuda"
        max_bs, num_drafts, rows = config.max_bs, config.stride - 1, config.max_bs * config.stride
        gen = torch.Generator(device="cpu").manual_seed(1234)
        self.scores = torch.randn(config.layers, rows, config.num_experts, generator=gen).to(device)
        self.bias = (0.1 * torch.randn(config.num_experts, generator=gen)).to(device)
        conf_bank = torch.rand(64, max_bs, num_drafts, generator=gen)
        conf_bank[::7] = conf_bank[::7] ** 0.1  # some confident rows
        self.conf_bank = conf_bank.to(device)
        self.confidence = torch.zeros(max_bs, num_drafts, device=device)
        self.accepted = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.gate = dict(num_expert_group=config.num_expert_group, topk_group=config.topk_group)
        self.weights = torch.zeros(config.layers, rows, config.top_k, device=device)
        self.ids = torch.zeros(config.layers, rows, config.top_k, dtype=torch.int32, device=device)
        all_live = [route(self.scores[l], self.bias, config.top_k, **self.gate) for l in range(config.layers)]
        self.all_w = [w.cpu().numpy() for w, _ in all_live]
        self.all_ids = [i.cpu().numpy() for _, i in all_live]
        self.graph, self.failures, self.expected = None, [], {}
        self.generations, self.last_generation = set(), 0
        self.report = {"device": torch.cuda.get_device_name(device) if self.use_graph else "cpu",
                       "graph": self.use_graph, "strategy": config.strategy, "pointer": hook.mapped.pointer_source}

    def body(self) -> None:
        self.hook.begin(self.confidence)
        for layer in range(self.config.layers):
            self.hook.route(layer, self.scores[layer], self.bias, self.config.top_k,
                            out=(self.weights[layer], self.ids[layer]), **self.gate)
        self.hook.end(self.accepted)

    def replay(self) -> None:
        if self.graph is None:
            self.body()
        else:
            self.graph.replay()

    def sync(self) -> None:
        if self.use_graph:
            torch.cuda.synchronize()

    def check(self) -> dict:
        self.hook.prepare(self.config.max_bs, True)
        self.body()  # compile; its record is the first
        if self.use_graph:
            self.sync()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.body()
        writer = _start_writer(self.segment.path, self.config)
        while not self.segment.lease_heartbeat():
            time.sleep(0.001)
        first_seen = _watch(self.graph, self.hook) if self.use_graph else {}
        self.hook.flush()  # the warm-up's last record, before the checked steps' reader starts
        self.sync()
        records_checked = self._check_steps(writer)
        writer.terminate()
        out, _ = writer.communicate(timeout=60)
        write_times = json.loads(out.strip().splitlines()[-1])
        self.report.update(steps=self.config.steps, distinct_generations_used=len(self.generations),
                           records_checked=records_checked, writes=len(write_times))
        if self.use_graph:
            self.report.update(_latency(first_seen, write_times))
            self.report.update(_timing(self.graph, lambda: self.hook.prepare(self.config.max_bs, True),
                                       self._routers_only))
        self.report["failures"] = self.failures
        return self.report

    def _check_steps(self, writer: subprocess.Popen) -> int:
        """Every step against the reference, every record against its step; returns records checked."""
        reader = RingReader(self.segment, self.hook.mapped.ring)
        step0 = self.hook.host.step  # the step number the next replay gets (records carry it)
        rng = np.random.default_rng(5)
        records_checked = 0
        for i in range(self.config.steps):
            self._check_step(i, step0 + i, int(rng.integers(1, self.config.max_bs + 1)), i % 17 != 5)
            records_checked += self._check_records(reader.read())
            if writer.poll() is not None:
                self.failures.append(f"the writer stopped after {i} steps")
                break
            if len(self.failures) > _MAX_FAILURES:
                self.failures.append(f"stopping after {_MAX_FAILURES} failures")
                break
        self.hook.flush()
        self.sync()
        records_checked += self._check_records(reader.read())
        self.report["reader_drops"] = reader.dropped
        if self.expected and not self.failures:
            self.failures.append(f"{len(self.expected)} steps never got a telemetry record")
        return records_checked

    def _check_step(self, i: int, step: int, bs: int, present: bool) -> None:
        self.confidence.copy_(self.conf_bank[i % 64])
        self.hook.prepare(bs, present)
        self.replay()
        info, snapshot, live = (self.hook.info.cpu().numpy(), self.hook.snapshot_words.cpu().numpy(),
                                self.hook.live.cpu().numpy())
        generation = int(info[INFO_GENERATION])
        where = f"step {i} (bs {bs}, generation {generation})"
        if info[INFO_CONTROL] == CONTROL_FALLBACK:
            self.failures.append(f"{where}: fallback while the writer was alive")
            return
        if generation < self.last_generation:
            self.failures.append(f"{where}: generation went from {self.last_generation} to {generation}")
        self.last_generation = max(self.last_generation, generation)
        self.generations.add(generation)
        # generation 0 is the block the engine wrote at creation (held until a read succeeds)
        policy = (policy_for(generation, self.config.stride - 1, self.segment.config.max_buckets) if generation
                  else self.segment.fallback_policy()[0])
        expected_words = np.frombuffer(encode_policy(policy, self.segment.layout, generation,
                                                     "auto" if generation else "engine"), dtype="<i4")
        if not np.array_equal(snapshot[1:], expected_words[1:]):
            self.failures.append(f"{where}: the snapshot is not the block the writer wrote (torn read)")
        explore = policy.explore_period > 0 and step % policy.explore_period == 0
        conf_np = self.confidence.cpu().numpy() if present else None
        expected_live = reference.live_lengths(conf_np, policy, bs, self.config.stride, explore)
        if not np.array_equal(live[:bs], expected_live) or (live[bs:] != 1).any():
            self.failures.append(f"{where}: live {live.tolist()} != reference {expected_live.tolist()} (+ 1 padding)")
        self._check_routers(where, live[:bs])
        self.expected[step] = (generation, bs, live.copy(), where)

    def _check_routers(self, where: str, live: np.ndarray) -> None:
        got_w, got_ids = self.weights.cpu().numpy(), self.ids.cpu().numpy()
        for layer in range(self.config.layers):
            ref_ids, ref_w = reference.remap_dead_rows(self.all_ids[layer], self.all_w[layer], live,
                                                       self.config.stride, self.config.strategy)
            if not (np.array_equal(got_ids[layer], ref_ids) and np.array_equal(got_w[layer], ref_w)):
                bad = np.nonzero((got_ids[layer] != ref_ids).any(1) | (got_w[layer] != ref_w).any(1))[0]
                self.failures.append(f"{where}: layer {layer} router rows {bad[:8].tolist()} differ from the "
                                     "reference remap")

    def _check_records(self, records: np.ndarray) -> int:
        """Each record against the step it names; returns how many were checked."""
        stride, layers = self.config.stride, self.config.layers
        for record in records:
            want = self.expected.pop(int(record["step"]), None)
            if want is None:
                self.failures.append(f"telemetry record of step {int(record['step'])} was not expected")
                continue
            generation, bs, live, where = want
            if int(record["generation"]) != generation or int(record["bs"]) != bs \
                    or not np.array_equal(record["live"], live.astype(np.uint8)):
                self.failures.append(f"{where}: telemetry record {int(record['seq'])} disagrees with the step")
            if record["flags"] & FLAG_EXPERTS_SAMPLED:
                live_rows = ~reference.dead_row_mask(live[:bs], stride, bs * stride)
                want_all = [reference.distinct_experts(self.all_ids[l][:bs * stride]) for l in range(layers)]
                want_live = [reference.distinct_experts(self.all_ids[l][:bs * stride][live_rows]) for l in range(layers)]
                if record["experts_all"].tolist() != want_all or record["experts_live"].tolist() != want_live:
                    self.failures.append(f"{where}: expert counts {record['experts_all'].tolist()}/"
                                         f"{record['experts_live'].tolist()} != {want_all}/{want_live}")
        return len(records)

    def _routers_only(self) -> None:
        for layer in range(self.config.layers):
            route(self.scores[layer], self.bias, self.config.top_k, out=(self.weights[layer], self.ids[layer]),
                  **self.gate)


def _start_writer(name: str, config: SelftestConfig) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, "-m", "vcap.engine_hook._writer", name, str(config.writes),
                             str(config.write_period_us)], stdout=subprocess.PIPE, env=env, text=True)


def _watch(graph, hook, seconds: float = 1.0) -> dict:
    """Replays back to back for ``seconds``: host time each generation was first seen used."""
    first_seen, info_host = {}, torch.zeros(hook.info.numel(), dtype=torch.int32).pin_memory()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hook.prepare(1, True)
        graph.replay()
        info_host.copy_(hook.info, non_blocking=True)
        torch.cuda.synchronize()
        first_seen.setdefault(int(info_host[INFO_GENERATION]), time.monotonic_ns())
    return first_seen


def _latency(first_seen: dict, write_times: list) -> dict:
    """Write-to-use: write completed -> first completed replay whose snapshot has that generation
    (an upper bound: it includes the replay and the host's sync)."""
    lat = [(first_seen[g] - write_times[g - 1]) / 1e3 for g in first_seen if 1 <= g <= len(write_times)
           and first_seen[g] >= write_times[g - 1]]
    if not lat:
        return {"write_to_use_us": None}
    lat = np.array(lat)
    return {"write_to_use_us": {"median": float(np.median(lat)), "p90": float(np.percentile(lat, 90)),
                                "p99": float(np.percentile(lat, 99)), "n": int(lat.size)}}


def _timing(graph, prepare, routers_only, reps: int = 200) -> dict:
    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        routers_only()

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

    # the hooked step includes prepare's eager work on the stream (the staging copy)
    hooked, baseline = per_replay(graph, prepare), per_replay(plain)
    return {"step_us_hooked": hooked, "step_us_routers_only": baseline, "hook_cost_us": hooked - baseline}
