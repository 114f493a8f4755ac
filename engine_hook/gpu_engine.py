"""The simulated engine with a real verify step on the GPU (``vcap-sim --device cuda``).

Requests, output lengths, draft confidence and acceptance stay SYNTHETIC
(:mod:`vcap.engine_hook.workload`); each verify step really runs: vcap's hook (the production
path the SGLang plugin uses: ``prepare`` reads the segment's control block on the host, ``begin``
computes the live lengths and stages the previous record, ``route`` in every MoE layer, ``end``)
and ``run_layers`` DeepSeek-V4-shaped MoE layers: the real router (dead rows dropped) fed by
SYNTHETIC routing logits (uniform, or Zipf ``s`` through Gumbel-top-k, one permutation per layer),
then SGLang 0.5.23's fused-MoE Triton kernels (bf16; MXFP4 is not available to these kernels),
replayed as one CUDA graph per batch size. Telemetry is the hook's own record (the sidecar reads
it from the ring, exactly as from the plugin).

Time: the hook's record carries the measured device time of the ``run_layers`` layers plus a
GPU spin standing for the non-MoE part of the step scaled the same way
(``other_ms * run_layers / model_layers``), so every rule sees the same cost curve, shrunk by
``run_layers / model_layers``. :attr:`GpuStep.scale` turns it back into a full-model step time
(``model_layers`` MoE layers + ``other_ms``), which :class:`GpuSimulatedEngine` reports.

Without CUDA (tests) the same step runs eagerly with tiny dims: the hook's Triton kernels under
``TRITON_INTERPRET=1`` and a plain-torch MoE in place of SGLang's kernels.
"""

import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from vcap.segment import Segment

from .buffers import INFO_FLAGS, INFO_GENERATION, INFO_MODE
from .hook import VerifyHook
from .workload import PairedRequestDraws

__all__ = ["MoEPreset", "PRESETS", "GpuStep", "GpuSimulatedEngine", "align_blocks", "moe_reference"]


@dataclass(frozen=True, slots=True)
class MoEPreset:
    """Dimensions of one routed-MoE layer."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    model_layers: int


PRESETS = {
    "v4-flash": MoEPreset(256, 6, 4096, 2048, 43),
    "v4.1": MoEPreset(384, 6, 4096, 2048, 43),
    "v4-pro": MoEPreset(384, 6, 4096, 2048, 43),
    "tiny": MoEPreset(16, 2, 64, 32, 4),   # CPU tests
}

_BLOCK_M = 16
_SGL_CONFIG = {"BLOCK_SIZE_M": _BLOCK_M, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
               "num_warps": 8, "num_stages": 3}   # best of 5 on the H200 (shared/reference)


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int):
    """SGLang's ``moe_align_block_size`` in plain torch with static shapes (graph-safe):
    ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``; ids < 0 (dropped rows) are left out."""
    flat = ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(numel, device=ids.device) - first[sorted_key]
    max_padded = min(numel * block_m, numel + num_experts * (block_m - 1))
    dest = torch.where(sorted_key < num_experts, starts[sorted_key.clamp(max=num_experts - 1)] + rank,
                       torch.full_like(rank, max_padded))
    sorted_ids = torch.full((max_padded + 1,), numel, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:max_padded]
    sorted_ids.masked_fill_(sorted_ids < 0, numel)
    num_blocks = (max_padded + block_m - 1) // block_m
    block_start = torch.arange(num_blocks, device=ids.device) * block_m
    expert = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(expert < num_experts, expert, torch.full_like(expert, -1)).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def moe_reference(x, w13, w2, ids, weights):
    """Plain-torch routed MoE (SiLU-and-mul): ``sum_k w[m,k] * expert_{ids[m,k]}(x[m])``; ids < 0 add nothing."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for expert in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = torch.nonzero(ids == expert, as_tuple=True)
        h = x[rows].float() @ w13[expert].float().t()
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, rows, (h @ w2[expert].float().t()) * weights[rows, slots, None])
    return out.to(x.dtype)


