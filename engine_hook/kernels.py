"""The step kernels on the verify step's critical path (device memory only). The policy of each
step comes from the host (:mod:`.hook` stages the control block it read); the telemetry record of
step ``n`` is staged at the start of step ``n + 1`` (:mod:`.record`) and published on a side
stream.

- :func:`begin_step`: stage the previous step's record, then turn the staged policy and this
  step's confidence into live lengths, exactly as ``reference.live_lengths``. One launch.
- :func:`end_step` (tiny): the step's end time and its accepted counts.

Buffers and their word layouts: :mod:`.buffers`.
"""

import torch
import triton
import triton.language as tl

from vcap.segment import (BUCKET_K_MAX, BUCKET_K_MIN, BUCKET_MIN_BS, BUCKET_THRESHOLDS, CONTROL_FALLBACK,
                          CONTROL_FIXED_K, CONTROL_GENERATION, CONTROL_HEAD_WORDS, CONTROL_MODE,
                          CONTROL_NUM_BUCKETS, FLAG_CONF_MISSING, FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE,
                          FLAG_FALLBACK, FLAG_GUARD_VIOLATION, MODE_CONF, MODE_FIXED, MODE_OFF)

from ._triton import now_ns, put, word
from .buffers import (INFO_BS, INFO_CONTROL, INFO_FLAGS, INFO_GENERATION, INFO_MODE, INFO_NUM_QUEUED,
                      INFO_SAMPLED, INFO_WORDS, PENDING_WORDS, STAGED_BS, STAGED_CONF_PRESENT, STAGED_CONTROL,
                      STAGED_EXPLORE, STAGED_HEAD, STAGED_NUM_QUEUED, STAGED_SAMPLED, STAGED_STEP64, STATE_END,
                      STATE_GUARD, STATE_HAS_STEP, STATE_RECORDS, STATE_START, STATE_STEP, STATE_VIOLATIONS,
                      StepBuffers)
from .record import stage_record, stage_status

__all__ = ["begin_step", "end_step"]

_K = tl.constexpr
_STAGED_BS, _STAGED_CONF_PRESENT, _STAGED_EXPLORE = _K(STAGED_BS), _K(STAGED_CONF_PRESENT), _K(STAGED_EXPLORE)
_STAGED_SAMPLED, _STAGED_CONTROL, _STAGED_NUM_QUEUED = _K(STAGED_SAMPLED), _K(STAGED_CONTROL), _K(STAGED_NUM_QUEUED)
_STAGED_STEP64, _STAGED_HEAD = _K(STAGED_STEP64), _K(STAGED_HEAD)
_INFO_GENERATION, _INFO_MODE, _INFO_FLAGS, _INFO_BS = _K(INFO_GENERATION), _K(INFO_MODE), _K(INFO_FLAGS), _K(INFO_BS)
_INFO_SAMPLED, _INFO_CONTROL, _INFO_NUM_QUEUED = _K(INFO_SAMPLED), _K(INFO_CONTROL), _K(INFO_NUM_QUEUED)
_INFO_WORDS, _PENDING_WORDS = _K(INFO_WORDS), _K(PENDING_WORDS)
_STATE_HAS_STEP, _STATE_STEP, _STATE_START = _K(STATE_HAS_STEP), _K(STATE_STEP), _K(STATE_START)
_STATE_END, _STATE_GUARD, _STATE_VIOLATIONS = _K(STATE_END), _K(STATE_GUARD), _K(STATE_VIOLATIONS)
_STATE_RECORDS = _K(STATE_RECORDS)
_C_GENERATION, _C_MODE, _C_FIXED_K = _K(CONTROL_GENERATION), _K(CONTROL_MODE), _K(CONTROL_FIXED_K)
_C_NUM_BUCKETS, _C_HEAD, _FALLBACK = _K(CONTROL_NUM_BUCKETS), _K(CONTROL_HEAD_WORDS), _K(CONTROL_FALLBACK)
_B_MIN_BS, _B_K_MIN, _B_K_MAX = _K(BUCKET_MIN_BS), _K(BUCKET_K_MIN), _K(BUCKET_K_MAX)
_B_THRESHOLDS = _K(BUCKET_THRESHOLDS)
_MODE_OFF, _MODE_FIXED, _MODE_CONF = _K(MODE_OFF), _K(MODE_FIXED), _K(MODE_CONF)
_F_FALLBACK, _F_EXPLORE, _F_SAMPLED = _K(FLAG_FALLBACK), _K(FLAG_EXPLORE), _K(FLAG_EXPERTS_SAMPLED)
_F_GUARD, _F_CONF_MISSING = _K(FLAG_GUARD_VIOLATION), _K(FLAG_CONF_MISSING)


