"""SGLang 0.5.23's modes under vcap, on the CPU through SGLang's own code: each runs exact
(batches above the largest decode graph, cap-accept verify, V4/V4.1 gate options, padded graph
rows) or is refused at start-up with a message naming the mode (docs/sglang.md has the table)."""

import os
import stat
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vcap.engine_hook import patches, sglang_hooks, sglang_modes, sglang_plugin
from vcap.engine_hook.patches import PatchError
from vcap.policy import Bucket, Policy
from vcap.segment import Segment

STRIDE, VOCAB = 6, 32


def _bags(*, max_bs=64, max_running_requests=256, a2a="none", tbo=False, attn_dp=False, dwdp=1, attn_cp=1,
          pp=1, block_verification=False, attn_tp_size=2, attn_dp_rank=0):
    """The config bags SGLang publishes before ``Scheduler.__init__``, with the fields vcap reads."""
    decode = SimpleNamespace(max_bs=max_bs, bs=[b for b in (1, 2, 4, 8, 16, 32) if b < max_bs] + [max_bs])
    exec_ = SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=decode)),
                            moe=SimpleNamespace(moe_a2a_backend=a2a, enable_eplb=False),
                            overlap=SimpleNamespace(enable_two_batch_overlap=tbo))
    parallel = SimpleNamespace(attn_dp_enabled=attn_dp, dwdp_size=dwdp, attn_cp_size=attn_cp, pp_size=pp,
                               attn_tp_size=attn_tp_size, tp_size=2, attn_dp_rank=attn_dp_rank)
    server_args = SimpleNamespace(moe_a2a_backend=a2a, deepep_mode="auto", deepep_dispatcher_output_dtype="auto",
                                  moe_runner_backend="auto")
    return dict(get_exec=lambda: exec_, get_parallel=lambda: parallel, get_server_args=lambda: server_args,
                get_schedule=lambda: SimpleNamespace(max_running_requests=max_running_requests),
                get_spec=lambda: SimpleNamespace(speculative_use_block_verification=block_verification))


def _publish(monkeypatch, **options):
    import sglang.srt.runtime_context as runtime_context
    for name, getter in _bags(**options).items():
        monkeypatch.setattr(runtime_context, name, getter)


@pytest.fixture
def fresh_state():
    state = sglang_hooks.engine_state
    saved = dict(vars(state))
    yield state
    if state.hook is not None and state.hook is not saved["hook"]:
        state.hook.close()
    vars(state).update(saved)


def _build_engine(monkeypatch, segment_name, config=None, group=None, **options):
    """What the first target-verify warm-up runs on TP rank 0 (CPU tensors)."""
    import sglang.srt.layers.dp_attention as dp_attention
    _publish(monkeypatch, **options)
    group = group or SimpleNamespace(rank_in_group=0, world_size=1)
    monkeypatch.setattr(dp_attention, "get_dp_tp_group", lambda: group)
    monkeypatch.setenv(sglang_plugin.ENV_SEGMENT, segment_name)
    model = SimpleNamespace(config=config or SimpleNamespace(num_hidden_layers=2, n_routed_experts=16,
                                                             num_experts_per_tok=4, hidden_size=256))
    batch = SimpleNamespace(batch_size=4, forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    input_ids = torch.zeros(4 * STRIDE, dtype=torch.long)
    sglang_hooks.around_model_forward(lambda *a: None, model, input_ids, None, batch)
    return sglang_hooks.engine_state


def _write_policy(segment_name, k):
    sidecar = Segment.attach(segment_name)
    sidecar.write_policy(Policy("fixed", k, (Bucket(1, 1, STRIDE - 1, (0.0,) * (STRIDE - 1)),)), 1, "manual")
    sidecar.heartbeat[0] += 1
    return sidecar


def _greedy_step(bs, rng):
    """Random logits and drafts that agree with the target's argmax for a random prefix."""
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult, DraftProposal
    logits = torch.randn(bs * STRIDE, VOCAB)
    drafts = logits.argmax(-1).view(bs, STRIDE)[:, :STRIDE - 1].clone()
    agree = rng.integers(0, STRIDE, bs)
    for b in range(bs):
        if agree[b] < STRIDE - 1:
            drafts[b, agree[b]] = (drafts[b, agree[b]] + 1) % VOCAB
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.long), drafts], dim=1)
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None, greedy_mask=torch.ones(bs, dtype=torch.bool),
                             temperatures=torch.ones(bs, 1), greedy_draft=True)
    proposal = DraftProposal(draft_block_ids=candidates, draft_block=block,
                             confidence=torch.full((bs, STRIDE - 1), 0.9))
    return logits, candidates, block, proposal