def _sgl_kernels():
    """SGLang 0.5.23's fused-MoE kernels: vendored by bench/vendor_sgl.py (``VCAP_SGL_KERNELS``
    or bench/_sgl), else an installed sglang."""
    folder = os.environ.get("VCAP_SGL_KERNELS") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "_sgl")
    if os.path.exists(os.path.join(folder, "sgl_moe_kernels.py")):
        sys.path.insert(0, folder)
        import sgl_moe_kernels as kernels
    else:
        from sglang.kernels.ops.moe import fused_moe_triton_kernels as kernels
    return kernels


class _SglMoE:
    """One bf16 routed-MoE layer with SGLang's Triton kernels (as bench/bench_hook.py drives them)."""

    def __init__(self, preset: MoEPreset, max_rows: int, device):
        import triton
        import triton.language as tl
        self.k, self.triton, self.tl = _sgl_kernels(), triton, tl
        self.preset = preset
        size = max_rows * preset.top_k
        self.c1 = torch.empty(size, 2 * preset.intermediate, device=device, dtype=torch.bfloat16)
        self.c2 = torch.empty(size, preset.intermediate, device=device, dtype=torch.bfloat16)
        self.c3 = torch.empty(size, preset.hidden, device=device, dtype=torch.bfloat16)

    def _gemm(self, a, b, c, weights, aligned, mul_weight, top_k, numel):
        sorted_ids, expert_ids, post_padded = aligned
        cfg, triton = _SGL_CONFIG, self.triton
        n, k = b.shape[1], b.shape[2]
        em = sorted_ids.shape[0]
        grid = (triton.cdiv(em, cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
        self.k.fused_moe_kernel[grid](
            a, None, b, None, None, c, None, None, weights, sorted_ids, expert_ids, post_padded, None,
            n, k, em, numel, a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), 0, 0,
            c.stride(-2), c.stride(-1), 0, 0, 0, 0, 0, 0, 0,
            MUL_ROUTED_WEIGHT=mul_weight, top_k=top_k, compute_type=self.tl.bfloat16,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            even_Ks=(k % cfg["BLOCK_SIZE_K"] == 0), c_sorted=False, swap_ab=False,
            FUSE_ADD_TO_OUTPUT=False, MASK_OUTPUT=False, FUSE_SUM_ALL_REDUCE=False, ROUTER_TOPK=1,
            FUSE_SWIGLU=False, A_OUTPUT_SLICES=1, A_OUTPUT_SLICE_WIDTH=0, A_OUTPUT_SLICE_K=0,
            USE_GDC=False, GDC_EARLY=False, **cfg)

    def __call__(self, x, w13, w2, ids, weights, out):
        p, rows = self.preset, x.shape[0]
        pairs = rows * p.top_k
        aligned = align_blocks(ids, p.num_experts, _BLOCK_M)
        c1, c2 = self.c1[:pairs], self.c2[:pairs]
        c3 = self.c3[:pairs].view(rows, p.top_k, p.hidden)
        c3.zero_()  # pairs of dropped rows are never written
        self._gemm(x, w13, c1, weights, aligned, False, p.top_k, pairs)
        self.k.act_and_mul_kernel[(pairs,)](c1, c2, 2 * p.intermediate, ids.view(-1), 1, BLOCK_SIZE=512,
                                            ACTIVATION_TYPE="silu", SWIGLU_LIMIT=10.0, HAS_SWIGLU_LIMIT=True,
                                            HAS_EXPERT_FILTER=True)
        self._gemm(c2, w2, c3, weights, aligned, True, 1, pairs)
        self.k._moe_sum_reduce_kernel[(rows, self.triton.cdiv(p.hidden, 2048))](
            c3, *c3.stride(), out, *out.stride(), token_num=rows, topk_num=p.top_k, hidden_dim=p.hidden,
            routed_scaling_factor=1.0, BLOCK_M=1, BLOCK_DIM=2048, NUM_STAGE=1, num_warps=16)
        return out


def _spin_cycles_per_us(device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond, measured."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    stop.record()
    torch.cuda.synchronize(device)
    return 2_000_000 / (start.elapsed_time(stop) * 1e3)


class GpuStep:
    """The verify step of one rank on a device: hook + ``run_layers`` MoE layers, a graph per bs.

    ``routing`` is ``"uniform"`` or ``"zipf:S"``: expert popularity of the SYNTHETIC routing
    logits (ranked by a random permutation per layer). ``weight_sets`` distinct expert weight sets
    are cycled through the layers (2 is enough: one set is far larger than the L2 cache).
    """

    def __init__(self, segment: Segment, preset: MoEPreset, *, run_layers: int = 2, routing: str = "uniform",
                 other_ms: float = 2.0, weight_sets: int = 2, device=None, seed: int = 0, use_graphs=None):
        config = segment.config
        if config.num_moe_layers != run_layers or config.num_experts != preset.num_experts \
                or config.top_k != preset.top_k:
            raise ValueError(f"segment {config} does not match run_layers={run_layers} and {preset}")
        if run_layers < 1 or other_ms < 0:
            raise ValueError("run_layers must be >= 1 and other_ms >= 0")
        self.segment, self.preset, self.run_layers, self.other_ms = segment, preset, run_layers, other_ms
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.use_graphs = self.cuda if use_graphs is None else use_graphs
        self.hook = VerifyHook(segment, device=self.device, strategy="drop")
        self.stride, self.max_bs = config.stride, config.max_bs
        self.scale = preset.model_layers / run_layers
        gen = torch.Generator(device="cpu").manual_seed(seed)
        dtype = torch.bfloat16 if self.cuda else torch.float32
        e, h, i = preset.num_experts, preset.hidden, preset.intermediate
        # drawn on the device (bf16 V4 weights are ~19 GB per set)
        device_gen = torch.Generator(device=self.device).manual_seed(seed)
        self.w13 = [torch.randn(e, 2 * i, h, generator=device_gen, device=self.device, dtype=dtype).mul_(0.02)
                    for _ in range(weight_sets)]
        self.w2 = [torch.randn(e, h, i, generator=device_gen, device=self.device, dtype=dtype).mul_(0.02)
                   for _ in range(weight_sets)]
        self.log_popularity = self._popularity(routing, gen).to(self.device)
        max_rows = self.max_bs * self.stride
        self.x = (torch.randn(max_rows, h, generator=gen) * 0.5).to(self.device, dtype)
        self.out = [torch.empty(max_rows, h, device=self.device, dtype=dtype) for _ in range(2)]
        self.bias = torch.zeros(e, device=self.device)
        self.weights = torch.zeros(run_layers, max_rows, preset.top_k, device=self.device)
        self.ids = torch.zeros(run_layers, max_rows, preset.top_k, dtype=torch.int32, device=self.device)
        self.confidence = torch.zeros(self.max_bs, self.stride - 1, device=self.device)
        self.uncapped = torch.zeros(self.max_bs, dtype=torch.int32, device=self.device)
        self.accepted = torch.zeros(self.max_bs, dtype=torch.int32, device=self.device)
        self._host_in = torch.zeros(self.max_bs, self.stride, dtype=torch.float32, pin_memory=self.cuda)
        self._moe = _SglMoE(preset, max_rows, self.device) if self.cuda else None
        self._spin_cycles = 0
        if self.cuda and other_ms > 0:
            self._spin_cycles = int(other_ms * 1e3 / self.scale * _spin_cycles_per_us(self.device))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else None
        # host CLOCK_MONOTONIC of the last step: just before its host read of the control block,
        # and once its results were back on the host; its mode and flags as the hook decided
        self.read_ns = self.done_ns = 0
        self.mode = self.flags = 0

    def _popularity(self, routing: str, gen) -> torch.Tensor:
        e = self.preset.num_experts
        if routing == "uniform":
            skew = 0.0
        elif routing.startswith("zipf:"):
            skew = float(routing.split(":", 1)[1])
        else:
            raise ValueError(f"routing must be 'uniform' or 'zipf:S', got {routing!r}")
        log_p = -skew * torch.log(torch.arange(1, e + 1, dtype=torch.float32))
        return torch.stack([log_p[torch.randperm(e, generator=gen)] for _ in range(self.run_layers)])

    def _body(self, bs: int) -> None:
        rows, p = bs * self.stride, self.preset
        live = self.hook.begin(self.confidence)
        # SYNTHETIC routing logits: Gumbel-top-k over the layer's popularity (router is monotone in them)
        u = torch.rand(self.run_layers, rows, p.num_experts, device=self.device).clamp_(1e-12, 1 - 1e-7)
        scores = self.log_popularity[:, None, :] - torch.log(-torch.log(u))
        x = self.x[:rows]
        for layer in range(self.run_layers):
            weights, ids = self.hook.route(layer, scores[layer], self.bias, p.top_k,
                                           out=(self.weights[layer, :rows], self.ids[layer, :rows]))
            w13, w2 = self.w13[layer % len(self.w13)], self.w2[layer % len(self.w2)]
            out = self.out[layer % 2][:rows]
            if self._moe is not None:
                x = self._moe(x, w13, w2, ids, weights, out)
            else:
                out.copy_(moe_reference(x, w13, w2, ids, weights))
                x = out
        torch.minimum(self.uncapped, live - 1, out=self.accepted)
        if self._spin_cycles:
            torch.cuda._sleep(self._spin_cycles)
        self.hook.end(self.accepted)

    def _graph(self, bs: int):
        graph = self._graphs.get(bs)
        if graph is None:
            # the warm-up draws routing noise: put the generator back, so that a run that meets
            # this batch size first draws as one that replays its graph (paired runs route alike)
            rng = torch.cuda.get_rng_state(self.device)
            self._body(bs)   # compile and warm up eagerly first
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._body(bs)
            torch.cuda.set_rng_state(rng, self.device)
            self._graphs[bs] = graph
        return graph

    def run(self, bs: int, confidence: np.ndarray, uncapped_accepted: np.ndarray, num_queued: int = 0):
        """One verify step; returns ``(live [bs], accepted [bs], generation, device_ns)`` (host sync)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"bs must be in 1..{self.max_bs}, got {bs}")
        host = self._host_in.numpy()
        host[:bs, :-1] = confidence[:bs]
        host[:bs, -1] = uncapped_accepted[:bs]
        staged = self._host_in.to(self.device, non_blocking=True)
        self.confidence.copy_(staged[:, :-1])
        self.uncapped.copy_(staged[:, -1].to(torch.int32))
        assert (INFO_GENERATION, INFO_MODE, INFO_FLAGS) == (0, 1, 2)
        if self.use_graphs:
            graph = self._graph(bs)
            self.read_ns = time.monotonic_ns()
            self.hook.prepare(bs, True, num_queued)
            self._events[0].record()
            graph.replay()
            self._events[1].record()
        else:
            self.read_ns = time.monotonic_ns()
            self.hook.prepare(bs, True, num_queued)
            self._body(bs)
        out = torch.cat([self.hook.live[:bs], self.accepted[:bs], self.hook.info[:3]])
        out = out.cpu().numpy()   # syncs
        self.done_ns = time.monotonic_ns()
        self.mode, self.flags = int(out[-2]), int(out[-1])
        device_ns = int(self._events[0].elapsed_time(self._events[1]) * 1e6) if self.use_graphs else 0
        return out[:bs].astype(np.int64), out[bs:2 * bs].astype(np.int64), int(out[-3]), device_ns

    def close(self) -> None:
        self.hook.close()


class GpuSimulatedEngine:
    """:class:`vcap.engine_hook.sim.SimulatedEngine`'s SYNTHETIC workload (one ring) driving a
    :class:`GpuStep`. :meth:`step` returns a record-shaped summary of the step for the caller's
    accounting, with ``step_ns`` the full-model time (``GpuStep.scale`` x the hook's measured
    time); the sidecar reads the hook's own records from the ring."""

    def __init__(self, config, segment: Segment, step: GpuStep):
        from .sim import SimulatedEngine
        if config.num_rings != 1:
            raise ValueError("the GPU engine drives one ring")
        self.config, self.segment, self.gpu = config, segment, step
        self._sim = SimulatedEngine(config)   # pure trace: its pools, acceptance and load only
        self.pool, self.acceptance = self._sim.pools[0], self._sim.acceptance
        if config.paired_requests:   # keyed to this engine's time, not the trace's
            self.pool.rng = PairedRequestDraws(config.seed, 0, lambda: self.engine_time_ns)
            # the step's SYNTHETIC routing noise (torch.rand, in the CUDA graphs too) restarts from the
            # seed: runs of one trace under two rules route alike while their batch sizes agree
            torch.manual_seed(config.seed)
        self._accept_rng = self._sim._accept_rng
        self.record_dtype = self._sim.record_dtype
        self.engine_time_ns = 0
        self.last_step_ns = 0
        self.steps = 0
        self.wall_ns = 0
        self.uncapped = np.zeros(0, dtype=np.int64)   # this step's accepted drafts before the cap
        self.shape_confidence = None   # optional (confidence, request_ids) -> what the hook sees
        self._end_ns = {}   # the hook's step number -> this engine's time at the end of that step

    def step(self) -> np.ndarray:
        bs = self.pool.admit(self._sim.load.demand(self.engine_time_ns / 1e9), self.last_step_ns / 1e9)
        ids = self.pool.request_id[:bs].copy()
        draws = self.pool.step_draws(self.config.num_drafts, self._accept_rng)
        true_accept = self.acceptance.true_accept(self.pool.logit_shift[:bs])
        confidence = self.acceptance.confidence(true_accept, draws)
        uncapped = self.acceptance.accepted_drafts(true_accept, draws)
        seen = confidence if self.shape_confidence is None else self.shape_confidence(confidence, ids)
        started, hook_step = time.monotonic_ns(), self.gpu.hook.host.step
        live, accepted, generation, device_ns = self.gpu.run(bs, seen, uncapped, self.pool.num_queued)
        self.wall_ns += time.monotonic_ns() - started
        self.pool.commit(accepted + 1)
        self.uncapped = uncapped
        record = np.zeros(1, dtype=self.record_dtype)
        measured = device_ns or self._last_record_ns()
        self.last_step_ns = int(measured * self.gpu.scale)
        self.engine_time_ns += self.last_step_ns
        self._end_ns[hook_step] = self.engine_time_ns
        if len(self._end_ns) > 2 * self.segment.config.ring_slots:   # unread: the ring has overwritten it
            del self._end_ns[next(iter(self._end_ns))]
        record["step"], record["bs"], record["generation"] = self.steps, bs, generation
        record["step_ns"], record["num_queued"] = self.last_step_ns, self.pool.num_queued
        record["mode"], record["flags"], record["time_ns"] = self.gpu.mode, self.gpu.flags, self.gpu.done_ns
        record["confidence"][0, :bs] = confidence
        record["live"][0, :bs] = live
        record["accepted"][0, :bs] = accepted
        self.steps += 1
        return record

    def on_engine_clock(self, records: np.ndarray) -> np.ndarray:
        """The hook's ring ``records`` of this engine's steps, stamped with this engine's clock.

        The hook stamps a record with the GPU's clock, and this engine's steps take a fraction of
        the full-model time they stand for (``GpuStep.scale``, plus the loop's own overhead): a
        controller fed those stamps would run its half-lives, drift blocks and waits on a clock
        several times slower than the engine's. A real engine's records carry its real time,
        which is the engine time here. Records of steps this engine did not run are left out."""
        ends = [self._end_ns.pop(int(step), None) for step in records["step"]]
        mine = np.array([end is not None for end in ends], dtype=bool)
        out = records[mine].copy()
        out["time_ns"] = [end for end in ends if end is not None]
        return out

    def _last_record_ns(self) -> int:
        # eager (CPU) runs have no graph timing: use the model's a + b * D instead of nothing
        c = self.config
        return int(c.num_moe_layers * c.moe_a_us * 1e3)

    def close(self) -> None:
        self.gpu.close()

