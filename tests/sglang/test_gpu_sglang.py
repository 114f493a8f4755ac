"""SGLang 0.5.23's own GPU code under vcap's patches, on a CUDA GPU (skipped without one or
without SGLang): the sampling accept, blockwise rejection, fused-argmax greedy accept, the folded
in-graph accept and the sampling-accept region captured in CUDA graphs, and vcap's router
against SGLang's gate for DeepSeek-V4 and V4.1. Run by bench/sglang_gpu/run.sh on the H200.

Live lengths come from random ``fixed``/``conf`` policies (``reference.live_lengths``); rows past
them hold garbage logits (vcap gives them no experts, so their logits are not the target's).
"""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference, sglang_hooks, sglang_plugin

from tests.utils import random_policy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STRIDE, MAX_BS = 6, 64
_PATCHED_HERE = (".accept_draft_tokens", "._accept", ".moe_fused_gate")


@pytest.fixture(scope="module")
def gpu_patched():
    """The accept and gate patches through SGLang's registry (the model and scheduler sites need
    DeepSeek-V4's CUDA-only imports, which this machine's SGLang copy does not have)."""
    from vcap.engine_hook.patches import apply
    apply([p for p in sglang_plugin.PATCHES if p.target.endswith(_PATCHED_HERE)])
    state = sglang_hooks.engine_state
    saved = dict(vars(state))
    state.live = torch.full((MAX_BS,), STRIDE, dtype=torch.int32, device="cuda")
    state.stride, state.max_bs, state.hook, state.group = STRIDE, MAX_BS, None, None
    yield state
    vars(state).update(saved)


def _step(state, rng, bs, vocab):
    """A verify step: live lengths from a random policy written into vcap's live buffer, the
    target's logits, the same logits with garbage on dead rows, and drafts."""
    confidence = rng.random((bs, STRIDE - 1)).astype(np.float32)
    live = torch.as_tensor(reference.live_lengths(confidence, random_policy(rng, STRIDE), bs, STRIDE),
                           dtype=torch.int32, device="cuda")
    state.live[:bs].copy_(live)
    logits = torch.randn(bs * STRIDE, vocab, device="cuda") * 2
    dead = (torch.arange(STRIDE, device="cuda")[None, :] >= live[:, None]).reshape(-1)
    garbage = torch.where(dead[:, None], torch.randn_like(logits) * 50, logits)
    drafts = logits.view(bs, STRIDE, vocab)[:, :STRIDE - 1].argmax(-1)
    flip = torch.as_tensor(rng.random((bs, STRIDE - 1)) < 0.25, device="cuda")
    drafts = torch.where(flip, (drafts + 1) % vocab, drafts)
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.long, device="cuda"), drafts], dim=1)
    return live, logits, garbage, candidates


def _block(candidates, greedy_draft, vocab, rng):
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
    bs = candidates.shape[0]
    corrected = None if greedy_draft else torch.randn(bs, STRIDE - 1, vocab, device="cuda")
    return DraftBlockResult(draft_tokens=candidates[:, 1:].contiguous(), corrected_logits=corrected,
                            greedy_mask=torch.zeros(bs, dtype=torch.bool, device="cuda"),
                            temperatures=torch.full((bs, 1), 0.8, device="cuda"), greedy_draft=greedy_draft)


def _sampled(bs):
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import GraphSamplingInfo
    return GraphSamplingInfo(temperatures=torch.full((bs, 1), 0.7, device="cuda"))


@pytest.mark.parametrize("path", ["sampling", "blockwise"])
def test_sampled_accept_commits_what_sglang_commits_with_the_cutoff_at_l(gpu_patched, path):
    """>= 2,000 verifies: vcap's patched accept (garbage on dead rows) commits bitwise what SGLang's
    unpatched accept commits on the target's logits with its own cutoff at L; 0 dead rows committed."""
    from sglang.kernels.ops.speculative.dspark.blockwise_rejection import make_rejection_noise
    from sglang.srt.speculative.dspark_components import dspark_verify
    state, rng, vocab = gpu_patched, np.random.default_rng(11), 4096
    verifies = capped = 0
    for step in range(40):
        bs = MAX_BS
        live, logits, garbage, candidates = _step(state, rng, bs, vocab)
        block = _block(candidates, greedy_draft=step % 2 == 0, vocab=vocab, rng=rng)
        common = dict(candidates=candidates, draft_block=block, sampling_info=_sampled(bs), draft_input=None,
                      gamma=STRIDE - 1, verify_num_draft_tokens=STRIDE)
        noise = (lambda: make_rejection_noise(step, "cuda")) if path == "blockwise" else (lambda: None)
        torch.manual_seed(step)
        got = dspark_verify.accept_draft_tokens(target_logits=garbage, rejection_noise=noise(), **common)
        torch.manual_seed(step)
        want = dspark_verify.accept_draft_tokens.__wrapped__(
            target_logits=logits, rejection_noise=noise(), cutoff_layout=SimpleNamespace(verify_lens=live), **common)
        assert torch.equal(got[0], want[0]), step
        assert torch.equal(got[1].long(), want[1].long()), step
        assert bool((got[0] <= live - 1).all())
        verifies += bs
        capped += int((live < STRIDE).sum())
    assert verifies >= 2000 and capped > 500


