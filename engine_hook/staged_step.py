"""The staged path's kernels: the per-step policy comes from the host (``host_snapshot``), and the
telemetry record of step ``n`` is built at the start of step ``n + 1`` and published on a side
stream, so only device-memory work stays on the verify step's critical path.

- ``_begin_kernel`` (critical path, device memory only): first stage the previous step's record
  (live, accepted, confidence, expert counts, guard check) into a device ``pending`` record,
  then turn the staged policy and this step's confidence into live lengths, exactly as
  ``reference.live_lengths``.
- ``_end_kernel`` (critical path, tiny): the step's end time and its accepted counts.
- ``_publish_kernel`` (side stream, overlaps the verify): copy ``pending`` into the mapped ring
  slot under the record seqlock, with system-scope fences (``seq = 2n+1``, data, ``2n+2``).
"""

import os

import torch
import triton
import triton.language as tl

from .host_snapshot import STAGED_HEAD
from .live_length import INFO_WORDS, _field, _now_ns
from .telemetry import _fence, _pick, _popcount

__all__ = ["StagedBuffers", "staged_begin", "staged_end", "staged_publish"]

# state (int64, device)
_T_HAS_STEP = tl.constexpr(0)
_T_STEP = tl.constexpr(1)
_T_START = tl.constexpr(2)
_T_END = tl.constexpr(3)
_T_GUARD = tl.constexpr(4)
_T_VIOLATIONS = tl.constexpr(5)
_T_RECORDS = tl.constexpr(6)
STATE_WORDS = 16
# pending status (int64): valid, steps, fallback | guard << 32, violations, engine heartbeat
PENDING_STATUS_WORDS = 8
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _begin_kernel(staged_ptr, staged64_ptr, state_ptr, clock_ptr, live_ptr, info_ptr,
                  conf_ptr, conf_stride, conf_rows, conf_stash_ptr, acc_stash_ptr, bits_ptr,
                  pend_i64, pend_i32, pend_f32, pend_u8, pend_status_ptr,
                  C_WORDS: tl.constexpr, BLOCK_C: tl.constexpr, MAX_BUCKETS: tl.constexpr,
                  BUCKET_WORDS: tl.constexpr, NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, HEAD: tl.constexpr,
                  LAYERS: tl.constexpr, NUM_WORDS: tl.constexpr, BLOCK_Y: tl.constexpr,
                  BLOCK_W: tl.constexpr, CONF_OFF: tl.constexpr, LIVE_OFF: tl.constexpr,
                  ACC_OFF: tl.constexpr, EXA_OFF: tl.constexpr, EXL_OFF: tl.constexpr,
                  HAS_BITS: tl.constexpr, USE_TIMER: tl.constexpr, STAGE_ONLY: tl.constexpr):
    lanes = tl.arange(0, 16)
    state = tl.load(state_ptr + lanes)
    now = _now_ns(clock_ptr, USE_TIMER)
    guard = _pick(state, lanes, _T_GUARD)
    violations = _pick(state, lanes, _T_VIOLATIONS)
    has_prev = _pick(state, lanes, _T_HAS_STEP) != 0
    b = tl.arange(0, BLOCK_B)
    b_mask = b < MAX_BS

    # -- the previous step's record, into the device pending buffer --------------------------
    if has_prev:
        info = tl.load(info_ptr + lanes, mask=lanes < 8, other=0)
        bs = _pick(info, lanes, 3)
        flags = _pick(info, lanes, 2)
        sampled = _pick(info, lanes, 4) != 0
        live = tl.load(live_ptr + b, mask=b_mask, other=1)
        tl.store(pend_u8 + LIVE_OFF + b, live.to(tl.uint8), mask=b_mask)
        accepted = tl.load(acc_stash_ptr + b, mask=b_mask & (b < bs), other=0)
        tl.store(pend_u8 + ACC_OFF + b, accepted.to(tl.uint8), mask=b_mask)
        violation = tl.max(((b < bs) & (accepted > live - 1)).to(tl.int32), 0)
        flags = flags | (violation * 8)
        for start_index in range(0, MAX_BS * NUM_DRAFTS, BLOCK):
            i = start_index + tl.arange(0, BLOCK)
            tl.store(pend_f32 + CONF_OFF // 4 + i, tl.load(conf_stash_ptr + i, mask=i < MAX_BS * NUM_DRAFTS, other=0.0),
                     mask=i < MAX_BS * NUM_DRAFTS)
        y = tl.arange(0, BLOCK_Y)
        count_all = tl.zeros([BLOCK_Y], dtype=tl.int32)
        count_live = tl.zeros([BLOCK_Y], dtype=tl.int32)
        flags = flags & ~4
        if HAS_BITS:
            w = tl.arange(0, BLOCK_W)
            yw_mask = (y[:, None] < LAYERS) & (w[None, :] < NUM_WORDS)
            offsets = y[:, None] * (2 * NUM_WORDS) + w[None, :]
            bits_all = tl.load(bits_ptr + offsets, mask=yw_mask, other=0)
            bits_live = tl.load(bits_ptr + offsets + NUM_WORDS, mask=yw_mask, other=0)
            counted = (y * 0 + sampled.to(tl.int32)) != 0
            count_all = tl.where(counted, tl.sum(_popcount(bits_all), axis=1), 0)
            count_live = tl.where(counted, tl.sum(_popcount(bits_live), axis=1), 0)
            tl.store(bits_ptr + offsets, tl.zeros([BLOCK_Y, BLOCK_W], dtype=tl.int32), mask=yw_mask)
            tl.store(bits_ptr + offsets + NUM_WORDS, tl.zeros([BLOCK_Y, BLOCK_W], dtype=tl.int32), mask=yw_mask)
            flags = flags | (sampled.to(tl.int32) * 4)
        tl.store(pend_i32 + EXA_OFF // 4 + y, count_all, mask=y < LAYERS)
        tl.store(pend_i32 + EXL_OFF // 4 + y, count_live, mask=y < LAYERS)
        step = _pick(state, lanes, _T_STEP)
        end = _pick(state, lanes, _T_END)
        end_time = tl.where(end != 0, end, now)
        step_ns = tl.where(end != 0, end - _pick(state, lanes, _T_START), 0)
        head = tl.where(lanes == 1, step, tl.where(lanes == 2, end_time, tl.where(lanes == 3, step_ns, 0)))
        tl.store(pend_i64 + lanes, head, mask=(lanes >= 1) & (lanes < 4))  # seq stays the publisher's
        words = tl.where(lanes == 8, bs, tl.where(lanes == 9, _pick(info, lanes, 0), tl.where(
            lanes == 10, flags, tl.where(lanes == 11, _pick(info, lanes, 1),
                                         tl.where(lanes == 12, _pick(info, lanes, 6), 0)))))
        tl.store(pend_i32 + lanes, words, mask=lanes >= 8)
        guard = guard | violation.to(tl.int64)
        violations = violations + violation.to(tl.int64)
        status = tl.where(lanes == 0, 1, tl.where(lanes == 1, step + 1, tl.where(
            lanes == 2, (flags & 1).to(tl.int64) | (guard << 32), tl.where(
                lanes == 3, violations, tl.where(lanes == 4, step + 1, 0)))))
        tl.store(pend_status_ptr + lanes, status, mask=lanes < 8)
    else:
        tl.store(pend_status_ptr + lanes, tl.zeros([16], dtype=tl.int64), mask=lanes < 8)
    # every read of the previous step's buffers is done before this step overwrites them
    tl.debug_barrier()
    state = tl.where(lanes == _T_GUARD, guard, tl.where(lanes == _T_VIOLATIONS, violations, state))

    if STAGE_ONLY:
        state = tl.where(lanes == _T_HAS_STEP, 0, state)
        tl.store(state_ptr + lanes, state, mask=lanes != _T_RECORDS)
    else:
        # -- this step: the staged policy (host-read), every value clamped ------------------
        c = tl.arange(0, BLOCK_C)
        block = tl.load(staged_ptr + HEAD + c, mask=c < C_WORDS, other=0)
        head_words = tl.load(staged_ptr + lanes)
        bs = tl.minimum(tl.maximum(_pick(head_words, lanes, 0), 0), MAX_BS)
        conf_present = _pick(head_words, lanes, 1) != 0
        explore = _pick(head_words, lanes, 2) != 0
        sampled = _pick(head_words, lanes, 3) != 0
        source = _pick(head_words, lanes, 4)
        num_queued = _pick(head_words, lanes, 5)
        step = tl.load(staged64_ptr + 3)
        use_fb = source == 2
        generation = _field(block, c, 1)
        mode = _field(block, c, 2)
        fixed_k = tl.minimum(tl.maximum(_field(block, c, 3), 1), NUM_DRAFTS)
        num_buckets = tl.minimum(tl.maximum(_field(block, c, 4), 0), MAX_BUCKETS)
        index = (c - 8) // BUCKET_WORDS
        is_min_bs = (c >= 8) & (((c - 8) % BUCKET_WORDS) == 0) & (index < num_buckets) & (block <= bs)
        chosen = tl.maximum(tl.max(tl.where(is_min_bs, index, 0), 0), 0)
        bucket = 8 + chosen * BUCKET_WORDS
        k_min = tl.minimum(tl.maximum(_field(block, c, bucket + 1), 1), NUM_DRAFTS)
        k_max = tl.minimum(tl.maximum(_field(block, c, bucket + 2), k_min), NUM_DRAFTS)

        # -- live lengths; the confidence is kept for the record of this step --------------
        real = b < bs
        conf_mask = real & (b < conf_rows) & ((b * 0 + conf_present.to(tl.int32)) != 0)
        running = tl.full([BLOCK_B], 1.0, tl.float32)
        alive = tl.full([BLOCK_B], 1, tl.int32)
        k = tl.zeros([BLOCK_B], dtype=tl.int32)
        for j in tl.static_range(NUM_DRAFTS):
            raw = tl.load(conf_ptr + b.to(tl.int64) * conf_stride + j, mask=conf_mask, other=0.0).to(tl.float32)
            tl.store(conf_stash_ptr + b * NUM_DRAFTS + j, raw, mask=b_mask)
            x = tl.where(raw == raw, raw, 0.0)
            x = tl.minimum(tl.maximum(x, 0.0), 1.0)
            running = running * x
            threshold = _field(block, c, bucket + 4 + j).to(tl.float32, bitcast=True)
            alive = alive & (running >= threshold).to(tl.int32)
            k += alive
        k = tl.minimum(tl.maximum(k, k_min), k_max)
        fixed = mode == 1
        capped = fixed | ((mode == 2) & conf_present & (num_buckets > 0))
        all_live = (guard != 0) | explore | (capped == 0)
        live = tl.where(fixed, fixed_k + 1, k + 1)
        live = tl.where((b * 0 + all_live.to(tl.int32)) != 0, NUM_DRAFTS + 1, live)
        live = tl.where(real, live, 1)
        tl.store(live_ptr + b, live, mask=b_mask)
        flags = (use_fb.to(tl.int32) * 1 + explore.to(tl.int32) * 2 + sampled.to(tl.int32) * 4
                 + (guard != 0).to(tl.int32) * 8 + (conf_present == 0).to(tl.int32) * 16)
        info = tl.where(lanes == 0, generation, tl.where(lanes == 1, tl.where((mode >= 0) & (mode <= 2), mode, 0),
                        tl.where(lanes == 2, flags, tl.where(lanes == 3, bs, tl.where(
                            lanes == 4, sampled.to(tl.int32), tl.where(lanes == 5, source, tl.where(
                                lanes == 6, num_queued, 0)))))))
        tl.store(info_ptr + lanes, info, mask=lanes < 8)
        state = tl.where(lanes == _T_HAS_STEP, 1, tl.where(lanes == _T_STEP, step, tl.where(
            lanes == _T_START, now, tl.where(lanes == _T_END, 0, state))))
        tl.store(state_ptr + lanes, state, mask=lanes != _T_RECORDS)


@triton.jit
def _end_kernel(state_ptr, clock_ptr, info_ptr, accepted_ptr, acc_stash_ptr, MAX_BS: tl.constexpr,
                BLOCK_B: tl.constexpr, HAS_ACCEPTED: tl.constexpr, USE_TIMER: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    if HAS_ACCEPTED:
        bs = tl.load(info_ptr + 3)
        accepted = tl.load(accepted_ptr + b, mask=b < bs, other=0).to(tl.int32)
        accepted = tl.minimum(tl.maximum(accepted, 0), 255)
    else:
        accepted = tl.zeros([BLOCK_B], dtype=tl.int32)
    tl.store(acc_stash_ptr + b, accepted, mask=b < MAX_BS)
    tl.store(state_ptr + _T_END, _now_ns(clock_ptr, USE_TIMER))


@triton.jit
def _publish_kernel(ring_header_ptr, ring_i64, ring_i32, status_i64, state_ptr, pend_i32, pend_status_ptr,
                    SLOTS: tl.constexpr, RECORD_WORDS: tl.constexpr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    pending = tl.load(pend_status_ptr + lanes, mask=lanes < 8, other=0)
    if _pick(pending, lanes, 0) != 0:
        n = tl.load(state_ptr + _T_RECORDS)
        base = (n % SLOTS) * RECORD_WORDS  # int32 word of the slot
        lane0 = lanes == 0
        seq_index = base // 2 + lanes * 0
        tl.store(ring_i64 + seq_index, (2 * n + 1) + lanes * 0, mask=lane0)
        _fence(lanes, USE_ASM)
        for start_index in range(2, RECORD_WORDS, BLOCK):
            i = start_index + lanes
            tl.store(ring_i32 + base + i, tl.load(pend_i32 + i, mask=i < RECORD_WORDS), mask=i < RECORD_WORDS)
        # publish: every thread's data before the seq, system-wide
        _fence(lanes, USE_ASM)
        tl.debug_barrier()
        _fence(lanes, USE_ASM)
        tl.store(ring_i64 + seq_index, (2 * n + 2) + lanes * 0, mask=lane0)
        _fence(lanes, USE_ASM)
        tl.store(ring_header_ptr + lanes * 0, (n + 1) + lanes * 0, mask=lane0)
        tl.store(state_ptr + _T_RECORDS, n + 1)
        # engine status: steps, fallback_active | guard_tripped << 32, guard_violations, heartbeat
        tl.store(status_i64 + lanes, tl.where(lanes == 0, _pick(pending, lanes, 1), tl.where(
            lanes == 1, _pick(pending, lanes, 2), tl.where(lanes == 2, _pick(pending, lanes, 3),
                                                           _pick(pending, lanes, 4)))), mask=lanes < 4)


class StagedBuffers:
    """Device buffers of the staged path; they exist before capture and live as long as the graphs."""

    def __init__(self, layout, device):
        config = layout.config
        self.layout, self.device = layout, torch.device(device)
        self.max_bs, self.stride = config.max_bs, config.stride
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.live = torch.full((config.max_bs,), config.stride, dtype=torch.int32, device=self.device)
        self.info = torch.zeros(INFO_WORDS, dtype=torch.int32, device=self.device)
        self.conf_stash = torch.zeros(config.max_bs * config.num_drafts, dtype=torch.float32, device=self.device)
        self.acc_stash = torch.zeros(config.max_bs, dtype=torch.int32, device=self.device)
        self.conf_missing = torch.zeros((1, config.num_drafts), dtype=torch.float32, device=self.device)
        self.pending = torch.zeros(layout.record_size, dtype=torch.uint8, device=self.device)
        self.pending_status = torch.zeros(PENDING_STATUS_WORDS, dtype=torch.int64, device=self.device)
        self.device_clock = True  # False: ``clock`` stands in for %globaltimer (tests)

    @property
    def use_asm(self) -> bool:
        return self.device.type == "cuda" and not _INTERPRET


def staged_begin(buffers: StagedBuffers, staged: torch.Tensor, confidence: torch.Tensor | None,
                 expert_bits: torch.Tensor | None, *, stage_only: bool = False) -> torch.Tensor:
    """Stage the previous step's record, then (unless ``stage_only``) this step's live lengths."""
    layout, config = buffers.layout, buffers.layout.config
    num_drafts = config.num_drafts
    if confidence is None:
        confidence = buffers.conf_missing
    if confidence.dim() != 2 or confidence.shape[1] != num_drafts or confidence.stride(1) != 1:
        raise ValueError(f"confidence must be [bs, {num_drafts}] with unit column stride, got "
                         f"{tuple(confidence.shape)} strides {confidence.stride()}")
    control_words = layout.control_size // 4
    if staged.dtype != torch.int32 or staged.numel() != STAGED_HEAD + control_words or not staged.is_contiguous():
        raise ValueError(f"staged must be contiguous int32 [{STAGED_HEAD + control_words}]")
    num_words = (config.num_experts + 31) // 32
    has_bits = expert_bits is not None and config.num_moe_layers > 0
    if has_bits and (expert_bits.shape != (config.num_moe_layers, 2, num_words)
                     or expert_bits.dtype != torch.int32 or not expert_bits.is_contiguous()):
        raise ValueError(f"expert_bits must be contiguous int32 [{config.num_moe_layers}, 2, {num_words}]")
    pending = buffers.pending
    _begin_kernel[(1,)](
        staged, staged.view(torch.int64), buffers.state, buffers.clock, buffers.live, buffers.info,
        confidence, confidence.stride(0), confidence.shape[0], buffers.conf_stash, buffers.acc_stash,
        expert_bits if has_bits else buffers.info, pending.view(torch.int64), pending.view(torch.int32),
        pending.view(torch.float32), pending, buffers.pending_status,
        C_WORDS=control_words, BLOCK_C=triton.next_power_of_2(control_words), MAX_BUCKETS=config.max_buckets,
        BUCKET_WORDS=layout.bucket_size // 4, NUM_DRAFTS=num_drafts, MAX_BS=config.max_bs,
        BLOCK_B=triton.next_power_of_2(config.max_bs), BLOCK=512, HEAD=STAGED_HEAD,
        LAYERS=config.num_moe_layers, NUM_WORDS=num_words,
        BLOCK_Y=triton.next_power_of_2(max(config.num_moe_layers, 1)), BLOCK_W=triton.next_power_of_2(num_words),
        CONF_OFF=layout.conf_offset, LIVE_OFF=layout.live_offset, ACC_OFF=layout.accepted_offset,
        EXA_OFF=layout.experts_all_offset, EXL_OFF=layout.experts_live_offset, HAS_BITS=has_bits,
        USE_TIMER=buffers.use_asm and buffers.device_clock, STAGE_ONLY=stage_only, num_warps=4)
    return buffers.live


def staged_end(buffers: StagedBuffers, accepted: torch.Tensor | None) -> None:
    """The step's end time and accepted counts (clamped to 0..255), for its record."""
    if accepted is not None and (accepted.dim() != 1 or not accepted.is_contiguous()):
        raise ValueError("accepted must be a contiguous 1-d tensor (accepted drafts per request)")
    _end_kernel[(1,)](buffers.state, buffers.clock, buffers.info,
                      accepted if accepted is not None else buffers.acc_stash, buffers.acc_stash,
                      MAX_BS=buffers.max_bs, BLOCK_B=triton.next_power_of_2(buffers.max_bs),
                      HAS_ACCEPTED=accepted is not None, USE_TIMER=buffers.use_asm and buffers.device_clock,
                      num_warps=1)


def staged_publish(buffers: StagedBuffers, mapped) -> None:
    """Publish the pending record, if any, into ``mapped``'s ring (graph-safe, no host sync)."""
    layout = buffers.layout
    if mapped.layout.record_size != layout.record_size:
        raise ValueError("the buffers and the segment disagree on the record layout")
    _publish_kernel[(1,)](mapped.ring_header, mapped.ring_i64, mapped.ring_i32, mapped.status_u64,
                          buffers.state, buffers.pending.view(torch.int32), buffers.pending_status,
                          SLOTS=layout.config.ring_slots, RECORD_WORDS=layout.record_size // 4, BLOCK=512,
                          USE_ASM=buffers.use_asm, num_warps=4)
