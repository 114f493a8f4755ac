"""The hook's step kernels. The policy of each step comes from the host (:mod:`.hook` stages the
control block it read), and the telemetry record of step ``n`` is staged at the start of step
``n + 1`` and published on a side stream, so only device-memory work stays on the verify step's
critical path.

- :func:`begin_step` (critical path, device memory only): stage the previous step's record (live,
  accepted, confidence, expert counts, exactness guard) into a device ``pending`` record, then turn
  the staged policy and this step's confidence into live lengths, exactly as
  ``reference.live_lengths``.
- :func:`end_step` (critical path, tiny): the step's end time and its accepted counts.
- :func:`publish_record` (side stream, overlaps the verify): ``pending`` into the mapped ring slot
  under the record seqlock, with system-scope fences (``seq = 2n+1``, data, ``2n+2``).

Staged words (int32, written by the host before each replay): ``STAGED_*`` below, then from
``STAGED_HEAD`` the control block the step uses.
"""

import torch
import triton
import triton.language as tl

from vcap.segment import (BUCKET_K_MAX, BUCKET_K_MIN, BUCKET_MIN_BS, BUCKET_THRESHOLDS, CONTROL_FALLBACK,
                          CONTROL_FIXED_K, CONTROL_GENERATION, CONTROL_HEAD_WORDS, CONTROL_MODE,
                          CONTROL_NUM_BUCKETS, FLAG_CONF_MISSING, FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE,
                          FLAG_FALLBACK, FLAG_GUARD_VIOLATION, MODE_CONF, MODE_FIXED, MODE_OFF, RECORD_BS,
                          RECORD_FLAGS, RECORD_GENERATION, RECORD_MODE, RECORD_NUM_QUEUED, RECORD_STEP,
                          RECORD_STEP_NS, RECORD_TIME_NS, STATUS_ENGINE_HEARTBEAT, STATUS_FALLBACK_ACTIVE,
                          STATUS_GUARD_VIOLATIONS, STATUS_STEPS)

from ._triton import fence, now_ns, popcount, put, use_asm, word

__all__ = ["StepBuffers", "begin_step", "end_step", "publish_record", "STAGED_HEAD", "STAGED_BS",
           "STAGED_CONF_PRESENT", "STAGED_EXPLORE", "STAGED_SAMPLED", "STAGED_CONTROL", "STAGED_NUM_QUEUED",
           "STAGED_STEP64", "INFO_WORDS", "INFO_GENERATION", "INFO_BS", "INFO_SAMPLED", "INFO_CONTROL"]

# staged (int32, host to device before each replay; the step number is the int64 at STAGED_STEP64)
STAGED_BS, STAGED_CONF_PRESENT, STAGED_EXPLORE, STAGED_SAMPLED, STAGED_CONTROL, STAGED_NUM_QUEUED = range(6)
STAGED_STEP64, STAGED_HEAD = 3, 16
# info (int32, device): this step's decision, for the router and the next step's record
INFO_GENERATION, INFO_MODE, INFO_FLAGS, INFO_BS, INFO_SAMPLED, INFO_CONTROL, INFO_NUM_QUEUED = range(7)
INFO_WORDS = 8
# state (int64, device): what the kernels carry from step to step
_T_HAS_STEP, _T_STEP, _T_START, _T_END, _T_GUARD, _T_VIOLATIONS, _T_RECORDS = (tl.constexpr(i) for i in range(7))
_STATE_WORDS = 16
# pending status (int64): the engine status words to publish, then whether a record is pending
_P_VALID, _PENDING_WORDS = tl.constexpr(7), tl.constexpr(8)