# -- begin: this step's live lengths --------------------------------------------------------------

@triton.jit
def _bucket_of(block, c, bs, num_buckets, BUCKET_WORDS: tl.constexpr):
    """The first word of the last bucket whose ``min_bs <= bs`` (bucket 0 when none)."""
    index = (c - _C_HEAD) // BUCKET_WORDS
    is_min_bs = ((c >= _C_HEAD) & ((c - _C_HEAD) % BUCKET_WORDS == _B_MIN_BS) & (index < num_buckets)
                 & (block <= bs))
    chosen = tl.maximum(tl.max(tl.where(is_min_bs, index, 0), 0), 0)
    return _C_HEAD + chosen * BUCKET_WORDS


@triton.jit
def _capped_drafts(conf_ptr, conf_stride, conf_rows, conf_stash_ptr, block, c, bucket, bs, conf_present,
                   NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr, BLOCK_B: tl.constexpr):
    """``k`` per request under the ``conf`` rule: the leading drafts whose running product of
    survival (float32, left to right) is >= their threshold, clamped to the bucket's
    ``[k_min, k_max]``. The raw confidence is stashed for this step's record."""
    b = tl.arange(0, BLOCK_B)
    conf_mask = (b < bs) & (b < conf_rows) & ((b * 0 + conf_present.to(tl.int32)) != 0)
    running = tl.full([BLOCK_B], 1.0, tl.float32)
    alive = tl.full([BLOCK_B], 1, tl.int32)
    k = tl.zeros([BLOCK_B], dtype=tl.int32)
    for j in tl.static_range(NUM_DRAFTS):
        raw = tl.load(conf_ptr + b.to(tl.int64) * conf_stride + j, mask=conf_mask, other=0.0).to(tl.float32)
        tl.store(conf_stash_ptr + b * NUM_DRAFTS + j, raw, mask=b < MAX_BS)
        x = tl.minimum(tl.maximum(tl.where(raw == raw, raw, 0.0), 0.0), 1.0)
        running = running * x
        threshold = word(block, c, bucket + _B_THRESHOLDS + j).to(tl.float32, bitcast=True)
        alive = alive & (running >= threshold).to(tl.int32)
        k += alive
    k_min = tl.minimum(tl.maximum(word(block, c, bucket + _B_K_MIN), 1), NUM_DRAFTS)
    k_max = tl.minimum(tl.maximum(word(block, c, bucket + _B_K_MAX), k_min), NUM_DRAFTS)
    return tl.minimum(tl.maximum(k, k_min), k_max)


@triton.jit
def _decide_step(staged_ptr, staged64_ptr, conf_ptr, conf_stride, conf_rows, conf_stash_ptr, live_ptr, info_ptr,
                 lanes, guard, C_WORDS: tl.constexpr, BLOCK_C: tl.constexpr, MAX_BUCKETS: tl.constexpr,
                 BUCKET_WORDS: tl.constexpr, NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr,
                 BLOCK_B: tl.constexpr):
    """This step's live lengths and info from the staged policy (every value clamped); returns
    the step number."""
    c = tl.arange(0, BLOCK_C)
    block = tl.load(staged_ptr + _STAGED_HEAD + c, mask=c < C_WORDS, other=0)
    head = tl.load(staged_ptr + lanes)
    bs = tl.minimum(tl.maximum(word(head, lanes, _STAGED_BS), 0), MAX_BS)
    conf_present = word(head, lanes, _STAGED_CONF_PRESENT) != 0
    explore = word(head, lanes, _STAGED_EXPLORE) != 0
    sampled = word(head, lanes, _STAGED_SAMPLED) != 0
    control = word(head, lanes, _STAGED_CONTROL)
    mode = word(block, c, _C_MODE)
    fixed_k = tl.minimum(tl.maximum(word(block, c, _C_FIXED_K), 1), NUM_DRAFTS)
    num_buckets = tl.minimum(tl.maximum(word(block, c, _C_NUM_BUCKETS), 0), MAX_BUCKETS)
    bucket = _bucket_of(block, c, bs, num_buckets, BUCKET_WORDS)
    k = _capped_drafts(conf_ptr, conf_stride, conf_rows, conf_stash_ptr, block, c, bucket, bs, conf_present,
                       NUM_DRAFTS, MAX_BS, BLOCK_B)
    fixed = mode == _MODE_FIXED
    capped = fixed | ((mode == _MODE_CONF) & conf_present & (num_buckets > 0))
    all_live = (guard != 0) | explore | (capped == 0)
    b = tl.arange(0, BLOCK_B)
    live = tl.where(fixed, fixed_k + 1, k + 1)
    live = tl.where((b * 0 + all_live.to(tl.int32)) != 0, NUM_DRAFTS + 1, live)
    tl.store(live_ptr + b, tl.where(b < bs, live, 1), mask=b < MAX_BS)
    flags = ((control == _FALLBACK).to(tl.int32) * _F_FALLBACK + explore.to(tl.int32) * _F_EXPLORE
             + sampled.to(tl.int32) * _F_SAMPLED + (guard != 0).to(tl.int32) * _F_GUARD
             + (conf_present == 0).to(tl.int32) * _F_CONF_MISSING)
    info = tl.zeros([16], dtype=tl.int32)
    info = put(info, lanes, _INFO_GENERATION, word(block, c, _C_GENERATION))
    info = put(info, lanes, _INFO_MODE, tl.where((mode >= _MODE_OFF) & (mode <= _MODE_CONF), mode, _MODE_OFF))
    info = put(info, lanes, _INFO_FLAGS, flags)
    info = put(info, lanes, _INFO_BS, bs)
    info = put(info, lanes, _INFO_SAMPLED, sampled.to(tl.int32))
    info = put(info, lanes, _INFO_CONTROL, control)
    info = put(info, lanes, _INFO_NUM_QUEUED, word(head, lanes, _STAGED_NUM_QUEUED))
    tl.store(info_ptr + lanes, info, mask=lanes < _INFO_WORDS)
    return tl.load(staged64_ptr + _STAGED_STEP64)


