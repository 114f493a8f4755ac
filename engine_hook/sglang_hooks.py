"""What vcap's patches on SGLang run (:mod:`.sglang_plugin` lists where): the per-process
engine state, built at the first verify warm-up, and one function per patched site.
"""

import functools
import inspect
import logging
import os
import threading

import torch

from vcap.policy import default_policy
from vcap.layout import dp_segment_name
from vcap.segment import Segment, SegmentConfig

from .patches import PatchError, sglang_version

__all__ = ["engine_state", "EngineState", "decide_live_lengths", "ENV_SEGMENT", "ENV_DEAD_ROWS", "ENV_SEGMENT_GROUP", "ENV_TP_SHARE",
           "after_next_batch",
           "around_model_forward", "around_gate", "after_propose", "around_accept_draft_tokens",
           "around_epilogue_accept", "after_accept", "around_confidence_head", "after_forward_decode"]

log = logging.getLogger("vcap.engine_hook")
ENV_SEGMENT = "VCAP_SEGMENT"
ENV_DEAD_ROWS = "VCAP_DEAD_ROWS"          # drop (default) | anchor
ENV_SEGMENT_GROUP = "VCAP_SEGMENT_GROUP"  # group (name or gid) that may read the segment: mode 0660
ENV_TP_SHARE = "VCAP_TP_SHARE"            # peer (default: mapped inboxes on one node) | broadcast
# Router options vcap's kernel implements; any other makes the gate fall back to SGLang's.
_GATE_DEFAULTS = {"num_fused_shared_experts": 0, "moe_softcapping": 0.0, "bias_alt": None,
                  "input_ids": None, "bias_alt_token_id": None, "renormalize_epsilon": 0.0}


class EngineState:
    """Per-process state: built at the first verify warm-up, used every step."""

    def __init__(self):
        self.lock = threading.Lock()
        self.hook = None          # VerifyHook on TP rank 0
        self.live = None          # int32 [max_bs] on every rank
        self.stride = self.max_bs = 0
        self.rank, self.group = 0, None
        self.share = None         # LiveShare: rank 0's L to the other ranks of one node (else a broadcast)
        self.in_verify = False
        self.layer = 0
        self.bs = 0
        self.num_queued = 0       # the scheduler's waiting queue at its last batch choice
        self.guard_reported = False
        self.confidence_reported = False
        self.oversize_reported = False

    @property
    def ready(self) -> bool:
        return self.live is not None


engine_state = EngineState()


class _Cutoff:
    """What ``accept_draft_tokens`` reads of a layout: the verify length per request."""

    def __init__(self, verify_lens: torch.Tensor):
        self.verify_lens = verify_lens


# -- start-up -------------------------------------------------------------------------------

def _segment_group() -> int | None:
    """``VCAP_SEGMENT_GROUP`` as a gid (a name is looked up), or None for the 0600 default."""
    group = os.environ.get(ENV_SEGMENT_GROUP, "").strip()
    if not group:
        return None
    if group.isdigit():
        return int(group)
    import grp
    return grp.getgrnam(group).gr_gid


def routed_moe_layers(config) -> int:
    """The MoE layers vcap routes: every decoder layer of DeepSeek-V4 is MoE, but the first
    ``num_hash_layers`` route by a hash of the token ids, not through the gate vcap patches."""
    return max(int(getattr(config, "num_hidden_layers", 0)) - int(getattr(config, "num_hash_layers", 0) or 0), 0)


def _dispatch_row_bytes(config, strategy: str) -> int:
    """What a dead row does not send in the MoE's all-to-all (the header's ``dispatch_row_bytes``).
    Under the ``anchor`` strategy dead rows keep the anchor's experts, so they are dispatched."""
    if strategy == "anchor":
        return 0
    from sglang.srt.runtime_context import get_server_args

    from .sglang_modes import dispatch_row_bytes
    return dispatch_row_bytes(get_server_args(), config)


