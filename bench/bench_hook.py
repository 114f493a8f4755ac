"""Benchmarks of the engine hook on one GPU (results: bench/RESULTS.md).

    python3 bench/vendor_sgl.py sglang-0.5.23-*.whl     # here, once (bench/_sgl is git-ignored)
    python3 bench/bench_hook.py --out OUT.json           # on the GPU machine, bench/_sgl carried

1. Router: SGLang 0.5.23's Triton router kernel (``moe_fused_gate``'s, vendored) vs vcap's, with
   and without the dead-row rule; bitwise comparison; 43 layers per graph.
2. Hook cost per verify step (host read of the control block + deferred record on a side
   stream): prepare's stream work + begin + 43 routers with dead rows + end, minus 43 SGLang
   routers, in the same run; prepare's eager CPU cost; host syncs of one eager step (CUDA sync
   debug mode).
3. One bf16 MoE layer (384 experts, top-6, hidden 4096, intermediate 2048; SGLang's Triton
   fused-MoE kernels, vendored; align in torch outside the graph): all live vs capped k = 1, 2, 3
   with dead rows dropped (id -1) or copied from the anchor vs the ideal (dead rows removed);
   plus bitwise equality of live rows' outputs, drop vs all live.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_sgl"))
from sgl_moe_kernels import _moe_sum_reduce_kernel, act_and_mul_kernel, fused_moe_kernel  # noqa: E402
from sgl_router_kernel import _router_triton_kernel  # noqa: E402

from vcap.engine_hook.hook import VerifyHook  # noqa: E402
from vcap.engine_hook.router import route  # noqa: E402
from vcap.segment import Segment, SegmentConfig  # noqa: E402

E, TOPK, H, I, STRIDE, LAYERS = 384, 6, 4096, 2048, 6, 43
GROUPS, TOPK_GROUP = 8, 4
CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 8,
       "num_stages": 3}
DEV = "cuda"


def log(*a):
    print(*a, flush=True)


def time_graph(fn, reps=50, warm=10, pre=None):
    """Median per-replay GPU time; ``pre`` (eager, e.g. the hook's prepare) runs before each
    replay, between the timing events, so its stream work counts."""
    pre = pre or (lambda: None)
    pre()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warm):
        pre()
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        pre()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1000.0 for a, b in ev]))


def sgl_route(scores, bias, weights, ids):
    M = scores.shape[0]
    _router_triton_kernel[(M,)](
        scores, bias, None, None, None, weights, ids, ids, M, 1.0, 0.0,
        N=E, K=TOPK, K_ROUTED=TOPK, BLOCK_M=1, BLOCK_N=512, BLOCK_K=8, N_GROUP=GROUPS, TOPK_GROUP=TOPK_GROUP,
        EXPERTS_PER_GROUP=E // GROUPS, BLOCK_G=8, SCORING_FUNC=0, SQRTSOFTPLUS_LOG1P=False, HAS_SOFTCAP=False,
        RENORMALIZE=True, APPLY_SCALE=False, HAS_BIAS=True, HAS_TOKEN_BIAS=False, BIAS_ALT_TOKEN_ID=0,
        HAS_PADDING=False, HAS_PACKED=False, RENORMALIZE_EPSILON=0.0, USE_PDL=False, stride_bias=1,
        stride_bias_alt=0, stride_input_ids=0, stride_sm=scores.stride(0), stride_sn=1, stride_wm=TOPK,
        stride_wk=1, stride_im=TOPK, stride_ik=1, stride_pm=0, stride_pk=0, num_warps=1)


# ----------------------------------------------------------------------------- 1 + 2
def _make_hook():
    segment = Segment.create(f"vcap-bench-{os.getpid()}", SegmentConfig(
        stride=STRIDE, max_bs=256, num_moe_layers=LAYERS, num_experts=E, top_k=TOPK, expert_sample_period=0))
    hook = VerifyHook(segment, strategy="drop")
    segment.heartbeat[0] = 1
    return segment, hook


def _router_row(hook, bs, conf, accepted, bias):
    """One batch size: routers bitwise and timed (SGLang, vcap, vcap with the rule), then the hook's cost."""
    M = bs * STRIDE
    scores = torch.randn(LAYERS, M, E, device=DEV)
    w = torch.empty(LAYERS, M, TOPK, device=DEV)
    ids = torch.empty(LAYERS, M, TOPK, dtype=torch.int32, device=DEV)
    w2, ids2 = torch.empty_like(w), torch.empty_like(ids)
    hook.prepare(bs, True)
    hook.begin(conf)  # all live: the fallback policy is "off"
    hook.end(accepted)
    sgl_route(scores[0], bias, w[0], ids[0])
    route(scores[0], bias, TOPK, num_expert_group=GROUPS, topk_group=TOPK_GROUP, out=(w2[0], ids2[0]))
    same = bool(torch.equal(w[0], w2[0]) and torch.equal(ids[0], ids2[0]))
    live = torch.randint(1, STRIDE + 1, (256,), device=DEV, dtype=torch.int32)
    route(scores[0], bias, TOPK, num_expert_group=GROUPS, topk_group=TOPK_GROUP, out=(w2[0], ids2[0]),
          live=live, stride=STRIDE, strategy="drop")
    dead = (torch.arange(M, device=DEV) % STRIDE) >= live[torch.arange(M, device=DEV) // STRIDE]
    drop_ok = bool(torch.equal(ids2[0][~dead], ids[0][~dead]) and (ids2[0][dead] == -1).all())
    t_sgl = time_graph(lambda: [sgl_route(scores[l], bias, w[l], ids[l]) for l in range(LAYERS)])
    t_ours = time_graph(lambda: [route(scores[l], bias, TOPK, num_expert_group=GROUPS, topk_group=TOPK_GROUP,
                                       out=(w2[l], ids2[l])) for l in range(LAYERS)])
    routers = lambda: [hook.route(l, scores[l], bias, TOPK, num_expert_group=GROUPS, topk_group=TOPK_GROUP,  # noqa: E731
                                  out=(w2[l], ids2[l])) for l in range(LAYERS)]
    t_live = {}
    for strategy in ("drop", "anchor"):
        hook.strategy = strategy
        t_live[strategy] = time_graph(routers)
    hook.strategy = "drop"
    prep = lambda: hook.prepare(bs, True)  # noqa: E731
    # per-step kernels alone (begin + end), prepare's stream work included
    t_kernels = time_graph(lambda: (hook.begin(conf), hook.end(accepted)), reps=200, pre=prep)
    step = lambda: (hook.begin(conf), routers(), hook.end(accepted))  # noqa: E731
    t_step = time_graph(step, pre=prep)
    t_step_bare = time_graph(step)  # prepare's stream work left out (run 4's convention)
    return {"bitwise_equal_sglang": same, "drop_rule_ok": drop_ok, "sglang_43_us": t_sgl, "vcap_43_us": t_ours,
            "vcap_live_43_us": t_live, "step_kernels_us": t_kernels, "hooked_step_us": t_step,
            "hook_cost_us": t_step - t_sgl, "hook_cost_without_prepare_us": t_step_bare - t_sgl,
            "hooked_over_sglang": t_step / t_sgl}


def _host_syncs(hook, conf, accepted, bias):
    """Host syncs of one eager hook step (torch's sync debug mode 'error')."""
    scores = torch.randn(96, E, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hook.prepare(16, True)
        hook.begin(conf)
        hook.route(0, scores, bias, TOPK, num_expert_group=GROUPS, topk_group=TOPK_GROUP)
        hook.end(accepted)
        return 0
    except RuntimeError as error:
        return f"sync detected: {error}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bench_router_and_hook(R, bs_list=(1, 4, 16, 64, 128, 256)):
    segment, hook = _make_hook()
    try:
        conf = torch.rand(256, STRIDE - 1, device=DEV)
        accepted = torch.ones(256, dtype=torch.int32, device=DEV)
        bias = 0.1 * torch.randn(E, device=DEV)
        res = {}
        for bs in bs_list:
            row = res[bs] = _router_row(hook, bs, conf, accepted, bias)
            log(f"router bs={bs:3d} M={bs * STRIDE:4d}: equal to SGLang {row['bitwise_equal_sglang']}, drop rule "
                f"{row['drop_rule_ok']}; 43 layers: SGLang {row['sglang_43_us']:.1f} us, vcap {row['vcap_43_us']:.1f}, "
                f"vcap+live drop {row['vcap_live_43_us']['drop']:.1f} anchor {row['vcap_live_43_us']['anchor']:.1f}; "
                f"begin+end {row['step_kernels_us']:.2f} us, hooked step {row['hooked_step_us']:.1f} -> hook cost "
                f"{row['hook_cost_us']:.2f} us ({row['hooked_over_sglang']:.3f}x; without prepare "
                f"{row['hook_cost_without_prepare_us']:.2f})")
        # eager CPU cost of prepare (host read + staging copy enqueue)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            hook.prepare(16, True)
        R["prepare_cpu_us"] = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        log(f"prepare() eager CPU cost per step: {R['prepare_cpu_us']:.2f} us; staging waits: {hook.host.waits}")
        R["router"] = res
        R["host_syncs_per_step"] = _host_syncs(hook, conf, accepted, bias)
        log("host syncs in one eager hook step (torch sync debug mode 'error'):", R["host_syncs_per_step"])
    finally:
        hook.close()
        segment.unlink()


# ----------------------------------------------------------------------------- 3
def align(topk_ids, BM):
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    valid = flat >= 0
    maxpad = numel * BM if numel < E + 1 else numel + (E + 1) * (BM - 1)
    maxpad = (maxpad + 3) // 4 * 4
    counts = torch.bincount(flat[valid], minlength=E)
    padded = (counts + BM - 1) // BM * BM
    offs = torch.cumsum(padded, 0) - padded
    order = torch.nonzero(valid).flatten()
    order = order[torch.argsort(flat[order], stable=True)]
    se = flat[order]
    cstart = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=DEV) - cstart[se]
    sorted_ids = torch.full((maxpad,), numel, dtype=torch.int32, device=DEV)
    sorted_ids[offs[se] + rank] = order.to(torch.int32)
    nblk = triton.cdiv(maxpad, BM)
    expert_ids = torch.full((nblk,), -1, dtype=torch.int32, device=DEV)
    blk_e = torch.repeat_interleave(torch.arange(E, device=DEV, dtype=torch.int32), padded // BM)
    expert_ids[: blk_e.numel()] = blk_e
    ntpp = torch.tensor([int(padded.sum())], dtype=torch.int32, device=DEV)
    return sorted_ids, expert_ids, ntpp, int((counts > 0).sum())


def gemm(A, B, C, topk_weights, sorted_ids, expert_ids, ntpp, mul_w, top_k, numel):
    EM = sorted_ids.shape[0]
    N, K = B.shape[1], B.shape[2]
    grid = (triton.cdiv(EM, CFG["BLOCK_SIZE_M"]) * triton.cdiv(N, CFG["BLOCK_SIZE_N"]),)
    fused_moe_kernel[grid](
        A, None, B, None, None, C, None, None, topk_weights, sorted_ids, expert_ids, ntpp, None,
        N, K, EM, numel,
        A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), 0, 0,
        C.stride(-2), C.stride(-1), 0, 0, 0, 0, 0, 0, 0,
        MUL_ROUTED_WEIGHT=mul_w, top_k=top_k, compute_type=tl.bfloat16,
        use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        even_Ks=(K % CFG["BLOCK_SIZE_K"] == 0), c_sorted=False, swap_ab=False,
        FUSE_ADD_TO_OUTPUT=False, MASK_OUTPUT=False, FUSE_SUM_ALL_REDUCE=False, ROUTER_TOPK=1,
        FUSE_SWIGLU=False, A_OUTPUT_SLICES=1, A_OUTPUT_SLICE_WIDTH=0, A_OUTPUT_SLICE_K=0,
        USE_GDC=False, GDC_EARLY=False, **CFG)


def moe_layer(x, w13, w2, topk_ids, topk_w, al, bufs, out):
    M = x.shape[0]
    sorted_ids, expert_ids, ntpp = al[:3]
    c1 = bufs["c1"][: M * TOPK]
    c2 = bufs["c2"][: M * TOPK]
    c3 = bufs["c3"][: M * TOPK].view(M, TOPK, H)
    c3.zero_()  # pairs of dropped rows are never written
    gemm(x, w13, c1, topk_w, sorted_ids, expert_ids, ntpp, False, TOPK, M * TOPK)
    act_and_mul_kernel[(M * TOPK,)](c1, c2, 2 * I, topk_ids.view(-1), 1, BLOCK_SIZE=512, ACTIVATION_TYPE="silu",
                                    SWIGLU_LIMIT=10.0, HAS_SWIGLU_LIMIT=True, HAS_EXPERT_FILTER=True)
    gemm(c2, w2, c3, topk_w, sorted_ids, expert_ids, ntpp, True, 1, M * TOPK)
    _moe_sum_reduce_kernel[(M, triton.cdiv(H, 2048))](
        c3, *c3.stride(), out, *out.stride(), token_num=M, topk_num=TOPK, hidden_dim=H,
        routed_scaling_factor=1.0, BLOCK_M=1, BLOCK_DIM=2048, NUM_STAGE=1, num_warps=16)


def routing(M, dist, gen):
    if dist == "uniform":
        logits = torch.rand(M, E, device=DEV, generator=gen)
    else:
        s = float(dist.split("=")[1])
        logp = -s * torch.log(torch.arange(1, E + 1, device=DEV, dtype=torch.float32))
        logp = logp[torch.randperm(E, device=DEV, generator=gen)]
        u = torch.rand(M, E, device=DEV, generator=gen).clamp_(1e-12, 1 - 1e-7)
        logits = logp[None, :] - torch.log(-torch.log(u))
    ids = logits.topk(TOPK, dim=1).indices.to(torch.int32)
    w = torch.rand(M, TOPK, device=DEV, generator=gen) + 0.05
    return ids.contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def bench_moe(R, layers_n, budget_s):
    t0 = time.time()
    layers = [((torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02),
               (torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02)) for _ in range(layers_n)]
    maxM = 256 * STRIDE
    bufs = {"c1": torch.empty(maxM * TOPK, 2 * I, device=DEV, dtype=torch.bfloat16),
            "c2": torch.empty(maxM * TOPK, I, device=DEV, dtype=torch.bfloat16),
            "c3": torch.empty(maxM * TOPK, H, device=DEV, dtype=torch.bfloat16)}
    outs = [torch.empty(maxM, H, device=DEV, dtype=torch.bfloat16) for _ in range(layers_n)]
    xs = torch.randn(maxM, H, device=DEV, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = []

    def run(ids, w):
        M = ids.shape[0]
        al = align(ids, CFG["BLOCK_SIZE_M"])

        def body():
            x = xs[:M]
            for l, (w13, w2) in enumerate(layers):
                moe_layer(x, w13, w2, ids, w, al, bufs, outs[l][:M])
                x = outs[l][:M]
        return time_graph(body, reps=15, warm=3) / layers_n, al[3]

    # exactness: live rows' outputs, drop vs all live (one layer stack, eager)
    ids6, w6 = routing(64 * STRIDE, "zipf=1.0", gen)
    live = torch.randint(1, STRIDE + 1, (64,), device=DEV)
    dead = (torch.arange(64 * STRIDE, device=DEV) % STRIDE) >= live.repeat_interleave(STRIDE)
    outs_all = []
    for variant in ("all", "drop"):
        ids, w = ids6.clone(), w6.clone()
        if variant == "drop":
            ids[dead], w[dead] = -1, 0.0
        run(ids, w)
        outs_all.append(outs[-1][:64 * STRIDE].clone())
    R["moe_live_rows_bitwise_equal_drop_vs_all_live"] = bool(torch.equal(outs_all[0][~dead], outs_all[1][~dead]))
    log("MoE stack: live rows bitwise equal, drop vs all live:", R["moe_live_rows_bitwise_equal_drop_vs_all_live"])

    for dist in ("uniform", "zipf=1.0", "zipf=1.2"):
        for bs in (1, 4, 16, 64, 128, 256):
            if time.time() - t0 > budget_s:
                log("budget reached; stopping")
                R["moe"] = res
                return
            ids6, w6 = routing(bs * STRIDE, dist, gen)
            t_all, d_all = run(ids6, w6)
            row = {"routing": dist, "bs": bs, "all_live_us": t_all, "D_all": d_all}
            iv, wv = ids6.view(bs, STRIDE, TOPK), w6.view(bs, STRIDE, TOPK)
            for k in (1, 2, 3):
                drop_i, drop_w = iv.clone(), wv.clone()
                drop_i[:, 1 + k:], drop_w[:, 1 + k:] = -1, 0.0
                anc_i, anc_w = iv.clone(), wv.clone()
                anc_i[:, 1 + k:], anc_w[:, 1 + k:] = iv[:, :1], wv[:, :1]
                t_drop, d = run(drop_i.view(-1, TOPK).contiguous(), drop_w.view(-1, TOPK).contiguous())
                t_anchor, _ = run(anc_i.view(-1, TOPK).contiguous(), anc_w.view(-1, TOPK).contiguous())
                t_ideal, _ = run(iv[:, :1 + k].reshape(-1, TOPK).contiguous(), wv[:, :1 + k].reshape(-1, TOPK).contiguous())
                row[f"k{k}"] = {"D": d, "drop_us": t_drop, "anchor_us": t_anchor, "ideal_us": t_ideal,
                                "drop_vs_ideal": t_drop / t_ideal, "anchor_vs_ideal": t_anchor / t_ideal}
            res.append(row)
            log(f"moe {dist:9s} bs={bs:3d} all-live {t_all:7.0f} us (D={d_all}) | " + " | ".join(
                f"k={k}: D={row[f'k{k}']['D']} drop {row[f'k{k}']['drop_us']:.0f} anchor {row[f'k{k}']['anchor_us']:.0f} "
                f"ideal {row[f'k{k}']['ideal_us']:.0f} ({row[f'k{k}']['drop_vs_ideal']:.3f}x/{row[f'k{k}']['anchor_vs_ideal']:.3f}x)"
                for k in (1, 2, 3)))
    R["moe"] = res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers per timed graph")
    ap.add_argument("--moe-budget-s", type=float, default=240)
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--bs", default="1,4,16,64,128,256",
                    help="batch sizes of the router/hook table, in order (repeat one to see warm-up)")
    a = ap.parse_args()
    R = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "dims": {"experts": E, "top_k": TOPK, "hidden": H, "intermediate": I, "stride": STRIDE, "layers": LAYERS,
                  "groups": [GROUPS, TOPK_GROUP], "dtype": "bf16 (MXFP4 not available here)"}}
    try:
        bench_router_and_hook(R, tuple(int(b) for b in a.bs.split(",")))
        if not a.skip_moe:
            bench_moe(R, a.layers, a.moe_budget_s)
    finally:
        with open(a.out, "w") as f:
            json.dump(R, f, indent=1)
    log("wrote", a.out)


if __name__ == "__main__":
    main()