# Triton kernels read module globals only as tl.constexpr: the constants above and the segment's
# ABI, as the kernels see them.
_K = tl.constexpr
_STAGED_BS, _STAGED_CONF_PRESENT, _STAGED_EXPLORE = _K(STAGED_BS), _K(STAGED_CONF_PRESENT), _K(STAGED_EXPLORE)
_STAGED_SAMPLED, _STAGED_CONTROL, _STAGED_NUM_QUEUED = _K(STAGED_SAMPLED), _K(STAGED_CONTROL), _K(STAGED_NUM_QUEUED)
_STAGED_STEP64, _STAGED_HEAD = _K(STAGED_STEP64), _K(STAGED_HEAD)
_INFO_GENERATION, _INFO_MODE, _INFO_FLAGS, _INFO_BS = _K(INFO_GENERATION), _K(INFO_MODE), _K(INFO_FLAGS), _K(INFO_BS)
_INFO_SAMPLED, _INFO_CONTROL, _INFO_NUM_QUEUED = _K(INFO_SAMPLED), _K(INFO_CONTROL), _K(INFO_NUM_QUEUED)
_INFO_WORDS = _K(INFO_WORDS)
_C_GENERATION, _C_MODE, _C_FIXED_K = _K(CONTROL_GENERATION), _K(CONTROL_MODE), _K(CONTROL_FIXED_K)
_C_NUM_BUCKETS, _C_HEAD, _FALLBACK = _K(CONTROL_NUM_BUCKETS), _K(CONTROL_HEAD_WORDS), _K(CONTROL_FALLBACK)
_B_MIN_BS, _B_K_MIN, _B_K_MAX = _K(BUCKET_MIN_BS), _K(BUCKET_K_MIN), _K(BUCKET_K_MAX)
_B_THRESHOLDS = _K(BUCKET_THRESHOLDS)
_MODE_OFF, _MODE_FIXED, _MODE_CONF = _K(MODE_OFF), _K(MODE_FIXED), _K(MODE_CONF)
_F_FALLBACK, _F_EXPLORE, _F_SAMPLED = _K(FLAG_FALLBACK), _K(FLAG_EXPLORE), _K(FLAG_EXPERTS_SAMPLED)
_F_GUARD, _F_CONF_MISSING = _K(FLAG_GUARD_VIOLATION), _K(FLAG_CONF_MISSING)
_R64_STEP, _R64_TIME, _R64_STEP_NS = _K(RECORD_STEP // 8), _K(RECORD_TIME_NS // 8), _K(RECORD_STEP_NS // 8)
_R32_BS, _R32_GENERATION, _R32_FLAGS = _K(RECORD_BS // 4), _K(RECORD_GENERATION // 4), _K(RECORD_FLAGS // 4)
_R32_MODE, _R32_NUM_QUEUED = _K(RECORD_MODE // 4), _K(RECORD_NUM_QUEUED // 4)
_R32_AFTER_SEQ = _K(2)  # the seq is the record's first u64
_S_STEPS, _S_FLAGS = _K(STATUS_STEPS), _K(STATUS_FALLBACK_ACTIVE // 2)  # fallback_active | guard_tripped << 32
_S_VIOLATIONS, _S_HEARTBEAT, _S_WORDS = _K(STATUS_GUARD_VIOLATIONS), _K(STATUS_ENGINE_HEARTBEAT), _K(4)


# -- begin: the previous step's record ------------------------------------------------------------

@triton.jit
def _stage_expert_counts(bits_ptr, pend_i32, sampled, LAYERS: tl.constexpr, NUM_WORDS: tl.constexpr,
                         BLOCK_Y: tl.constexpr, BLOCK_W: tl.constexpr, EXA_OFF: tl.constexpr,
                         EXL_OFF: tl.constexpr, HAS_BITS: tl.constexpr):
    """Distinct experts per layer from the router's bitmaps (sampled steps), which are then
    cleared; returns the record's ``FLAG_EXPERTS_SAMPLED`` bit."""
    y = tl.arange(0, BLOCK_Y)
    count_all = tl.zeros([BLOCK_Y], dtype=tl.int32)
    count_live = tl.zeros([BLOCK_Y], dtype=tl.int32)
    flag = sampled.to(tl.int32) * 0
    if HAS_BITS:
        w = tl.arange(0, BLOCK_W)
        yw_mask = (y[:, None] < LAYERS) & (w[None, :] < NUM_WORDS)
        offsets = y[:, None] * (2 * NUM_WORDS) + w[None, :]
        bits_all = tl.load(bits_ptr + offsets, mask=yw_mask, other=0)
        bits_live = tl.load(bits_ptr + offsets + NUM_WORDS, mask=yw_mask, other=0)
        counted = (y * 0 + sampled.to(tl.int32)) != 0
        count_all = tl.where(counted, tl.sum(popcount(bits_all), axis=1), 0)
        count_live = tl.where(counted, tl.sum(popcount(bits_live), axis=1), 0)
        tl.store(bits_ptr + offsets, tl.zeros([BLOCK_Y, BLOCK_W], dtype=tl.int32), mask=yw_mask)
        tl.store(bits_ptr + offsets + NUM_WORDS, tl.zeros([BLOCK_Y, BLOCK_W], dtype=tl.int32), mask=yw_mask)
        flag = sampled.to(tl.int32) * _F_SAMPLED
    tl.store(pend_i32 + EXA_OFF // 4 + y, count_all, mask=y < LAYERS)
    tl.store(pend_i32 + EXL_OFF // 4 + y, count_live, mask=y < LAYERS)
    return flag


@triton.jit
def _stage_record(info_ptr, live_ptr, acc_stash_ptr, conf_stash_ptr, bits_ptr, pend_i64, pend_i32, pend_f32,
                  pend_u8, state, lanes, now, NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, LAYERS: tl.constexpr, NUM_WORDS: tl.constexpr,
                  BLOCK_Y: tl.constexpr, BLOCK_W: tl.constexpr, CONF_OFF: tl.constexpr, LIVE_OFF: tl.constexpr,
                  ACC_OFF: tl.constexpr, EXA_OFF: tl.constexpr, EXL_OFF: tl.constexpr, HAS_BITS: tl.constexpr):
    """The previous step's record into ``pending`` (all but its seq, which is the publisher's);
    returns ``(violation, flags)``: 1 when a request accepted more than ``L - 1`` drafts."""
    info = tl.load(info_ptr + lanes, mask=lanes < _INFO_WORDS, other=0)
    bs = word(info, lanes, _INFO_BS)
    b = tl.arange(0, BLOCK_B)
    b_mask = b < MAX_BS
    live = tl.load(live_ptr + b, mask=b_mask, other=1)
    tl.store(pend_u8 + LIVE_OFF + b, live.to(tl.uint8), mask=b_mask)
    accepted = tl.load(acc_stash_ptr + b, mask=b_mask & (b < bs), other=0)
    tl.store(pend_u8 + ACC_OFF + b, accepted.to(tl.uint8), mask=b_mask)
    violation = tl.max(((b < bs) & (accepted > live - 1)).to(tl.int32), 0)
    for start in range(0, MAX_BS * NUM_DRAFTS, BLOCK):
        i = start + tl.arange(0, BLOCK)
        mask = i < MAX_BS * NUM_DRAFTS
        tl.store(pend_f32 + CONF_OFF // 4 + i, tl.load(conf_stash_ptr + i, mask=mask, other=0.0), mask=mask)
    sampled_flag = _stage_expert_counts(bits_ptr, pend_i32, word(info, lanes, _INFO_SAMPLED) != 0, LAYERS,
                                        NUM_WORDS, BLOCK_Y, BLOCK_W, EXA_OFF, EXL_OFF, HAS_BITS)
    flags = (word(info, lanes, _INFO_FLAGS) | (violation * _F_GUARD)) & ~_F_SAMPLED | sampled_flag
    end = word(state, lanes, _T_END)
    head = tl.zeros([16], dtype=tl.int64)
    head = put(head, lanes, _R64_STEP, word(state, lanes, _T_STEP))
    head = put(head, lanes, _R64_TIME, tl.where(end != 0, end, now))
    head = put(head, lanes, _R64_STEP_NS, tl.where(end != 0, end - word(state, lanes, _T_START), 0))
    tl.store(pend_i64 + lanes, head, mask=(lanes >= _R64_STEP) & (lanes <= _R64_STEP_NS))
    words = tl.zeros([16], dtype=tl.int32)
    words = put(words, lanes, _R32_BS, bs)
    words = put(words, lanes, _R32_GENERATION, word(info, lanes, _INFO_GENERATION))
    words = put(words, lanes, _R32_FLAGS, flags)
    words = put(words, lanes, _R32_MODE, word(info, lanes, _INFO_MODE))
    words = put(words, lanes, _R32_NUM_QUEUED, word(info, lanes, _INFO_NUM_QUEUED))
    tl.store(pend_i32 + lanes, words, mask=lanes >= _R32_BS)
    return violation, flags


@triton.jit
def _stage_status(pend_status_ptr, lanes, step, flags, guard, violations):
    """The engine status the publisher writes with the record (no atomics on host memory)."""
    status = tl.zeros([16], dtype=tl.int64)
    status = put(status, lanes, _S_STEPS, step + 1)
    status = put(status, lanes, _S_FLAGS, ((flags & _F_FALLBACK) != 0).to(tl.int64) | (guard << 32))
    status = put(status, lanes, _S_VIOLATIONS, violations)
    status = put(status, lanes, _S_HEARTBEAT, step + 1)
    status = put(status, lanes, _P_VALID, 1)
    tl.store(pend_status_ptr + lanes, status, mask=lanes < _PENDING_WORDS)


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
    guard = word(state, lanes, _T_GUARD)
    violations = word(state, lanes, _T_VIOLATIONS)
    if word(state, lanes, _T_HAS_STEP) != 0:
        violation, flags = _stage_record(
            info_ptr, live_ptr, acc_stash_ptr, conf_stash_ptr, bits_ptr, pend_i64, pend_i32, pend_f32, pend_u8,
            state, lanes, now, NUM_DRAFTS, MAX_BS, BLOCK_B, BLOCK, LAYERS, NUM_WORDS, BLOCK_Y, BLOCK_W,
            CONF_OFF, LIVE_OFF, ACC_OFF, EXA_OFF, EXL_OFF, HAS_BITS)
        guard = guard | violation.to(tl.int64)
        violations = violations + violation.to(tl.int64)
        _stage_status(pend_status_ptr, lanes, word(state, lanes, _T_STEP), flags, guard, violations)
    else:
        tl.store(pend_status_ptr + lanes, tl.zeros([16], dtype=tl.int64), mask=lanes < _PENDING_WORDS)
    # every read of the previous step's buffers is done before this step overwrites them
    tl.debug_barrier()
    state = put(put(state, lanes, _T_GUARD, guard), lanes, _T_VIOLATIONS, violations)
    if STAGE_ONLY:
        state = put(state, lanes, _T_HAS_STEP, 0)
    else:
        step = _decide_step(staged_ptr, staged64_ptr, conf_ptr, conf_stride, conf_rows, conf_stash_ptr, live_ptr,
                            info_ptr, lanes, guard, C_WORDS, BLOCK_C, MAX_BUCKETS, BUCKET_WORDS, NUM_DRAFTS,
                            MAX_BS, BLOCK_B)
        state = put(put(state, lanes, _T_HAS_STEP, 1), lanes, _T_STEP, step)
        state = put(put(state, lanes, _T_START, now), lanes, _T_END, 0)
    tl.store(state_ptr + lanes, state, mask=lanes != _T_RECORDS)  # the record count is the publisher's


# -- end and publish --------------------------------------------------------------------------------

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
    tl.store(state_ptr + _T_END, now_ns(clock_ptr, USE_TIMER))


@triton.jit
def _publish_kernel(ring_header_ptr, ring_i64, ring_i32, status_i64, state_ptr, pend_i32, pend_status_ptr,
                    SLOTS: tl.constexpr, RECORD_WORDS: tl.constexpr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    pending = tl.load(pend_status_ptr + lanes, mask=lanes < _PENDING_WORDS, other=0)
    if word(pending, lanes, _P_VALID) != 0:
        n = tl.load(state_ptr + _T_RECORDS)
        base = (n % SLOTS) * RECORD_WORDS  # int32 word of the slot
        lane0 = lanes == 0
        seq_index = base // 2 + lanes * 0
        tl.store(ring_i64 + seq_index, (2 * n + 1) + lanes * 0, mask=lane0)
        fence(lanes, USE_ASM)
        for start in range(_R32_AFTER_SEQ, RECORD_WORDS, BLOCK):
            i = start + lanes
            tl.store(ring_i32 + base + i, tl.load(pend_i32 + i, mask=i < RECORD_WORDS), mask=i < RECORD_WORDS)
        # publish: every thread's data before the seq, system-wide
        fence(lanes, USE_ASM)
        tl.debug_barrier()
        fence(lanes, USE_ASM)
        tl.store(ring_i64 + seq_index, (2 * n + 2) + lanes * 0, mask=lane0)
        fence(lanes, USE_ASM)
        tl.store(ring_header_ptr + lanes * 0, (n + 1) + lanes * 0, mask=lane0)
        tl.store(state_ptr + _T_RECORDS, n + 1)
        tl.store(status_i64 + lanes, pending, mask=lanes < _S_WORDS)


class StepBuffers:
    """Device buffers of the step kernels; they exist before capture and live as long as the graphs.

    ``device_clock`` False: ``clock`` stands in for ``%globaltimer`` (tests fill it).
    """

    def __init__(self, layout, device):
        config = layout.config
        self.layout, self.device = layout, torch.device(device)
        self.max_bs, self.stride = config.max_bs, config.stride
        self.state = torch.zeros(_STATE_WORDS, dtype=torch.int64, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.live = torch.full((config.max_bs,), config.stride, dtype=torch.int32, device=self.device)
        self.info = torch.zeros(INFO_WORDS, dtype=torch.int32, device=self.device)
        self.conf_stash = torch.zeros(config.max_bs * config.num_drafts, dtype=torch.float32, device=self.device)
        self.acc_stash = torch.zeros(config.max_bs, dtype=torch.int32, device=self.device)
        self.conf_missing = torch.zeros((1, config.num_drafts), dtype=torch.float32, device=self.device)
        self.pending = torch.zeros(layout.record_size, dtype=torch.uint8, device=self.device)
        self.pending_status = torch.zeros(int(_PENDING_WORDS), dtype=torch.int64, device=self.device)
        self.device_clock = True

    @property
    def use_timer(self) -> bool:
        return use_asm(self.device) and self.device_clock


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


def publish_record(buffers: StepBuffers, mapped) -> None:
    """Publish the pending record, if any, into ``mapped``'s ring (graph-safe, no host sync)."""
    layout = buffers.layout
    if mapped.layout.record_size != layout.record_size:
        raise ValueError("the buffers and the segment disagree on the record layout")
    _publish_kernel[(1,)](mapped.ring_header, mapped.ring_i64, mapped.ring_i32, mapped.status_u64,
                          buffers.state, buffers.pending.view(torch.int32), buffers.pending_status,
                          SLOTS=layout.config.ring_slots, RECORD_WORDS=layout.record_size // 4, BLOCK=512,
                          USE_ASM=use_asm(buffers.device), num_warps=4)
