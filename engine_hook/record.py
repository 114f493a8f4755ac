"""The telemetry record of a verify step, built on the device without a host sync.

Step ``n``'s record is staged into the device ``pending`` buffer at the start of step ``n + 1``
(:func:`stage_record`, called by the begin kernel on the critical path, device memory only), then
published into this rank's mapped ring slot on a side stream (:func:`publish_record`) under the
record seqlock: ``seq = 2n+1``, system-scope fence, data, fence, ``seq = 2n+2``, ``next_record =
n+1`` (layout: ``vcap.segment``). Distinct experts per layer are counted from the router's bitmaps
on sampled steps only.
"""

import torch
import triton
import triton.language as tl

from vcap.segment import (FLAG_EXPERTS_SAMPLED, FLAG_FALLBACK, FLAG_GUARD_VIOLATION, RECORD_BS, RECORD_FLAGS,
                          RECORD_GENERATION, RECORD_MODE, RECORD_NUM_QUEUED, RECORD_STEP, RECORD_STEP_NS,
                          RECORD_TIME_NS, STATUS_ENGINE_HEARTBEAT, STATUS_FALLBACK_ACTIVE, STATUS_GUARD_VIOLATIONS,
                          STATUS_STEPS)

from ._triton import fence, popcount, put, use_asm, word
from .buffers import (INFO_BS, INFO_FLAGS, INFO_GENERATION, INFO_MODE, INFO_NUM_QUEUED, INFO_SAMPLED, INFO_WORDS,
                      PENDING_VALID, PENDING_WORDS, STATE_END, STATE_RECORDS, STATE_START, STATE_STEP, StepBuffers)

__all__ = ["stage_record", "stage_status", "publish_record"]

_K = tl.constexpr
_INFO_BS, _INFO_FLAGS, _INFO_GENERATION = _K(INFO_BS), _K(INFO_FLAGS), _K(INFO_GENERATION)
_INFO_MODE, _INFO_NUM_QUEUED, _INFO_SAMPLED, _INFO_WORDS = (_K(INFO_MODE), _K(INFO_NUM_QUEUED), _K(INFO_SAMPLED),
                                                            _K(INFO_WORDS))
_STATE_END, _STATE_RECORDS, _STATE_START, _STATE_STEP = (_K(STATE_END), _K(STATE_RECORDS), _K(STATE_START),
                                                         _K(STATE_STEP))
_PENDING_VALID, _PENDING_WORDS = _K(PENDING_VALID), _K(PENDING_WORDS)
_F_FALLBACK, _F_SAMPLED, _F_GUARD = _K(FLAG_FALLBACK), _K(FLAG_EXPERTS_SAMPLED), _K(FLAG_GUARD_VIOLATION)
_R64_STEP, _R64_TIME, _R64_STEP_NS = _K(RECORD_STEP // 8), _K(RECORD_TIME_NS // 8), _K(RECORD_STEP_NS // 8)
_R32_BS, _R32_GENERATION, _R32_FLAGS = _K(RECORD_BS // 4), _K(RECORD_GENERATION // 4), _K(RECORD_FLAGS // 4)
_R32_MODE, _R32_NUM_QUEUED = _K(RECORD_MODE // 4), _K(RECORD_NUM_QUEUED // 4)
_R32_AFTER_SEQ = _K(2)  # the seq is the record's first u64
_S_STEPS, _S_FLAGS = _K(STATUS_STEPS), _K(STATUS_FALLBACK_ACTIVE // 2)  # fallback_active | guard_tripped << 32
_S_VIOLATIONS, _S_HEARTBEAT, _S_WORDS = _K(STATUS_GUARD_VIOLATIONS), _K(STATUS_ENGINE_HEARTBEAT), _K(4)


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
def stage_record(info_ptr, live_ptr, acc_stash_ptr, conf_stash_ptr, bits_ptr, pend_i64, pend_i32, pend_f32,
                 pend_u8, state, lanes, now, NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, LAYERS: tl.constexpr, NUM_WORDS: tl.constexpr,
                 BLOCK_Y: tl.constexpr, BLOCK_W: tl.constexpr, CONF_OFF: tl.constexpr, LIVE_OFF: tl.constexpr,
                 ACC_OFF: tl.constexpr, EXA_OFF: tl.constexpr, EXL_OFF: tl.constexpr, HAS_BITS: tl.constexpr):
    """The previous step's record into ``pending`` (all but its seq, which is the publisher's);
    returns ``(violation, flags)``: violation is 1 when a request accepted more than ``L - 1``."""
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
    end = word(state, lanes, _STATE_END)
    head = tl.zeros([16], dtype=tl.int64)
    head = put(head, lanes, _R64_STEP, word(state, lanes, _STATE_STEP))
    head = put(head, lanes, _R64_TIME, tl.where(end != 0, end, now))
    head = put(head, lanes, _R64_STEP_NS, tl.where(end != 0, end - word(state, lanes, _STATE_START), 0))
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
def stage_status(pend_status_ptr, lanes, step, flags, guard, violations):
    """The engine status the publisher writes with the record (no atomics on host memory)."""
    status = tl.zeros([16], dtype=tl.int64)
    status = put(status, lanes, _S_STEPS, step + 1)
    status = put(status, lanes, _S_FLAGS, ((flags & _F_FALLBACK) != 0).to(tl.int64) | (guard << 32))
    status = put(status, lanes, _S_VIOLATIONS, violations)
    status = put(status, lanes, _S_HEARTBEAT, step + 1)
    status = put(status, lanes, _PENDING_VALID, 1)
    tl.store(pend_status_ptr + lanes, status, mask=lanes < _PENDING_WORDS)


@triton.jit
def _publish_kernel(ring_header_ptr, ring_i64, ring_i32, status_i64, state_ptr, pend_i32, pend_status_ptr,
                    SLOTS: tl.constexpr, RECORD_WORDS: tl.constexpr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    pending = tl.load(pend_status_ptr + lanes, mask=lanes < _PENDING_WORDS, other=0)
    if word(pending, lanes, _PENDING_VALID) != 0:
        n = tl.load(state_ptr + _STATE_RECORDS)
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
        tl.store(state_ptr + _STATE_RECORDS, n + 1)
        tl.store(status_i64 + lanes, pending, mask=lanes < _S_WORDS)


def publish_record(buffers: StepBuffers, mapped) -> None:
    """Publish the pending record, if any, into ``mapped``'s ring (graph-safe, no host sync)."""
    layout = buffers.layout
    if mapped.layout.record_size != layout.record_size:
        raise ValueError("the buffers and the segment disagree on the record layout")
    _publish_kernel[(1,)](mapped.ring_header, mapped.ring_i64, mapped.ring_i32, mapped.status_u64,
                          buffers.state, buffers.pending.view(torch.int32), buffers.pending_status,
                          SLOTS=layout.config.ring_slots, RECORD_WORDS=layout.record_size // 4, BLOCK=512,
                          USE_ASM=use_asm(buffers.device), num_warps=4)