def _accept(candidates, logits, block, layout=None):
    from sglang.srt.speculative.dspark_components import dspark_verify
    return dspark_verify.accept_draft_tokens(
        candidates=candidates, target_logits=logits, draft_block=block, sampling_info=None, draft_input=None,
        gamma=STRIDE - 1, verify_num_draft_tokens=STRIDE, cutoff_layout=layout)


def _unpatched_accept(candidates, logits, block, verify_lens):
    from sglang.srt.speculative.dspark_components import dspark_verify
    return dspark_verify.accept_draft_tokens.__wrapped__(
        candidates=candidates, target_logits=logits, draft_block=block, sampling_info=None, draft_input=None,
        gamma=STRIDE - 1, verify_num_draft_tokens=STRIDE, cutoff_layout=SimpleNamespace(verify_lens=verify_lens))


# -- 1. batches above the largest decode graph ------------------------------------------------

def test_buffers_follow_sglangs_rule_and_eager_batches_above_the_largest_graph_are_capped(
        patched, fresh_state, monkeypatch, segment_name):
    state = _build_engine(monkeypatch, segment_name, max_bs=64, max_running_requests=256)
    assert state.max_bs == 256  # max(largest decode graph, max_running_requests), SGLang's own rule
    sidecar = _write_policy(segment_name, 1)
    rng = np.random.default_rng(1)
    for bs in (65, 200, 256):  # eager: above the largest graph
        logits, candidates, block, proposal = _greedy_step(bs, rng)
        sidecar.heartbeat[0] += 1  # the lease, renewed as a sidecar does (the first step may be slow)
        sglang_hooks.after_propose(proposal, None, bs=bs)
        assert state.live[:bs].tolist() == [2] * bs
        correct_len, _, _ = _accept(candidates, logits, block)
        assert int(correct_len.max()) <= 1
        sglang_hooks.after_accept(SimpleNamespace(correct_len=correct_len))


def test_a_batch_above_the_buffers_verifies_every_draft(patched, fresh_state, monkeypatch, segment_name):
    state = _build_engine(monkeypatch, segment_name, max_bs=8, max_running_requests=16)
    _write_policy(segment_name, 1)
    logits, candidates, block, proposal = _greedy_step(20, np.random.default_rng(2))
    sglang_hooks.after_propose(proposal, None, bs=20)  # no raise: the step is not capped
    assert state.bs == 0
    correct_len, _, _ = _accept(candidates, logits, block)
    full, _, _ = _unpatched_accept(candidates, logits, block, torch.full((20,), STRIDE, dtype=torch.int32))
    assert torch.equal(correct_len, full)


def test_segment_group_makes_the_segment_group_readable(patched, fresh_state, monkeypatch, segment_name):
    monkeypatch.setenv(sglang_hooks.ENV_SEGMENT_GROUP, str(os.getgid()))
    _build_engine(monkeypatch, segment_name)
    info = os.stat(f"/dev/shm/{segment_name}")
    assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == os.getgid()


# -- 3. cap-accept: SGLang's verify lengths and vcap's, combined --------------------------------