@triton.jit
def _begin_kernel(staged_ptr, staged64_ptr, state_ptr, clock_ptr, live_ptr, info_ptr,
                  conf_ptr, conf_stride, conf_rows, conf_stash_ptr, acc_stash_ptr, bits_ptr,
                  pend_i64, pend_i32, pend_f32, pend_u8, pend_status_ptr,
                  C_WORDS: tl.constexpr, BLOCK_C: tl.constexpr, MAX_BUCKETS: tl.constexpr,
                  BUCKET_WORDS: tl.constexpr, NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, LAYERS: tl.constexpr, NUM_WORDS: tl.constexpr,
                  BLOCK_Y: tl.constexpr, BLOCK_W: tl.constexpr, CONF_OFF: tl.constexpr, LIVE_OFF: tl.constexpr,
                  ACC_OFF: tl.constexpr, EXA_OFF: tl.constexpr, EXL_OFF: tl.constexpr,
                  HAS_BITS: tl.constexpr, USE_TIMER: tl.constexpr, STAGE_ONLY: tl.constexpr):
    lanes = tl.arange(0, 16)
    state = tl.load(state_ptr + lanes)
    now = now_ns(clock_ptr, USE_TIMER)
    guard = word(state, lanes, _STATE_GUARD)
    violations = word(state, lanes, _STATE_VIOLATIONS)
    if word(state, lanes, _STATE_HAS_STEP) != 0:
        violation, flags = stage_record(
            info_ptr, live_ptr, acc_stash_ptr, conf_stash_ptr, bits_ptr, pend_i64, pend_i32, pend_f32, pend_u8,
            state, lanes, now, NUM_DRAFTS, MAX_BS, BLOCK_B, BLOCK, LAYERS, NUM_WORDS, BLOCK_Y, BLOCK_W,
            CONF_OFF, LIVE_OFF, ACC_OFF, EXA_OFF, EXL_OFF, HAS_BITS)
        guard = guard | violation.to(tl.int64)
        violations = violations + violation.to(tl.int64)
        stage_status(pend_status_ptr, lanes, word(state, lanes, _STATE_STEP), flags, guard, violations)
    else:
        tl.store(pend_status_ptr + lanes, tl.zeros([16], dtype=tl.int64), mask=lanes < _PENDING_WORDS)
    # every read of the previous step's buffers is done before this step overwrites them
    tl.debug_barrier()
    state = put(put(state, lanes, _STATE_GUARD, guard), lanes, _STATE_VIOLATIONS, violations)
    if STAGE_ONLY:
        state = put(state, lanes, _STATE_HAS_STEP, 0)
    else:
        step = _decide_step(staged_ptr, staged64_ptr, conf_ptr, conf_stride, conf_rows, conf_stash_ptr, live_ptr,
                            info_ptr, lanes, guard, C_WORDS, BLOCK_C, MAX_BUCKETS, BUCKET_WORDS, NUM_DRAFTS,
                            MAX_BS, BLOCK_B)
        state = put(put(state, lanes, _STATE_HAS_STEP, 1), lanes, _STATE_STEP, step)
        state = put(put(state, lanes, _STATE_START, now), lanes, _STATE_END, 0)
    tl.store(state_ptr + lanes, state, mask=lanes != _STATE_RECORDS)  # the record count is the publisher's


# -- end --------------------------------------------------------------------------------------