def test_fused_argmax_greedy_accept_equals_a_verify_of_l_rows(gpu_patched):
    from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy
    from sglang.srt.speculative.dspark_components import dspark_verify
    state, rng, vocab, bs = gpu_patched, np.random.default_rng(12), 4096, 10  # 60 rows: fused argmax applies
    for step in range(200):
        live, logits, garbage, candidates = _step(state, rng, bs, vocab)
        correct_len, bonus, _ = dspark_verify.accept_draft_tokens(
            candidates=candidates, target_logits=garbage, draft_block=_block(candidates, True, vocab, rng),
            sampling_info=None, draft_input=None, gamma=STRIDE - 1, verify_num_draft_tokens=STRIDE,
            fused_argmax=True)
        for b in range(bs):
            length = int(live[b])
            alone_len, alone_bonus, _ = AcceptGreedy.execute(
                candidates=candidates[b:b + 1, :length].contiguous(),
                target_logits=logits[b * STRIDE:b * STRIDE + length].contiguous(), verify_num_draft_tokens=length,
                fused_argmax=True)
            assert int(correct_len[b]) == int(alone_len[0]) <= length - 1, (step, b)
            assert int(bonus[b]) == int(alone_bonus[0]), (step, b)


def _tp_sync():
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync
    return SpecTpSync(SimpleNamespace(world_size=1, rank_in_group=0))