def test_cap_accept_commits_the_smaller_cutoff_exactly(patched, fresh_state, monkeypatch, segment_name):
    """SGLang's cap-accept layout (random verify_lens) and vcap's L: the patched accept, vcap's dead
    rows holding garbage, commits what SGLang's unpatched accept commits with min(L, verify_len)."""
    state = _build_engine(monkeypatch, segment_name, max_bs=16, max_running_requests=16)
    sidecar = Segment.attach(segment_name)
    rng = np.random.default_rng(3)
    seen_below = 0
    for generation in range(1, 61):
        k = int(rng.integers(1, STRIDE))
        sidecar.write_policy(Policy("fixed", k, (Bucket(1, 1, STRIDE - 1, (0.0,) * (STRIDE - 1)),)), generation,
                             "manual")
        bs = int(rng.integers(1, 17))
        logits, candidates, block, proposal = _greedy_step(bs, rng)
        sidecar.heartbeat[0] += 1
        sglang_hooks.after_propose(proposal, None, bs=bs)
        live = state.live[:bs].clone()
        verify_lens = torch.as_tensor(rng.integers(1, STRIDE + 1, bs), dtype=torch.int32)
        cutoff = torch.minimum(live, verify_lens)
        dead = (torch.arange(STRIDE)[None, :] >= live[:, None]).reshape(-1)  # vcap's: no experts
        garbage = logits.clone()
        garbage[dead] = torch.randn(int(dead.sum()), VOCAB) * 100
        got = _accept(candidates, garbage, block, SimpleNamespace(verify_lens=verify_lens))
        want = _unpatched_accept(candidates, logits, block, cutoff)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), generation  # committed tokens
        # SGLang's trimmed count (its estimator's statistic), as a verify of L rows counts it
        assert torch.equal(got[2], torch.minimum(want[0] + want[2], live - 1) - want[0]), generation
        assert (got[0] <= cutoff - 1).all()
        seen_below += int((live < verify_lens).sum())
        out = SimpleNamespace(cap_lens=verify_lens.clone())
        sglang_hooks.after_forward_decode(out, None)
        assert torch.equal(out.cap_lens, cutoff)
    assert seen_below > 20  # vcap's cap was the smaller one often


def test_cap_accept_l2_never_accepts_more_than_one(patched, fresh_state, monkeypatch, segment_name):
    """The case the review saw: L = 2 under a layout that verifies 6."""
    state = _build_engine(monkeypatch, segment_name, max_bs=4, max_running_requests=4)
    sidecar = _write_policy(segment_name, 1)
    logits, candidates, block, proposal = _greedy_step(4, np.random.default_rng(4))
    candidates[:, 1:] = logits.argmax(-1).view(4, STRIDE)[:, :STRIDE - 1]  # every draft right
    sidecar.heartbeat[0] += 1
    sglang_hooks.after_propose(proposal, None, bs=4)
    assert state.live[:4].tolist() == [2] * 4
    correct_len, _, _ = _accept(candidates, logits, block, SimpleNamespace(verify_lens=torch.full((4,), 6, dtype=torch.int32)))
    assert correct_len.tolist() == [1] * 4


# -- 2 and 5d. the gate: V4 and V4.1 options, NaN order, padded rows -------------------------

