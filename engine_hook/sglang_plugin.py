"""vcap inside SGLang (verified on 0.5.23): the plugin SGLang loads in every scheduler process.

Enabled by ``VCAP_SEGMENT=<name>`` (``python -m vcap.engine_hook.launch`` sets it); without it
the plugin does nothing. Per verify step, in the order SGLang's DSpark worker runs:

0. ``Scheduler.get_next_batch_to_run``: the length of the scheduler's waiting queue, for the
   record (the propose call site sees only the batch, which holds no reference to its scheduler).
1. ``DraftBlockProposer.propose`` (eager): the draft's confidence -> live lengths on TP rank 0
   (policy from the segment), broadcast to the group SGLang's own ``SpecTpSync`` uses, so every
   rank routes and cuts with rank 0's lengths.
2. ``DeepseekV4ForCausalLM.forward``: marks target-verify forwards; the first one (a warm-up,
   before graph capture) builds the hook's buffers, sized from the engine's graph batch size.
3. ``moe_fused_gate`` in every MoE layer of the verify: vcap's router, which gives dead rows
   id -1 and weight 0 inside the same launch.
4. The accept (``accept_draft_tokens``, and the in-graph ``DsparkVerifyEpilogue._accept``) gets
   the live lengths as its cutoff, so at most ``L - 1`` drafts are accepted.
5. After the accept: the telemetry record (TP rank 0), with the device-side exactness guard.
"""

import functools
import inspect
import logging
import os
import threading

import torch

from vcap.segment import Segment, SegmentConfig
from vcap.policy import default_policy

from .patches import Patch, PatchError, apply, sglang_version

__all__ = ["register", "PATCHES", "VERIFIED_ON", "ENV_SEGMENT", "ENV_DEAD_ROWS", "engine_state"]

log = logging.getLogger("vcap.engine_hook")
ENV_SEGMENT = "VCAP_SEGMENT"
ENV_DEAD_ROWS = "VCAP_DEAD_ROWS"          # drop (default) | anchor
VERIFIED_ON = ("0.5.23",)
# Router options vcap's kernel implements; any other makes the gate fall back to SGLang's.
_GATE_DEFAULTS = {"num_fused_shared_experts": 0, "moe_softcapping": 0.0, "bias_alt": None,
                  "input_ids": None, "bias_alt_token_id": None, "renormalize_epsilon": 0.0}


class _EngineState:
    """Per-process state: built at the first verify warm-up, used every step."""

    def __init__(self):
        self.lock = threading.Lock()
        self.hook = None          # VerifyHook on TP rank 0
        self.live = None          # int32 [max_bs] on every rank
        self.stride = self.max_bs = 0
        self.rank, self.group = 0, None
        self.in_verify = False
        self.layer = 0
        self.bs = 0
        self.num_queued = 0       # the scheduler's waiting queue at its last batch choice
        self.guard_reported = False
        self.confidence_reported = False

    @property
    def ready(self) -> bool:
        return self.live is not None


engine_state = _EngineState()


class _Cutoff:
    """What ``accept_draft_tokens`` reads of a layout: the verify length per request."""

    def __init__(self, verify_lens: torch.Tensor):
        self.verify_lens = verify_lens


# -- start-up -------------------------------------------------------------------------------


def _refuse_unsupported_modes() -> None:
    """Modes where vcap would be silently wrong: refuse them at start-up."""
    if os.environ.get("SGLANG_DSPARK_FUSED_ACCEPT_TAIL", "").strip().lower() in ("1", "true", "yes", "on"):
        raise PatchError("SGLANG_DSPARK_FUSED_ACCEPT_TAIL=1 accepts in one kernel that takes no cutoff; "
                         "vcap cannot cap acceptance there. Unset it to run with vcap.")
    dead_rows = os.environ.get(ENV_DEAD_ROWS, "drop")
    if dead_rows not in ("drop", "anchor"):
        raise PatchError(f"{ENV_DEAD_ROWS} must be 'drop' or 'anchor', got {dead_rows!r}")


