"""GPU checks, natively inside captured CUDA graphs (skipped without CUDA)."""
import os
import sys

import pytest
import torch

from vcap.engine_hook.router import route
from vcap.engine_hook.selftest import SelftestConfig, run_selftest

BENCH_SGL = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "_sgl")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["drop", "anchor"])
def test_graph_replays_while_another_process_rewrites_the_policy(strategy):
    report = run_selftest(SelftestConfig(steps=3000, max_bs=16, layers=3, strategy=strategy), log=print)
    assert report["failures"] == []
    assert report["steps"] == 3000
    assert report["distinct_generations_used"] > 100


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.exists(os.path.join(BENCH_SGL, "sgl_router_kernel.py")),
                    reason="SGLang's router kernel not vendored (bench/vendor_sgl.py)")
@pytest.mark.parametrize("rows,experts,groups,topk_group", [(96, 384, 8, 4), (37, 256, 8, 4), (5, 160, 1, 1)])
def test_router_is_bitwise_sglangs(rows, experts, groups, topk_group):
    sys.path.insert(0, BENCH_SGL)
    from sgl_router_kernel import _router_triton_kernel
    scores = torch.randn(rows, experts, device="cuda")
    bias = 0.1 * torch.randn(experts, device="cuda")
    w = torch.empty(rows, 6, device="cuda")
    ids = torch.empty(rows, 6, dtype=torch.int32, device="cuda")
    packed = torch.empty_like(ids)
    block_n = 1 << (experts - 1).bit_length()
    _router_triton_kernel[(rows,)](
        scores, bias, None, None, None, w, ids, packed, rows, 2.5, 0.0,
        N=experts, K=6, K_ROUTED=6, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=8, N_GROUP=groups, TOPK_GROUP=topk_group,
        EXPERTS_PER_GROUP=experts // groups, BLOCK_G=max(1, 1 << (groups - 1).bit_length()), SCORING_FUNC=0,
        SQRTSOFTPLUS_LOG1P=False, HAS_SOFTCAP=False, RENORMALIZE=True, APPLY_SCALE=True, HAS_BIAS=True,
        HAS_TOKEN_BIAS=False, BIAS_ALT_TOKEN_ID=0, HAS_PADDING=False, HAS_PACKED=True, RENORMALIZE_EPSILON=0.0,
        USE_PDL=False, stride_bias=1, stride_bias_alt=0, stride_input_ids=0, stride_sm=experts, stride_sn=1,
        stride_wm=6, stride_wk=1, stride_im=6, stride_ik=1, stride_pm=6, stride_pk=1, num_warps=1)
    ours_packed = torch.empty_like(ids)
    ours_w, ours_ids = route(scores, bias, 6, num_expert_group=groups, topk_group=topk_group,
                             routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True,
                             packed_out=ours_packed)
    assert torch.equal(ours_ids, ids)
    assert torch.equal(ours_w, w)
    assert torch.equal(ours_packed, packed)