def _sglang_gate(scores, bias, topk, *, log1p, num_token_non_padded=None, packed=False, scale=2.5):
    """SGLang's own router kernel, launched as ``moe_fused_gate`` launches it for DeepSeek-V4/V4.1
    (the interpreter cannot take the launcher's None arguments, so they become unused tensors)."""
    from sglang.kernels.ops.moe.moe_fused_gate import _router_triton_kernel
    rows, experts = scores.shape
    weights = torch.empty(rows, topk)
    ids = torch.empty(rows, topk, dtype=torch.int32)
    packed_out = torch.empty(rows, topk, dtype=torch.int32)
    unused = torch.zeros(1, dtype=torch.int32)
    block_n = 1 << (experts - 1).bit_length()
    _router_triton_kernel[(rows,)](
        scores, bias, bias, unused, num_token_non_padded if num_token_non_padded is not None else unused,
        weights, ids, packed_out, rows, scale, 0.0, N=experts, K=topk, K_ROUTED=topk, BLOCK_M=1, BLOCK_N=block_n,
        BLOCK_K=1 << (topk - 1).bit_length(), N_GROUP=1, TOPK_GROUP=1, EXPERTS_PER_GROUP=experts, BLOCK_G=1,
        SCORING_FUNC=1, SQRTSOFTPLUS_LOG1P=log1p, HAS_SOFTCAP=False, RENORMALIZE=True, APPLY_SCALE=True,
        HAS_BIAS=True, HAS_TOKEN_BIAS=False, BIAS_ALT_TOKEN_ID=0, HAS_PADDING=num_token_non_padded is not None,
        HAS_PACKED=packed, RENORMALIZE_EPSILON=0.0, USE_PDL=False, stride_bias=1, stride_bias_alt=0,
        stride_input_ids=0, stride_sm=scores.stride(0), stride_sn=1, stride_wm=topk, stride_wk=1, stride_im=topk,
        stride_ik=1, stride_pm=topk, stride_pk=1, num_warps=1)
    return weights, ids, packed_out


def _special_scores(rows, experts, rng):
    scores = torch.as_tensor(rng.standard_normal((rows, experts)) * 4, dtype=torch.float32)
    scores[0, 3] = float("nan")
    scores[1, :5] = float("nan")
    scores[2, 7] = float("inf")
    scores[3, 2] = float("-inf")
    scores[4, :] = 0.5  # every expert tied
    scores[5, :] = float("nan")
    return scores


@pytest.mark.parametrize("model,log1p", [("deepseek_v4", False), ("deepseek_v41", True)])
@pytest.mark.parametrize("padded", [False, True])
def test_gate_in_a_verify_routes_as_sglangs_gate(patched, fresh_state, monkeypatch, segment_name, model, log1p,
                                                 padded):
    """Policy off (every row live): the patched ``moe_fused_gate`` called as SGLang's DeepSeek-V4
    / V4.1 layer calls it equals SGLang's kernel, NaN/inf rows and padded graph rows included."""
    from sglang.kernels.ops.moe import moe_fused_gate as gate_module
    state = _build_engine(monkeypatch, segment_name, max_bs=4, max_running_requests=4)
    state.live.fill_(STRIDE)
    rows, experts, topk = 3 * STRIDE, 24, 6
    scores = _special_scores(rows, experts, np.random.default_rng(5))
    bias = torch.as_tensor(np.random.default_rng(6).standard_normal(experts) * 0.1).to(torch.bfloat16)
    ntnp = torch.tensor(2 * STRIDE + 1, dtype=torch.int32) if padded else None
    packed = torch.empty(rows, topk, dtype=torch.int32)
    state.in_verify = True
    weights, ids = gate_module.moe_fused_gate(
        scores, bias, topk, scoring_func="sqrtsoftplus", renormalize=True, routed_scaling_factor=2.5,
        apply_routed_scaling_factor_on_output=True, num_token_non_padded=ntnp, packed_out=packed,
        sqrtsoftplus_log1p=log1p)
    want_w, want_ids, want_packed = _sglang_gate(scores, bias, topk, log1p=log1p, num_token_non_padded=ntnp,
                                                 packed=True)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights.view(torch.int32), want_w.view(torch.int32))  # NaN weights bitwise too
    assert torch.equal(packed, want_packed)
    if padded:
        assert (ids[2 * STRIDE + 1:] == -1).all()