def _graph(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: Triton compiles outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def test_folded_greedy_accept_in_a_cuda_graph_follows_the_policy_of_each_replay(gpu_patched):
    """``DsparkVerifyEpilogue._accept`` (fused argmax) captured once; each replay takes that step's
    live lengths from vcap's persistent buffer."""
    from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy
    from sglang.srt.speculative.dspark_components.dspark_verify import DsparkVerifyEpilogue
    state, rng, vocab, bs = gpu_patched, np.random.default_rng(13), 4096, 10
    epilogue = DsparkVerifyEpilogue(max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device="cuda",
                                    tp_sync=_tp_sync(), fused_argmax=True)
    candidates = torch.zeros(bs, STRIDE, dtype=torch.long, device="cuda")
    logits = torch.zeros(bs * STRIDE, vocab, device="cuda")
    seq_lens = torch.full((bs,), 100, dtype=torch.int64, device="cuda")
    graph = _graph(lambda: epilogue._accept(candidates=candidates, logits=logits,
                                            draft_tokens=candidates[:, 1:].contiguous(), seq_lens=seq_lens))
    for step in range(300):
        live, true_logits, garbage, step_candidates = _step(state, rng, bs, vocab)
        candidates.copy_(step_candidates)
        logits.copy_(garbage)
        graph.replay()
        outs = epilogue.read_accept(bs)
        for b in range(bs):
            length = int(live[b])
            alone_len, alone_bonus, _ = AcceptGreedy.execute(
                candidates=step_candidates[b:b + 1, :length].contiguous(),
                target_logits=true_logits[b * STRIDE:b * STRIDE + length].contiguous(),
                verify_num_draft_tokens=length, fused_argmax=True)
            assert int(outs.correct_len[b]) == int(alone_len[0]) <= length - 1, (step, b)
            assert int(outs.bonus[b]) == int(alone_bonus[0]), (step, b)


def test_sampling_accept_region_in_a_cuda_graph_follows_the_policy_of_each_replay(gpu_patched):
    """The region ``DsparkSamplingAcceptGraph`` captures (``sampling_accept_commit_lens``, blockwise
    rejection: its draws are keyed by a device counter, so a replay is reproducible) captured once;
    each replay equals SGLang's unpatched accept on the target's logits with the cutoff at L."""
    from sglang.kernels.ops.speculative.dspark.blockwise_rejection import make_rejection_noise
    from sglang.srt.speculative.dspark_components import dspark_verify
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import sampling_accept_commit_lens
    state, rng, vocab, bs = gpu_patched, np.random.default_rng(14), 4096, 32
    epilogue = dspark_verify.DsparkVerifyEpilogue(
        max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device="cuda", tp_sync=_tp_sync())
    io = SimpleNamespace(candidates=torch.zeros(bs, STRIDE, dtype=torch.long, device="cuda"),
                         logits=torch.zeros(bs * STRIDE, vocab, device="cuda"),
                         seq_lens=torch.full((bs,), 100, dtype=torch.int64, device="cuda"))
    params = SimpleNamespace(greedy_mask=torch.zeros(bs, dtype=torch.bool, device="cuda"),
                             temperatures=torch.full((bs, 1), 0.7, device="cuda"))
    sampler = SimpleNamespace(params=params, greedy_draft=True, step_logits=None)
    noise = make_rejection_noise(7, "cuda")
    region = lambda: sampling_accept_commit_lens(  # noqa: E731
        io, verify_lens=torch.full((bs,), STRIDE, dtype=torch.int32, device="cuda"),
        gate=torch.ones(1, dtype=torch.int32, device="cuda"), gated=False, draft_sampler=sampler,
        epilogue=epilogue, tp_sync=_tp_sync(), fused_argmax=False, block_verification=False, rejection_noise=noise)
    graph = _graph(region)
    for step in range(100):
        live, true_logits, garbage, candidates = _step(state, rng, bs, vocab)
        io.candidates.copy_(candidates)
        io.logits.copy_(garbage)
        counter = noise.counter.clone()
        graph.replay()
        outs = epilogue.read_accept(bs)
        reference_noise = make_rejection_noise(7, "cuda")
        reference_noise.counter.copy_(counter)
        from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
        block = DraftBlockResult(draft_tokens=candidates[:, 1:].contiguous(), corrected_logits=None,
                                 greedy_mask=params.greedy_mask, temperatures=params.temperatures, greedy_draft=True)
        want_len, want_bonus, _ = dspark_verify.accept_draft_tokens.__wrapped__(
            candidates=candidates, target_logits=true_logits, draft_block=block, sampling_info=_sampled(bs),
            draft_input=None, gamma=STRIDE - 1, verify_num_draft_tokens=STRIDE,
            cutoff_layout=SimpleNamespace(verify_lens=live), rejection_noise=reference_noise)
        assert torch.equal(outs.correct_len, want_len), step
        assert torch.equal(outs.bonus.long(), want_bonus.long()), step
        assert bool((outs.correct_len <= live - 1).all())


def _special_scores(rows, experts, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(rows, experts, device="cuda", generator=g) * 4
    scores[0, 3] = float("nan")
    scores[1, :5] = float("nan")
    scores[2, 7] = float("inf")
    scores[3, 2] = float("-inf")
    scores[4, :] = 0.5
    scores[5, :] = float("nan")
    scores[6, :] = float("inf")
    scores[7, :] = -30.0  # softplus underflow region
    scores[8, :] = 25.0   # above the x > 20 switch
    return scores.to(dtype)


@pytest.mark.parametrize("log1p", [False, True], ids=["v4", "v41"])
@pytest.mark.parametrize("experts,topk", [(384, 6), (256, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("padded", [False, True], ids=["all-rows", "padded"])
def test_router_is_bitwise_sglangs_gate(gpu_patched, log1p, experts, topk, dtype, padded):
    """vcap's gate path (policy off) against SGLang's own ``moe_fused_gate`` as DeepSeek-V4 / V4.1
    call it: ids, weights (NaN bits too) and packed ids bitwise."""
    from sglang.kernels.ops.moe import moe_fused_gate as gate_module
    state = gpu_patched
    state.live.fill_(STRIDE)
    rows = 40 * STRIDE
    scores = _special_scores(rows, experts, dtype, experts + topk)
    bias = (0.1 * torch.randn(experts, device="cuda")).to(torch.bfloat16)
    ntnp = torch.tensor(rows - 7, dtype=torch.int32, device="cuda") if padded else None
    options = dict(scoring_func="sqrtsoftplus", renormalize=True, routed_scaling_factor=2.5,
                   apply_routed_scaling_factor_on_output=True, num_token_non_padded=ntnp, sqrtsoftplus_log1p=log1p)
    original = gate_module.moe_fused_gate.__wrapped__  # SGLang's, under vcap's registered wrapper
    want_packed = torch.empty(rows, topk, dtype=torch.int32, device="cuda")
    want_w, want_ids = original(scores, bias, topk, packed_out=want_packed, **options)
    got_packed = torch.empty_like(want_packed)
    state.in_verify = True
    try:
        got_w, got_ids = gate_module.moe_fused_gate(scores, bias, topk, packed_out=got_packed, **options)
    finally:
        state.in_verify = False
    torch.cuda.synchronize()
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    assert torch.equal(got_packed, want_packed)
    if os.environ.get("VCAP_GPU_VERBOSE"):
        print(f"router {'v41' if log1p else 'v4'} {experts}x{topk} {dtype} padded={padded}: bitwise")