def _check_parallel_layout() -> None:
    """Attention-DP and two-batch overlap reorder the MoE's rows: not supported (yet)."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.moe.utils import is_tbo_enabled
    if is_dp_attention_enabled():
        raise PatchError("attention data parallelism gathers the rows of all DP ranks before the MoE; "
                         "vcap's dead-row mask does not follow that order yet. Run without "
                         "--attn-dp-size/--enable-dp-attention, or without vcap.")
    if is_tbo_enabled():
        raise PatchError("two-batch overlap splits the verify into micro-batches; vcap's dead-row mask "
                         "does not follow them yet. Run without --enable-two-batch-overlap, or without vcap.")


def _build(model, forward_batch, num_rows: int, device) -> None:
    """Buffers and (rank 0) the segment, from the engine's own configuration."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.runtime_context import get_exec

    _check_parallel_layout()
    bs = forward_batch.batch_size
    if num_rows % bs:
        raise PatchError(f"target verify with {num_rows} rows for {bs} requests: not a [bs, stride] rectangle")
    config = model.config
    graph = get_exec().graph.cuda_graph_config.decode
    max_bs = max(getattr(graph, "max_bs", 0) or 0, max(getattr(graph, "bs", None) or [0]), bs)
    group = get_dp_tp_group()
    state = engine_state
    state.stride, state.max_bs, state.group = num_rows // bs, max_bs, group
    state.rank = group.rank_in_group
    if state.rank == 0:
        from .hook import VerifyHook
        num_drafts = state.stride - 1
        segment = Segment.create(
            os.environ[ENV_SEGMENT],
            SegmentConfig(stride=state.stride, max_bs=max_bs,
                          num_moe_layers=int(getattr(config, "num_hidden_layers", 0)),
                          num_experts=int(config.n_routed_experts), top_k=int(config.num_experts_per_tok)),
            fallback=default_policy(num_drafts))
        state.hook = VerifyHook(segment, device=device, strategy=os.environ.get(ENV_DEAD_ROWS, "drop"))
        state.live = state.hook.live
        print(f"vcap: segment {segment.path} (stride {state.stride}, max_bs {max_bs}, "
              f"{config.n_routed_experts} experts, top-{config.num_experts_per_tok}); SGLang "
              f"{sglang_version()}", flush=True)
    else:
        state.live = torch.full((max_bs,), state.stride, dtype=torch.int32, device=device)


def decide_live_lengths(state: _EngineState, confidence, bs: int) -> None:
    """Rank 0 computes ``L``; every rank of the group ends up with rank 0's (one broadcast)."""
    if state.hook is not None:
        state.hook.prepare(bs, confidence is not None, state.num_queued)
        state.hook.begin(None if confidence is None else confidence.float().contiguous())
        if state.hook.guard_tripped() and not state.guard_reported:
            state.guard_reported = True
            log.critical("vcap: EXACTNESS GUARD TRIPPED: a request accepted more drafts than it "
                         "verified; every row is live from now on. Investigate the accept path.")
    if state.group is not None and state.group.world_size > 1:
        state.group.broadcast(state.live, src=0)


# -- the hooks --------------------------------------------------------------------------------


def _around_model_forward(original_fn, model, input_ids, positions, forward_batch, *args, **kwargs):
    state = engine_state
    verify = forward_batch.forward_mode.is_target_verify()
    if verify and not state.ready:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise PatchError("the first target verify ran inside graph capture: vcap's buffers "
                             "must exist before capture")
        with state.lock:
            if not state.ready:
                _build(model, forward_batch, input_ids.shape[0], input_ids.device)
    previous = state.in_verify
    state.in_verify, state.layer = verify, 0
    try:
        return original_fn(model, input_ids, positions, forward_batch, *args, **kwargs)
    finally:
        state.in_verify = previous


@functools.lru_cache(maxsize=4)
def _gate_signature(original_fn) -> inspect.Signature:
    """Resolved once, not per MoE layer of every eager verify."""
    return inspect.signature(inspect.unwrap(original_fn))