# -- 4 and 5. refusals at start-up ----------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    (dict(a2a="deepep"), "--moe-a2a-backend deepep"),
    (dict(a2a="mooncake"), "--moe-a2a-backend mooncake"),
    (dict(attn_dp=True), "attention data parallelism"),
    (dict(tbo=True), "--enable-two-batch-overlap"),
    (dict(dwdp=2), "--dwdp-size 2"),
    (dict(attn_cp=2), "--attn-cp-size 2"),
    (dict(pp=2), "--pp-size 2"),
    (dict(block_verification=True), "--speculative-use-block-verification"),
])
def test_server_layouts_vcap_cannot_follow_stop_the_scheduler_before_the_model_loads(patched, monkeypatch,
                                                                                     options, message):
    from sglang.srt.managers.scheduler import Scheduler
    _publish(monkeypatch, **options)
    with pytest.raises(PatchError, match=message.replace("-", r"\-")):
        Scheduler.__init__(object.__new__(Scheduler), None, None)  # vcap's before-hook runs first


@pytest.mark.parametrize("options", [
    dict(),
    dict(a2a="deepep", attn_dp=True, attn_tp_size=1),  # each rank's MoE gets its own rows, from row 0
    dict(a2a="mooncake", attn_tp_size=1),
])
def test_a_supported_layout_passes_the_start_up_check(monkeypatch, options):
    _publish(monkeypatch, **options)
    sglang_modes.check_server_layout()


@pytest.mark.parametrize("dp_rank,suffix", [(0, ""), (1, "-dp1"), (3, "-dp3")])
def test_each_attention_dp_rank_publishes_its_own_segment(patched, fresh_state, monkeypatch, segment_name,
                                                          dp_rank, suffix):
    """Attention DP with an all-to-all MoE: rank 0 of every DP rank's group decides its own requests'
    lengths, each into its own segment (one sidecar, or one watcher, per segment)."""
    state = _build_engine(monkeypatch, segment_name, a2a="deepep", attn_dp=True, attn_tp_size=1,
                          attn_dp_rank=dp_rank)
    assert state.hook.segment.path.endswith(segment_name + suffix)


def _register(env: dict) -> subprocess.CompletedProcess:
    stubs = os.path.join(os.path.dirname(__file__), "stubs")
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {stubs!r})
        os.environ.update({env!r})
        from vcap.engine_hook import sglang_plugin
        sglang_plugin.register()
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("env,message", [
    ({"SGLANG_RAGGED_VERIFY_MODE": "compact"}, "SGLANG_RAGGED_VERIFY_MODE=compact"),
    ({"SGLANG_SIMULATE_ACC_LEN": "3.5"}, "SGLANG_SIMULATE_ACC_LEN=3.5"),
    ({"SGLANG_RAGGED_VERIFY_MODE": "bogus"}, "invalid SGLANG_RAGGED_VERIFY_MODE='bogus'"),
    ({"VCAP_SEGMENT_GROUP": "no-such-group-vcap"}, "VCAP_SEGMENT_GROUP='no-such-group-vcap'"),
])
def test_environment_switches_vcap_cannot_follow_stop_start_up(env, message):
    result = _register({"VCAP_SEGMENT": "x", **env})
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]


def test_cap_accept_mode_starts():
    result = _register({"VCAP_SEGMENT": "x", "SGLANG_RAGGED_VERIFY_MODE": "cap-accept"})
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_changed_default_or_kind_is_refused(monkeypatch):
    """Same parameter names, different default (or a parameter made keyword-only): refused."""
    import sglang.kernels.ops.moe.moe_fused_gate as gate_module
    site = next(p for p in sglang_plugin.PATCHES if p.target.endswith(".moe_fused_gate"))

    def changed_default(scores, bias, topk, scoring_func="sqrtsoftplus", num_fused_shared_experts=0,
                        renormalize=True, routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=False,
                        moe_softcapping=0.0, num_expert_group=1, topk_group=1, *, bias_alt=None, input_ids=None,
                        bias_alt_token_id=None, num_token_non_padded=None, renormalize_epsilon=0.0,
                        packed_out=None, sqrtsoftplus_log1p=False):
        raise AssertionError("never called")

    def changed_kind(scores, bias, topk, scoring_func="sigmoid", num_fused_shared_experts=0,
                     renormalize=True, routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=False,
                     moe_softcapping=0.0, num_expert_group=1, topk_group=1, bias_alt=None, input_ids=None,
                     bias_alt_token_id=None, num_token_non_padded=None, renormalize_epsilon=0.0,
                     packed_out=None, sqrtsoftplus_log1p=False):
        raise AssertionError("never called")

    for changed, detail in ((changed_default, "scoring_func='sqrtsoftplus'"), (changed_kind, "topk_group=1, bias_alt")):
        monkeypatch.setattr(gate_module, "moe_fused_gate", changed)
        with pytest.raises(PatchError, match="Refusing to start") as error:
            patches.check(site)
        assert detail in str(error.value)