def _attn_dp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel
    parallel = get_parallel()
    return int(getattr(parallel, "attn_dp_rank", 0) or 0) if parallel.attn_dp_enabled else 0


def max_batch_size() -> int:
    """SGLang's own rule for its speculative buffers (``base_spec_worker``): the larger of the
    largest decode graph and ``max_running_requests``; batches above the largest graph run eagerly."""
    from sglang.srt.runtime_context import get_exec, get_schedule
    graph_config = get_exec().graph.cuda_graph_config
    decode = getattr(graph_config, "decode", None) if graph_config is not None else None
    graph_bs = max(getattr(decode, "max_bs", 0) or 0, max(getattr(decode, "bs", None) or [0]))
    return max(graph_bs, get_schedule().max_running_requests or 0, 1)


def _build(model, forward_batch, num_rows: int, device) -> None:
    """Buffers and (rank 0) the segment, from the engine's own configuration."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    from .sglang_modes import check_server_layout
    check_server_layout()  # refused before the model loads already; a second line here
    bs = forward_batch.batch_size
    if num_rows % bs:
        raise PatchError(f"target verify with {num_rows} rows for {bs} requests: not a [bs, stride] rectangle")
    config = model.config
    max_bs = max(max_batch_size(), bs)
    group = get_dp_tp_group()
    state = engine_state
    state.stride, state.max_bs, state.group = num_rows // bs, max_bs, group
    state.rank = group.rank_in_group
    if state.rank == 0:
        from .hook import VerifyHook
        num_drafts = state.stride - 1
        strategy = os.environ.get(ENV_DEAD_ROWS, "drop")
        segment = Segment.create(
            dp_segment_name(os.environ[ENV_SEGMENT], _attn_dp_rank()),
            SegmentConfig(stride=state.stride, max_bs=max_bs, num_moe_layers=routed_moe_layers(config),
                          num_experts=int(config.n_routed_experts), top_k=int(config.num_experts_per_tok),
                          dispatch_row_bytes=_dispatch_row_bytes(config, strategy)),
            fallback=default_policy(num_drafts), group=_segment_group())
        state.hook = VerifyHook(segment, device=device, strategy=strategy)
        state.live = state.hook.live
        print(f"vcap: segment {segment.path} (stride {state.stride}, max_bs {max_bs}, "
              f"{config.n_routed_experts} experts, top-{config.num_experts_per_tok}); SGLang "
              f"{sglang_version()}", flush=True)
    else:
        state.live = torch.full((max_bs,), state.stride, dtype=torch.int32, device=device)
    if group.world_size > 1:
        state.share = _build_share(group, max_bs, state.stride, device)
        if state.share is not None:
            state.share.bind(state.live)


def _build_share(group, max_bs: int, stride: int, device):
    """Mapped inboxes when every rank of the group is on this node (a collective: every rank
    builds at its first verify warm-up); None keeps the eager broadcast (several nodes, or asked)."""
    from .tp_share import build
    choice = os.environ.get(ENV_TP_SHARE, "peer").strip() or "peer"
    if choice not in ("peer", "broadcast"):
        raise PatchError(f"{ENV_TP_SHARE}={choice!r}: use 'peer' or 'broadcast'")
    if choice == "broadcast":
        return None
    share = build(group.rank_in_group, group.world_size, max_bs, stride, device, group.all_gather_object)
    if share is None and group.rank_in_group == 0:
        log.warning("vcap: rank 0's live lengths go out by an eager broadcast each verify step "
                    "(about 20-30 us)")
    return share


def decide_live_lengths(state: EngineState, confidence, bs: int) -> None:
    """Rank 0 computes ``L``; every rank of the group ends up with rank 0's (one kernel on each
    rank through mapped inboxes, :mod:`.tp_share`; across nodes one broadcast).
    A batch above the buffers (cannot happen with SGLang's sizing rule) verifies every draft."""
    if bs > state.max_bs:
        state.bs = 0  # no cutoff, no record: the gate and the accept see a step vcap does not cap
        if not state.oversize_reported:
            state.oversize_reported = True
            log.warning("vcap: a batch of %d requests is above vcap's buffers (%d): such steps verify "
                        "every draft", bs, state.max_bs)
        return
    if state.hook is not None:
        state.hook.prepare(bs, confidence is not None, state.num_queued)
        state.hook.begin(None if confidence is None else confidence.float().contiguous())
        if state.hook.guard_tripped() and not state.guard_reported:
            state.guard_reported = True
            log.critical("vcap: EXACTNESS GUARD TRIPPED: a request accepted more drafts than it "
                         "verified; every row is live from now on. Investigate the accept path.")
    if state.share is not None:
        state.share.step()
    elif state.group is not None and state.group.world_size > 1:
        state.group.broadcast(state.live, src=0)


# -- the hooks --------------------------------------------------------------------------------


def around_model_forward(original_fn, model, input_ids, positions, forward_batch, *args, **kwargs):
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


def around_gate(original_fn, scores, bias, topk, *args, **kwargs):
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
    scoring = _scoring(options["scoring_func"], options["sqrtsoftplus_log1p"])
    if not supported or scoring not in SCORING_FUNCS:
        weights, ids = original_fn(scores, bias, topk, *args, **kwargs)
        return _remap_after(weights, ids, options.get("packed_out"), state)
    gate = dict(num_expert_group=options["num_expert_group"], topk_group=options["topk_group"],
                scoring_func=scoring, renormalize=options["renormalize"],
                routed_scaling_factor=options["routed_scaling_factor"],
                apply_routed_scaling_factor_on_output=options["apply_routed_scaling_factor_on_output"],
                packed_out=options["packed_out"], num_token_non_padded=options["num_token_non_padded"])
    layer = state.layer
    state.layer += 1
    if state.hook is not None and layer < state.hook.config.num_moe_layers:
        return state.hook.route(layer, scores, bias, topk, **gate)
    return route(scores, bias, topk, live=state.live, stride=state.stride,
                 strategy=os.environ.get(ENV_DEAD_ROWS, "drop"), **gate)


def _scoring(scoring_func: str, sqrtsoftplus_log1p: bool) -> str | None:
    """SGLang's scoring options as one name of ``router.SCORING_FUNCS`` (None: vcap lacks it).
    DeepSeek-V4.1 passes ``sqrtsoftplus`` with ``sqrtsoftplus_log1p=True``, V4 without it."""
    scoring = str(scoring_func).lower()
    if sqrtsoftplus_log1p:
        return "sqrtsoftplus_log1p" if scoring == "sqrtsoftplus" else None
    return scoring


def _remap_after(weights, ids, packed_out, state):
    """Fallback for gate options vcap's router lacks: SGLang's gate, then dead rows remapped by
    ``VCAP_DEAD_ROWS`` as the router does (``reference.remap_dead_rows``: dropped, or the
    anchor's ids and weights, for a backend that cannot take -1), with torch ops: extra
    launches in this layer, logged once."""
    strategy = os.environ.get(ENV_DEAD_ROWS, "drop")
    if not getattr(_remap_after, "warned", False):
        _remap_after.warned = True
        log.warning("vcap: a verify gate call uses options vcap's router does not implement; dead rows "
                    "are remapped (%s) after SGLang's gate (extra launches per layer)", strategy)
    rows = torch.arange(ids.shape[0], device=ids.device)
    dead = ((rows % state.stride) >= state.live[(rows // state.stride).clamp(max=state.max_bs - 1)])[:, None]
    if strategy == "anchor":
        anchor = rows - rows % state.stride
        for out in (ids, weights) if packed_out is None else (ids, weights, packed_out):
            out.copy_(torch.where(dead, out[anchor], out))
        return weights, ids
    ids.masked_fill_(dead, -1)
    weights.masked_fill_(dead, 0)
    if packed_out is not None:
        packed_out.masked_fill_(dead, -65536)  # id -1, weight 0: 0xFFFF0000
    return weights, ids


def after_next_batch(plan, scheduler, *args, **kwargs):
    """The waiting queue's length once the scheduler has chosen its batch (a ``len``: no sync)."""
    engine_state.num_queued = len(scheduler.waiting_queue)
    return None


def after_propose(proposal, proposer, *args, **kwargs):
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


def combined_cutoff(bs: int, verify_lens: torch.Tensor | None) -> torch.Tensor | None:
    """The accept's cutoff: vcap's ``L`` per request, or the smaller of it and SGLang's own
    ``verify_lens`` (cap-accept mode: both count the anchor). SGLang's alone above vcap's buffers."""
    state = engine_state
    if not state.ready or bs > state.max_bs:
        return verify_lens
    live = state.live[:bs]
    if verify_lens is None:
        return live
    return torch.minimum(live, verify_lens.to(live.dtype))


def around_accept_draft_tokens(original_fn, *args, cutoff_layout=None, candidates=None, **kwargs):
    live = None
    if candidates is not None:
        verify_lens = None if cutoff_layout is None else cutoff_layout.verify_lens
        cutoff = combined_cutoff(candidates.shape[0], verify_lens)
        if cutoff is not None and cutoff is not verify_lens:
            cutoff_layout = _Cutoff(cutoff)
            live = engine_state.live[:candidates.shape[0]]
    correct_len, bonus, cap_trim_lens = original_fn(*args, candidates=candidates, cutoff_layout=cutoff_layout,
                                                    **kwargs)
    if live is not None:
        # SGLang's trimmed count (for its acceptance estimator) would read rows past vcap's cut,
        # which had no experts: count it as a verify of L rows would, up to L - 1 drafts
        reach = torch.minimum(correct_len + cap_trim_lens, (live - 1).to(correct_len.dtype))
        cap_trim_lens.copy_(reach - correct_len)
    return correct_len, bonus, cap_trim_lens


def around_epilogue_accept(original_fn, epilogue, *, candidates, logits, draft_tokens, seq_lens,
                            cutoff_verify_lens=None):
    cutoff_verify_lens = combined_cutoff(candidates.shape[0], cutoff_verify_lens)
    return original_fn(epilogue, candidates=candidates, logits=logits, draft_tokens=draft_tokens,
                       seq_lens=seq_lens, cutoff_verify_lens=cutoff_verify_lens)


def after_accept(outs, *args, **kwargs):
    """Telemetry record of the step (rank 0), whichever accept path ran."""
    state = engine_state
    if outs is None or state.hook is None or not state.bs:
        return None
    state.hook.end(outs.correct_len[:state.bs])
    return None


def around_confidence_head(original_fn, *args, **kwargs):
    """Build the draft's confidence head in static mode too (a conf policy may come at any time)."""
    import sglang.srt.models.deepseek_v4_dspark as dspark
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode
    mode_fn = dspark.read_ragged_verify_mode
    dspark.read_ragged_verify_mode = lambda: RaggedVerifyMode.CAP_ACCEPT
    try:
        return original_fn(*args, **kwargs)
    finally:
        dspark.read_ragged_verify_mode = mode_fn


def after_forward_decode(result, worker, *args, **kwargs):
    """Feed ``sglang:spec_cap_length``: SGLang leaves ``cap_lens`` empty in static mode, and
    publishes its own verify lengths in cap-accept mode (then the smaller of the two)."""
    state = engine_state
    cap_lens = getattr(result, "cap_lens", "absent")
    if not (state.ready and state.bs) or isinstance(cap_lens, str):
        return None
    if cap_lens is None:
        result.cap_lens = state.live[:state.bs].clone()
    elif cap_lens.shape[0] == state.bs:
        result.cap_lens = torch.minimum(cap_lens, state.live[:state.bs].to(cap_lens.dtype))
    return None