def _around_gate(original_fn, scores, bias, topk, *args, **kwargs):
    state = engine_state
    num_rows = scores.shape[0] if scores.dim() == 2 else 0
    if not (state.ready and state.in_verify and num_rows and num_rows % state.stride == 0
            and num_rows // state.stride <= state.max_bs):
        return original_fn(scores, bias, topk, *args, **kwargs)
    bound = _gate_signature(original_fn).bind(scores, bias, topk, *args, **kwargs)
    bound.apply_defaults()
    options = bound.arguments
    supported = all(options[name] == value for name, value in _GATE_DEFAULTS.items()) and bias is not None
    from .router import SCORING_FUNCS, route
    if not supported or options["scoring_func"] not in SCORING_FUNCS:
        weights, ids = original_fn(scores, bias, topk, *args, **kwargs)
        return _remap_after(weights, ids, options.get("packed_out"), state)
    gate = dict(num_expert_group=options["num_expert_group"], topk_group=options["topk_group"],
                scoring_func=options["scoring_func"], renormalize=options["renormalize"],
                routed_scaling_factor=options["routed_scaling_factor"],
                apply_routed_scaling_factor_on_output=options["apply_routed_scaling_factor_on_output"],
                packed_out=options["packed_out"])
    layer = state.layer
    state.layer += 1
    if state.hook is not None and layer < state.hook.config.num_moe_layers:
        return state.hook.route(layer, scores, bias, topk, **gate)
    return route(scores, bias, topk, live=state.live, stride=state.stride,
                 strategy=os.environ.get(ENV_DEAD_ROWS, "drop"), **gate)


def _remap_after(weights, ids, packed_out, state):
    """Fallback for gate options vcap's router lacks: SGLang's gate, then dead rows dropped
    (torch ops: extra launches in this layer, logged once)."""
    if not getattr(_remap_after, "warned", False):
        _remap_after.warned = True
        log.warning("vcap: a verify gate call uses options vcap's router does not implement; "
                    "dead rows are dropped after SGLang's gate (extra launches per layer)")
    rows = torch.arange(ids.shape[0], device=ids.device)
    dead = (rows % state.stride) >= state.live[(rows // state.stride).clamp(max=state.max_bs - 1)]
    ids.masked_fill_(dead[:, None], -1)
    weights.masked_fill_(dead[:, None], 0)
    if packed_out is not None:
        packed_out.masked_fill_(dead[:, None], -65536)  # id -1, weight 0: 0xFFFF0000
    return weights, ids


def _after_next_batch(plan, scheduler, *args, **kwargs):
    """The waiting queue's length once the scheduler has chosen its batch (a ``len``: no sync)."""
    engine_state.num_queued = len(scheduler.waiting_queue)
    return None


def _after_propose(proposal, proposer, *args, **kwargs):
    state = engine_state
    if not state.ready:
        return None
    bs = kwargs.get("bs") or proposal.draft_block.draft_tokens.shape[0]
    confidence = proposal.confidence
    if not state.confidence_reported:
        state.confidence_reported = True
        log.info("vcap: draft confidence %s", "present" if confidence is not None else
                 "MISSING: conf policies verify every draft")
    state.bs = bs
    decide_live_lengths(state, None if confidence is None else confidence[:bs], bs)
    return None


def _around_accept_draft_tokens(original_fn, *args, cutoff_layout=None, candidates=None, **kwargs):
    state = engine_state
    if cutoff_layout is None and state.ready and candidates is not None:
        cutoff_layout = _Cutoff(state.live[:candidates.shape[0]])
    return original_fn(*args, candidates=candidates, cutoff_layout=cutoff_layout, **kwargs)


def _around_epilogue_accept(original_fn, epilogue, *, candidates, logits, draft_tokens, seq_lens,
                            cutoff_verify_lens=None):
    state = engine_state
    if cutoff_verify_lens is None and state.ready:
        cutoff_verify_lens = state.live[:candidates.shape[0]]
    return original_fn(epilogue, candidates=candidates, logits=logits, draft_tokens=draft_tokens,
                       seq_lens=seq_lens, cutoff_verify_lens=cutoff_verify_lens)


def _after_accept(outs, *args, **kwargs):
    """Telemetry record of the step (rank 0), whichever accept path ran."""
    state = engine_state
    if outs is None or state.hook is None or not state.bs:
        return None
    state.hook.end(outs.correct_len[:state.bs])
    return None


def _around_confidence_head(original_fn, *args, **kwargs):
    """Build the draft's confidence head in static mode too (a conf policy may come at any time)."""
    import sglang.srt.models.deepseek_v4_dspark as dspark
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode
    mode_fn = dspark.read_ragged_verify_mode
    dspark.read_ragged_verify_mode = lambda: RaggedVerifyMode.CAP_ACCEPT
    try:
        return original_fn(*args, **kwargs)
    finally:
        dspark.read_ragged_verify_mode = mode_fn


def _after_forward_decode(result, worker, *args, **kwargs):
    """Feed ``sglang:spec_cap_length``: SGLang leaves ``cap_lens`` empty in static mode."""
    state = engine_state
    if state.ready and state.bs and getattr(result, "cap_lens", "absent") is None:
        result.cap_lens = state.live[:state.bs].clone()
    return None


_DSPARK = "sglang.srt.speculative.dspark_components"
PATCHES = [
    Patch("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", _after_next_batch, "after",
          ("self", "running_batch", "last_batch"),
          VERIFIED_ON, "the waiting queue's length, for the telemetry record"),
    Patch("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.forward", _around_model_forward, "around",
          ("self", "input_ids", "positions", "forward_batch", "input_embeds", "pp_proxy_tensors"),
          VERIFIED_ON, "mark target-verify forwards; build buffers at the first (warm-up)"),
    Patch("sglang.kernels.ops.moe.moe_fused_gate.moe_fused_gate", _around_gate, "around",
          ("scores", "bias", "topk", "scoring_func", "num_fused_shared_experts", "renormalize",
           "routed_scaling_factor", "apply_routed_scaling_factor_on_output", "moe_softcapping",
           "num_expert_group", "topk_group", "bias_alt", "input_ids", "bias_alt_token_id",
           "num_token_non_padded", "renormalize_epsilon", "packed_out", "sqrtsoftplus_log1p"),
          VERIFIED_ON, "route verify rows with dead rows given no experts (same launch)"),
    Patch(f"{_DSPARK}.dspark_draft.DraftBlockProposer.propose", _after_propose, "after",
          ("self", "batch", "draft_input", "verify_window", "bs", "device", "target_model",
           "sampling_info", "anchor_prepared"),
          VERIFIED_ON, "confidence -> live lengths (rank 0) -> broadcast"),
    Patch(f"{_DSPARK}.dspark_verify.accept_draft_tokens", _around_accept_draft_tokens, "around",
          ("candidates", "target_logits", "draft_block", "sampling_info", "draft_input", "gamma",
           "verify_num_draft_tokens", "cutoff_layout", "fused_argmax", "block_verification",
           "rejection_noise"),
          VERIFIED_ON, "cap acceptance at L - 1 (eager and sampling-graph accept)"),
    Patch(f"{_DSPARK}.dspark_verify.DsparkVerifyEpilogue._accept", _around_epilogue_accept, "around",
          ("self", "candidates", "logits", "draft_tokens", "seq_lens", "cutoff_verify_lens"),
          VERIFIED_ON, "cap acceptance at L - 1 (accept folded into the verify graph)"),
    Patch(f"{_DSPARK}.dspark_verify.TargetVerifyExecutor.accept_and_finalize", _after_accept, "after",
          ("self", "folded_accept", "bs", "verify_ids_2d", "target_logits", "draft_block",
           "sampling_info", "draft_input", "layout", "prefix_lens", "draft_tokens",
           "simulate_bonus_sampling_info"),
          VERIFIED_ON, "telemetry record and exactness guard (eager and folded accept)"),
    Patch(f"{_DSPARK}.dspark_sampling_accept_graph.DsparkSamplingAcceptGraph.run", _after_accept, "after",
          ("self", "bs", "target_logits"),
          VERIFIED_ON, "telemetry record and exactness guard (sampling-accept graph)"),
    Patch("sglang.srt.models.deepseek_v4_dspark.build_dspark_v4_confidence_head", _around_confidence_head,
          "around", ("config", "markov_rank"),
          VERIFIED_ON, "build the draft's confidence head in static mode"),
    Patch(f"{_DSPARK}.dspark_worker_v2.DSparkWorkerV2._forward_decode", _after_forward_decode, "after",
          ("self", "batch", "on_publish", "grammar_barrier", "coordination_plan"),
          VERIFIED_ON, "feed sglang:spec_cap_length with the live lengths"),
]


def register() -> None:
    """SGLang's plugin entry point (group ``sglang.srt.plugins``, name ``vcap``).

    SGLang logs and ignores exceptions of plugins, so a refusal leaves through SystemExit:
    a scheduler that cannot run vcap correctly must not start.
    """
    if not os.environ.get(ENV_SEGMENT):
        return
    try:
        _refuse_unsupported_modes()
        apply(PATCHES)
    except PatchError as error:
        log.critical("vcap: %s", error)
        raise SystemExit(f"vcap: {error}") from None
    log.info("vcap: %d patches applied on SGLang %s (segment %s)", len(PATCHES), sglang_version(),
             os.environ[ENV_SEGMENT])