@triton.jit
def _end_kernel(state_ptr, clock_ptr, info_ptr, accepted_ptr, acc_stash_ptr, MAX_BS: tl.constexpr,
                BLOCK_B: tl.constexpr, HAS_ACCEPTED: tl.constexpr, USE_TIMER: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    if HAS_ACCEPTED:
        bs = tl.load(info_ptr + _INFO_BS)
        accepted = tl.load(accepted_ptr + b, mask=b < bs, other=0).to(tl.int32)
        accepted = tl.minimum(tl.maximum(accepted, 0), 255)
    else:
        accepted = tl.zeros([BLOCK_B], dtype=tl.int32)
    tl.store(acc_stash_ptr + b, accepted, mask=b < MAX_BS)
    tl.store(state_ptr + _STATE_END, now_ns(clock_ptr, USE_TIMER))


def _check_begin(buffers: StepBuffers, staged: torch.Tensor, confidence: torch.Tensor,
                 expert_bits: torch.Tensor | None) -> None:
    config, num_drafts = buffers.layout.config, buffers.layout.config.num_drafts
    if confidence.dim() != 2 or confidence.shape[1] != num_drafts or confidence.stride(1) != 1:
        raise ValueError(f"confidence must be [bs, {num_drafts}] with unit column stride, got "
                         f"{tuple(confidence.shape)} strides {confidence.stride()}")
    words = STAGED_HEAD + buffers.layout.control_size // 4
    if staged.dtype != torch.int32 or staged.numel() != words or not staged.is_contiguous():
        raise ValueError(f"staged must be contiguous int32 [{words}]")
    num_words = (config.num_experts + 31) // 32
    if expert_bits is not None and (expert_bits.shape != (config.num_moe_layers, 2, num_words)
                                    or expert_bits.dtype != torch.int32 or not expert_bits.is_contiguous()):
        raise ValueError(f"expert_bits must be contiguous int32 [{config.num_moe_layers}, 2, {num_words}]")


def begin_step(buffers: StepBuffers, staged: torch.Tensor, confidence: torch.Tensor | None,
               expert_bits: torch.Tensor | None, *, stage_only: bool = False) -> torch.Tensor:
    """Stage the previous step's record, then (unless ``stage_only``) this step's live lengths."""
    layout, config = buffers.layout, buffers.layout.config
    confidence = buffers.conf_missing if confidence is None else confidence
    _check_begin(buffers, staged, confidence, expert_bits)
    control_words, num_words = layout.control_size // 4, (config.num_experts + 31) // 32
    has_bits = expert_bits is not None and config.num_moe_layers > 0
    pending = buffers.pending
    _begin_kernel[(1,)](
        staged, staged.view(torch.int64), buffers.state, buffers.clock, buffers.live, buffers.info,
        confidence, confidence.stride(0), confidence.shape[0], buffers.conf_stash, buffers.acc_stash,
        expert_bits if has_bits else buffers.info, pending.view(torch.int64), pending.view(torch.int32),
        pending.view(torch.float32), pending, buffers.pending_status,
        C_WORDS=control_words, BLOCK_C=triton.next_power_of_2(control_words), MAX_BUCKETS=config.max_buckets,
        BUCKET_WORDS=layout.bucket_size // 4, NUM_DRAFTS=config.num_drafts, MAX_BS=config.max_bs,
        BLOCK_B=triton.next_power_of_2(config.max_bs), BLOCK=512, LAYERS=config.num_moe_layers,
        NUM_WORDS=num_words, BLOCK_Y=triton.next_power_of_2(max(config.num_moe_layers, 1)),
        BLOCK_W=triton.next_power_of_2(num_words), CONF_OFF=layout.conf_offset, LIVE_OFF=layout.live_offset,
        ACC_OFF=layout.accepted_offset, EXA_OFF=layout.experts_all_offset, EXL_OFF=layout.experts_live_offset,
        HAS_BITS=has_bits, USE_TIMER=buffers.use_timer, STAGE_ONLY=stage_only, num_warps=4)
    return buffers.live


def end_step(buffers: StepBuffers, accepted: torch.Tensor | None) -> None:
    """The step's end time and accepted counts (clamped to 0..255), for its record."""
    if accepted is not None and (accepted.dim() != 1 or not accepted.is_contiguous()):
        raise ValueError("accepted must be a contiguous 1-d tensor (accepted drafts per request)")
    _end_kernel[(1,)](buffers.state, buffers.clock, buffers.info,
                      accepted if accepted is not None else buffers.acc_stash, buffers.acc_stash,
                      MAX_BS=buffers.max_bs, BLOCK_B=triton.next_power_of_2(buffers.max_bs),
                      HAS_ACCEPTED=accepted is not None, USE_TIMER=buffers.use_timer, num_warps=1)