# -- dispatch_row_bytes: what a dead row saves in the all-to-all, from SGLang's own ServerArgs --------

def _server_args(**options):
    from sglang.srt.server_args import ServerArgs
    return ServerArgs(model_path="unused", **options)


@pytest.fixture(scope="module")
def v41_text_config():
    from sglang.srt.configs.deepseek_v41 import DeepseekV41TextConfig
    config = DeepseekV41TextConfig()
    assert config.hidden_size % 128 == 0 and config.num_experts_per_tok > 1
    return config


@pytest.mark.parametrize("backend", ["none", "mooncake", "nixl", "mori", "flashinfer", "megamoe", "pplx"])
def test_dispatch_row_bytes_is_zero_without_dispatch_or_a_known_wire_format(backend, v41_text_config):
    assert sglang_modes.dispatch_row_bytes(_server_args(moe_a2a_backend=backend), v41_text_config) == 0


@pytest.mark.parametrize("options", [{}, {"deepep_mode": "low_latency"}, {"deepep_dispatcher_output_dtype": "fp8"},
                                     {"deepep_dispatcher_output_dtype": "int8"}])
def test_deepep_low_latency_sends_fp8_with_a_float_scale_per_128_channels_to_each_routed_expert(
        options, v41_text_config):
    hidden, top_k = v41_text_config.hidden_size, v41_text_config.num_experts_per_tok
    args = _server_args(moe_a2a_backend="deepep", **options)
    # DeepEP's low-latency message: int4 header + FP8 hidden + hidden/128 float32 scales, per expert
    assert sglang_modes.dispatch_row_bytes(args, v41_text_config) == top_k * (16 + hidden + 4 * hidden // 128)


@pytest.mark.parametrize("options, env", [({"deepep_dispatcher_output_dtype": "bf16"}, None),
                                          ({}, "1"), ({"moe_runner_backend": "cutlass"}, None),
                                          ({"moe_runner_backend": "flashinfer_cutedsl"}, None)])
def test_deepep_sends_bf16_when_asked_or_when_the_runner_quantizes_itself(options, env, v41_text_config,
                                                                          monkeypatch):
    if env is not None:
        monkeypatch.setenv("SGLANG_DEEPEP_BF16_DISPATCH", env)
    hidden, top_k = v41_text_config.hidden_size, v41_text_config.num_experts_per_tok
    args = _server_args(moe_a2a_backend="deepep", **options)
    assert sglang_modes.dispatch_row_bytes(args, v41_text_config) == top_k * (16 + 2 * hidden)


def test_deepep_normal_mode_counts_one_copy_fp8_only_after_deepgemm_quantizes(v41_text_config, monkeypatch):
    from sglang.srt.layers import deep_gemm_wrapper
    hidden = v41_text_config.hidden_size
    args = _server_args(moe_a2a_backend="deepep", deepep_mode="normal")
    monkeypatch.setattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", False)
    assert sglang_modes.dispatch_row_bytes(args, v41_text_config) == 2 * hidden
    monkeypatch.setattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", True)
    assert sglang_modes.dispatch_row_bytes(args, v41_text_config) == hidden + 4 * hidden // 128


def test_deepep_nvfp4_dispatch_is_not_claimed(v41_text_config):
    args = _server_args(moe_a2a_backend="deepep", deepep_dispatcher_output_dtype="nvfp4")
    assert sglang_modes.dispatch_row_bytes(args, v41_text_config) == 0


@pytest.mark.parametrize("strategy", ["drop", "anchor"])
def test_the_segment_states_the_row_size_and_the_layers_vcap_routes(
        patched, fresh_state, monkeypatch, segment_name, strategy):
    """The header the sidecar reads: the gate-routed MoE layers (V4's hash layers route by token
    id, not through the gate) and what a dead row does not dispatch, from SGLang's own rule."""
    from sglang.srt.configs.deepseek_v41 import DeepseekV41TextConfig
    config = DeepseekV41TextConfig(num_hash_layers=3)  # as a checkpoint's config.json states it
    monkeypatch.setenv(sglang_hooks.ENV_DEAD_ROWS, strategy)
    state = _build_engine(monkeypatch, segment_name, config=config, a2a="deepep", attn_tp_size=1)
    header = Segment.attach(segment_name).config
    # SGLang's DeepseekV2MoE: layer_id < num_hash_layers routes by hash (no gate call)
    assert header.num_moe_layers == config.num_hidden_layers - 3
    server_args = SimpleNamespace(moe_a2a_backend="deepep", deepep_mode="auto",
                                  deepep_dispatcher_output_dtype="auto", moe_runner_backend="auto")
    expected_bytes = sglang_modes.dispatch_row_bytes(server_args, config) if strategy == "drop" else 0
    assert header.dispatch_row_bytes == expected_bytes and (strategy == "anchor" or expected_bytes > 0)
    assert state.hook.strategy == strategy


@pytest.mark.parametrize("peer", ["same machine", "another machine", "asked for the broadcast"])
def test_tp_rank0_sends_its_lengths_through_the_peer_inbox_on_one_machine(
        patched, fresh_state, monkeypatch, segment_name, peer):
    """TP = 2, rank 0's side of the start-up exchange (rank 1 answered by the test, which plays
    its inbox): on one machine the first verify builds the mapped inbox and each step publishes
    rank 0's lengths into it; across machines, or with VCAP_TP_SHARE=broadcast, the broadcast stays."""
    from vcap.engine_hook import tp_share
    inbox_path = f"/dev/shm/vcap-test-inbox-{os.getpid()}-{len(peer)}"
    inbox = torch.from_file(inbox_path, shared=True, size=tp_share.INBOX_HEAD + 2 * 16, dtype=torch.int32)
    inbox.zero_()
    host = tp_share._host_id() if peer != "another machine" else "elsewhere/boot"
    broadcasts = []
    rounds = []

    def all_gather_object(obj):
        rounds.append(obj)
        return [obj, (host, inbox_path, None) if len(rounds) == 1 else None]

    group = SimpleNamespace(rank_in_group=0, world_size=2, all_gather_object=all_gather_object,
                            broadcast=lambda tensor, src=0: broadcasts.append(tensor.clone()))
    if peer == "asked for the broadcast":
        monkeypatch.setenv(sglang_hooks.ENV_TP_SHARE, "broadcast")
    try:
        state = _build_engine(monkeypatch, segment_name, max_bs=16, max_running_requests=16, group=group)
        sidecar = _write_policy(segment_name, 2)
        logits, candidates, block, proposal = _greedy_step(4, np.random.default_rng(5))
        sidecar.heartbeat[0] += 1
        sglang_hooks.after_propose(proposal, None, bs=4)
        assert state.live[:4].tolist() == [3] * 4
        if peer == "same machine":
            assert state.share is not None and len(rounds) == 2 and not broadcasts
            slot = 1  # the first step's epoch
            assert inbox[slot].item() == 1
            start = tp_share.INBOX_HEAD + slot * 16
            assert inbox[start:start + 16].tolist() == state.live.tolist()
        else:
            assert state.share is None and len(broadcasts) == 1
            assert broadcasts[0].tolist() == state.live.tolist()
            assert len(rounds) == (0 if peer == "asked for the broadcast" else 2)
    finally:
        os.unlink(inbox_path)
