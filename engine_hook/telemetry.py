"""The step's telemetry record, written by the device into this rank's mapped ring slot and
published without a host sync: ``seq = 2n+1``, system-scope fence, data, fence, ``seq = 2n+2``,
``next_record = n+1`` (layout: ``vcap.segment``). Distinct experts per layer are counted from
the router's bitmaps on sampled steps only (the live-length kernel decides which, on the
device). Without CUDA, ``publish_host`` writes the same record through the host path.
"""

import os
import time

import numpy as np
import torch
import triton
import triton.language as tl

from vcap.segment import Layout, RingWriter, record_dtype

__all__ = ["publish", "publish_host"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fence(x, USE_ASM: tl.constexpr):
    if USE_ASM:
        x = tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def _pick(vector, lanes, index):
    return tl.sum(tl.where(lanes == index, vector, 0), 0)


@triton.jit
def _popcount(x):
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _record_kernel(ring_header_ptr, ring_i64, ring_i32, ring_f32, ring_u8, status_i64,
                   state_ptr, info_ptr, clock_ptr, live_ptr, conf_ptr, conf_stride, conf_rows,
                   accepted_ptr, bits_ptr, num_queued,
                   SLOTS: tl.constexpr, RECORD_SIZE: tl.constexpr, MAX_BS: tl.constexpr,
                   NUM_DRAFTS: tl.constexpr, LAYERS: tl.constexpr, NUM_WORDS: tl.constexpr,
                   CONF_OFF: tl.constexpr, LIVE_OFF: tl.constexpr, ACC_OFF: tl.constexpr,
                   EXA_OFF: tl.constexpr, EXL_OFF: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_W: tl.constexpr,
                   HAS_CONF: tl.constexpr, HAS_ACCEPTED: tl.constexpr, HAS_BITS: tl.constexpr,
                   USE_ASM: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    state = tl.load(state_ptr + lanes, mask=lanes < 16, other=0)
    info = tl.load(info_ptr + lanes, mask=lanes < 8, other=0)
    n = _pick(state, lanes, 8)
    base = (n % SLOTS) * RECORD_SIZE  # byte offset of the slot
    seq_index = base // 8 + lanes * 0
    lane0 = lanes == 0
    tl.store(ring_i64 + seq_index, (2 * n + 1) + lanes * 0, mask=lane0)
    _fence(lanes, USE_ASM)
    if USE_ASM:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
    else:
        now = tl.load(clock_ptr)
    step = _pick(state, lanes, 4) - 1
    start = _pick(state, lanes, 7)
    bs = _pick(info, lanes, 3)
    flags = _pick(info, lanes, 2)
    sampled = _pick(info, lanes, 4) != 0

    # per request: live (u8), accepted (u8), guard: accepted never above L - 1
    b = tl.arange(0, BLOCK_B)
    b_mask = b < MAX_BS
    live = tl.load(live_ptr + b, mask=b_mask, other=1)
    tl.store(ring_u8 + base + LIVE_OFF + b, live.to(tl.uint8), mask=b_mask)
    if HAS_ACCEPTED:
        accepted = tl.load(accepted_ptr + b, mask=b < bs, other=0).to(tl.int32)
        accepted = tl.minimum(tl.maximum(accepted, 0), 255)
    else:
        accepted = tl.zeros([BLOCK_B], dtype=tl.int32)
    tl.store(ring_u8 + base + ACC_OFF + b, accepted.to(tl.uint8), mask=b_mask)
    violation = tl.max(((b < bs) & (accepted > live - 1)).to(tl.int32), 0)
    flags = flags | (violation * 8)

    # confidence, request-major, zero past bs or when missing
    for start_index in range(0, MAX_BS * NUM_DRAFTS, BLOCK):
        i = start_index + lanes
        row = i // NUM_DRAFTS
        value = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_CONF:
            present = (flags & 16) == 0
            ok = (row < bs) & (row < conf_rows) & ((lanes * 0 + present.to(tl.int32)) != 0)
            value = tl.load(conf_ptr + row.to(tl.int64) * conf_stride + (i % NUM_DRAFTS), mask=ok,
                            other=0.0).to(tl.float32)
        tl.store(ring_f32 + (base + CONF_OFF) // 4 + i, value, mask=i < MAX_BS * NUM_DRAFTS)

    # distinct experts per layer from the router's bitmaps (sampled steps), then clear them
    y = tl.arange(0, BLOCK_Y)
    w = tl.arange(0, BLOCK_W)
    count_all = tl.zeros([BLOCK_Y], dtype=tl.int32)
    count_live = tl.zeros([BLOCK_Y], dtype=tl.int32)
    if HAS_BITS:
        yw_mask = (y[:, None] < LAYERS) & (w[None, :] < NUM_WORDS)
        offsets = y[:, None] * (2 * NUM_WORDS) + w[None, :]
        bits_all = tl.load(bits_ptr + offsets, mask=yw_mask, other=0)
        bits_live = tl.load(bits_ptr + offsets + NUM_WORDS, mask=yw_mask, other=0)
        counted = (y * 0 + sampled.to(tl.int32)) != 0
        count_all = tl.where(counted, tl.sum(_popcount(bits_all), axis=1), 0)
        count_live = tl.where(counted, tl.sum(_popcount(bits_live), axis=1), 0)
        tl.store(bits_ptr + offsets, tl.zeros([BLOCK_Y, BLOCK_W], dtype=tl.int32), mask=yw_mask)
        tl.store(bits_ptr + offsets + NUM_WORDS, tl.zeros([BLOCK_Y, BLOCK_W], dtype=tl.int32), mask=yw_mask)
        flags = flags & ~4
        flags = flags | (sampled.to(tl.int32) * 4)
    else:
        flags = flags & ~4
    tl.store(ring_i32 + (base + EXA_OFF) // 4 + y, count_all, mask=y < LAYERS)
    tl.store(ring_i32 + (base + EXL_OFF) // 4 + y, count_live, mask=y < LAYERS)

    # record header (after seq)
    head = tl.where(lanes == 1, step, tl.where(lanes == 2, now, tl.where(lanes == 3, now - start, 0)))
    tl.store(ring_i64 + base // 8 + lanes, head, mask=(lanes >= 1) & (lanes < 4))
    words = tl.where(lanes == 8, bs, tl.where(lanes == 9, _pick(info, lanes, 0), tl.where(
        lanes == 10, flags, tl.where(lanes == 11, _pick(info, lanes, 1), tl.where(lanes == 12, num_queued, 0)))))
    tl.store(ring_i32 + base // 4 + lanes, words, mask=(lanes >= 8) & (lanes < 16))

    # publish: every thread's data before the seq, system-wide
    _fence(lanes, USE_ASM)
    tl.debug_barrier()
    _fence(lanes, USE_ASM)
    tl.store(ring_i64 + seq_index, (2 * n + 2) + lanes * 0, mask=lane0)
    _fence(lanes, USE_ASM)
    tl.store(ring_header_ptr + lanes * 0, (n + 1) + lanes * 0, mask=lane0)
    tl.store(state_ptr + 8, n + 1)
    guard_before = _pick(state, lanes, 6)
    tl.store(state_ptr + 6, guard_before | violation.to(tl.int64))
    # engine status: steps, fallback_active | guard_tripped << 32, guard_violations, heartbeat
    status = tl.where(lanes == 0, step + 1, tl.where(
        lanes == 1, (flags & 1).to(tl.int64) | ((guard_before | violation.to(tl.int64)) << 32), tl.where(
            lanes == 3, step + 1, 0)))
    tl.store(status_i64 + lanes, status, mask=(lanes == 0) | (lanes == 1) | (lanes == 3))
    # violations counted on the device (no atomics on host memory), mirrored to the status block
    violations = _pick(state, lanes, 9) + violation.to(tl.int64)
    tl.store(state_ptr + 9, violations)
    tl.store(status_i64 + 2, violations)


def publish(mapped, step_state, *, confidence: torch.Tensor | None = None,
            accepted: torch.Tensor | None = None, expert_bits: torch.Tensor | None = None,
            num_queued: int = 0) -> None:
    """Launch the record kernel for this step (graph-safe, no host sync).

    ``mapped`` is a :class:`~vcap.engine_hook.mapping.MappedSegment`, ``step_state`` the
    :class:`~vcap.engine_hook.live_length.StepState` the live-length kernel ran on this step;
    ``expert_bits`` int32 ``[layers, 2, ceil(E/32)]`` as the router filled it.
    """
    layout: Layout = mapped.layout
    config = layout.config
    if step_state.max_bs != config.max_bs or step_state.stride != config.stride:
        raise ValueError("the step state and the segment disagree on max_bs or stride")
    num_words = (config.num_experts + 31) // 32
    if expert_bits is not None and (expert_bits.shape != (config.num_moe_layers, 2, num_words)
                                    or expert_bits.dtype != torch.int32 or not expert_bits.is_contiguous()):
        raise ValueError(f"expert_bits must be contiguous int32 [{config.num_moe_layers}, 2, {num_words}]")
    if confidence is not None and (confidence.dim() != 2 or confidence.shape[1] != config.num_drafts
                                   or confidence.stride(1) != 1):
        raise ValueError(f"confidence must be [bs, {config.num_drafts}] with unit column stride")
    dummy = step_state.info
    use_asm = mapped.device.type == "cuda" and not _INTERPRET
    _record_kernel[(1,)](
        mapped.ring_header, mapped.ring_i64, mapped.ring_i32, mapped.ring_f32, mapped.ring_u8,
        mapped.status_u64, step_state.state, step_state.info, step_state.clock, step_state.live,
        confidence if confidence is not None else step_state.conf_missing,
        confidence.stride(0) if confidence is not None else 0,
        confidence.shape[0] if confidence is not None else 0,
        accepted if accepted is not None else dummy, expert_bits if expert_bits is not None else dummy,
        int(num_queued),
        SLOTS=config.ring_slots, RECORD_SIZE=layout.record_size, MAX_BS=config.max_bs,
        NUM_DRAFTS=config.num_drafts, LAYERS=config.num_moe_layers, NUM_WORDS=num_words,
        CONF_OFF=layout.conf_offset, LIVE_OFF=layout.live_offset, ACC_OFF=layout.accepted_offset,
        EXA_OFF=layout.experts_all_offset, EXL_OFF=layout.experts_live_offset, BLOCK=256,
        BLOCK_B=triton.next_power_of_2(config.max_bs),
        BLOCK_Y=triton.next_power_of_2(max(config.num_moe_layers, 1)),
        BLOCK_W=triton.next_power_of_2(num_words), HAS_CONF=confidence is not None,
        HAS_ACCEPTED=accepted is not None, HAS_BITS=expert_bits is not None and config.num_moe_layers > 0,
        USE_ASM=use_asm, num_warps=4)


def publish_host(writer: RingWriter, *, step: int, bs: int, generation: int, flags: int, mode: int,
                 live: np.ndarray, confidence: np.ndarray | None = None, accepted: np.ndarray | None = None,
                 experts_all=None, experts_live=None, step_ns: int = 0, num_queued: int = 0) -> int:
    """The host path (no CUDA): the same record through ``RingWriter``; returns its number."""
    layout = writer.segment.layout
    record = np.zeros((), dtype=record_dtype(layout))
    record["step"], record["time_ns"], record["step_ns"] = step, time.monotonic_ns(), step_ns
    record["bs"], record["generation"], record["flags"], record["mode"] = bs, generation, flags, mode
    record["num_queued"] = num_queued
    record["live"][:] = 1
    record["live"][:len(live)] = live
    if confidence is not None:
        record["confidence"][:bs] = confidence[:bs]
    if accepted is not None:
        record["accepted"][:bs] = np.clip(accepted[:bs], 0, 255)
    if experts_all is not None:
        record["experts_all"][:] = experts_all
        record["experts_live"][:] = experts_live
    return writer.publish(record)
