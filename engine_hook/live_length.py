"""Once per verify step, on the device and graph-safe: snapshot the control block (seqlock, last
good kept, lease judged by the GPU's own clock, fallback when expired) and turn the step's
confidence into live lengths ``L[b] = 1 + k[b]``, exactly as ``reference.live_lengths``.

One single-CTA launch does both: the control block is read once, contiguously, from mapped
memory; everything the per-layer router needs is left in device buffers.
"""

import os

import torch
import triton
import triton.language as tl

__all__ = ["StepState", "live_lengths", "STATE_WORDS", "INFO_WORDS", "INFO_GENERATION",
           "INFO_MODE", "INFO_FLAGS", "INFO_BS", "INFO_SAMPLED", "INFO_SOURCE"]

# state (int64, device): what the kernel carries from step to step
_S_INIT = tl.constexpr(0)
_S_LAST_HB = tl.constexpr(1)
_S_HB_CHANGED = tl.constexpr(2)
_S_ODD_SINCE = tl.constexpr(3)
_S_STEP = tl.constexpr(4)
_S_HAVE_GOOD = tl.constexpr(5)
_S_GUARD = tl.constexpr(6)
_S_START = tl.constexpr(7)
_S_RECORDS = tl.constexpr(8)
STATE_WORDS = 16
# info (int32, device): what this step decided, for the router and the telemetry record
INFO_GENERATION, INFO_MODE, INFO_FLAGS, INFO_BS, INFO_SAMPLED, INFO_SOURCE = range(6)
INFO_WORDS = 8
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fence_sys(x):
    # System-scope acquire/release fence, threaded through a value so it stays in order.
    return tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _now_ns(clock_ptr, USE_TIMER: tl.constexpr):
    if USE_TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.load(clock_ptr)
    return t


@triton.jit
def _field(block, c, index):
    # one word of the register-resident control block (exact: a sum of one value and zeros)
    return tl.sum(tl.where(c == index, block, 0), 0)


@triton.jit
def _live_length_kernel(ctrl_ptr, fallback_ptr, heartbeat_ptr, snap_ptr, state_ptr, clock_ptr,
                        step_in_ptr, conf_ptr, conf_stride, conf_rows, live_ptr, info_ptr,
                        lease_ns, sample_period,
                        C_WORDS: tl.constexpr, BLOCK_C: tl.constexpr, MAX_BUCKETS: tl.constexpr,
                        BUCKET_WORDS: tl.constexpr, NUM_DRAFTS: tl.constexpr, MAX_BS: tl.constexpr,
                        BLOCK_B: tl.constexpr, USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
    # -- seqlock read of the mapped control block: seq, fence, body, fence, seq --------------
    c = tl.arange(0, BLOCK_C)
    c_mask = c < C_WORDS
    heartbeat = tl.load(heartbeat_ptr, volatile=True)
    fallback = tl.load(fallback_ptr + c, mask=c_mask, other=0)
    last_good = tl.load(snap_ptr + c, mask=c_mask, other=0)
    # One warp (num_warps=1): a scalar load is one warp-wide read of host memory, so every lane
    # sees the same seq; each lane's part of the body sits between the two fences.
    seq1 = tl.load(ctrl_ptr, volatile=True)
    if USE_ASM:
        seq1 = _fence_sys(seq1)
    body = tl.load(ctrl_ptr + c, mask=c_mask, other=0, volatile=True)
    if USE_ASM:
        body = _fence_sys(body)
    seq2 = tl.load(ctrl_ptr, volatile=True)
    ok = (seq1 == seq2) & ((seq1 & 1) == 0)
    ok_block = (c * 0 + ok.to(tl.int32)) != 0
    tl.store(snap_ptr + c, body, mask=c_mask & ok_block)

    # -- lease, by the GPU's own clock ---------------------------------------------------------
    now = _now_ns(clock_ptr, USE_TIMER)
    first = tl.load(state_ptr + _S_INIT) == 0
    last_hb = tl.where(first, heartbeat, tl.load(state_ptr + _S_LAST_HB))
    hb_changed = tl.where(first, now, tl.load(state_ptr + _S_HB_CHANGED))
    hb_changed = tl.where(heartbeat != last_hb, now, hb_changed)
    odd_since = tl.where(first, -1, tl.load(state_ptr + _S_ODD_SINCE))
    odd_since = tl.where(ok, -1, tl.where(odd_since == -1, now, odd_since))
    expired = ((now - hb_changed) > lease_ns) | ((odd_since != -1) & ((now - odd_since) > lease_ns))
    have_good = (tl.load(state_ptr + _S_HAVE_GOOD) != 0) | ok
    use_fb = expired | (have_good == 0)
    step = tl.load(state_ptr + _S_STEP)
    guard = tl.load(state_ptr + _S_GUARD) != 0
    tl.store(state_ptr + _S_INIT, 1)
    tl.store(state_ptr + _S_LAST_HB, heartbeat)
    tl.store(state_ptr + _S_HB_CHANGED, hb_changed)
    tl.store(state_ptr + _S_ODD_SINCE, odd_since)
    tl.store(state_ptr + _S_HAVE_GOOD, have_good.to(tl.int64))
    tl.store(state_ptr + _S_STEP, step + 1)
    tl.store(state_ptr + _S_START, now)

    # -- the policy this step uses, in registers, every value clamped ------------------------
    block = tl.where((c * 0 + use_fb.to(tl.int32)) != 0, fallback, tl.where(ok_block, body, last_good))
    bs = tl.minimum(tl.maximum(tl.load(step_in_ptr), 0), MAX_BS)
    conf_present = tl.load(step_in_ptr + 1) != 0
    generation = _field(block, c, 1)
    mode = _field(block, c, 2)
    fixed_k = tl.minimum(tl.maximum(_field(block, c, 3), 1), NUM_DRAFTS)
    num_buckets = tl.minimum(tl.maximum(_field(block, c, 4), 0), MAX_BUCKETS)
    explore_period = _field(block, c, 5)
    explore = (explore_period > 0) & ((step % tl.maximum(explore_period, 1).to(tl.int64)) == 0)
    # the last bucket whose min_bs <= bs (bucket 0 when none)
    index = (c - 8) // BUCKET_WORDS
    is_min_bs = (c >= 8) & (((c - 8) % BUCKET_WORDS) == 0) & (index < num_buckets) & (block <= bs)
    chosen = tl.maximum(tl.max(tl.where(is_min_bs, index, 0), 0), 0)
    bucket = 8 + chosen * BUCKET_WORDS
    k_min = tl.minimum(tl.maximum(_field(block, c, bucket + 1), 1), NUM_DRAFTS)
    k_max = tl.minimum(tl.maximum(_field(block, c, bucket + 2), k_min), NUM_DRAFTS)

    # -- live lengths: running product of survival, left to right in float32 ------------------
    b = tl.arange(0, BLOCK_B)
    real = b < bs
    conf_mask = real & (b < conf_rows) & ((b * 0 + conf_present.to(tl.int32)) != 0)
    running = tl.full([BLOCK_B], 1.0, tl.float32)
    alive = tl.full([BLOCK_B], 1, tl.int32)
    k = tl.zeros([BLOCK_B], dtype=tl.int32)
    for j in tl.static_range(NUM_DRAFTS):
        x = tl.load(conf_ptr + b.to(tl.int64) * conf_stride + j, mask=conf_mask, other=0.0).to(tl.float32)
        x = tl.where(x == x, x, 0.0)
        x = tl.minimum(tl.maximum(x, 0.0), 1.0)
        running = running * x
        threshold = _field(block, c, bucket + 4 + j).to(tl.float32, bitcast=True)
        alive = alive & (running >= threshold).to(tl.int32)
        k += alive
    k = tl.minimum(tl.maximum(k, k_min), k_max)
    fixed = mode == 1
    capped = fixed | ((mode == 2) & conf_present & (num_buckets > 0))
    all_live = guard | explore | (capped == 0)
    live = tl.where(fixed, fixed_k + 1, k + 1)
    live = tl.where((b * 0 + all_live.to(tl.int32)) != 0, NUM_DRAFTS + 1, live)
    live = tl.where(real, live, 1)
    tl.store(live_ptr + b, live, mask=b < MAX_BS)

    sampled = (sample_period > 0) & ((step % tl.maximum(sample_period, 1).to(tl.int64)) == 0)
    flags = (use_fb.to(tl.int32) * 1 + explore.to(tl.int32) * 2 + sampled.to(tl.int32) * 4
             + guard.to(tl.int32) * 8 + (conf_present == 0).to(tl.int32) * 16)
    source = tl.where(use_fb, 2, tl.where(ok, 0, 1))
    tl.store(info_ptr + 0, generation)
    tl.store(info_ptr + 1, tl.where((mode >= 0) & (mode <= 2), mode, 0))
    tl.store(info_ptr + 2, flags)
    tl.store(info_ptr + 3, bs)
    tl.store(info_ptr + 4, sampled.to(tl.int32))
    tl.store(info_ptr + 5, source)


class StepState:
    """Device buffers that exist before graph capture and live as long as the graphs.

    ``max_bs`` is the engine's largest graph batch size; ``step_in[0]`` is the step's real
    batch size and ``step_in[1]`` whether the confidence is present, written eagerly before
    each replay (``set_step``).
    """

    def __init__(self, control_words: int, max_bs: int, stride: int, device, fallback_words: torch.Tensor):
        if max_bs < 1 or stride < 2:
            raise ValueError(f"need max_bs >= 1 and stride >= 2, got {max_bs}, {stride}")
        self.max_bs, self.stride, self.device = max_bs, stride, torch.device(device)
        self.snapshot = torch.zeros(control_words, dtype=torch.int32, device=self.device)
        # The fallback never changes after creation: one device copy, no mapped read per step.
        self.fallback = fallback_words.to(self.device, copy=True)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.step_in = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.live = torch.full((max_bs,), stride, dtype=torch.int32, device=self.device)
        self.info = torch.zeros(INFO_WORDS, dtype=torch.int32, device=self.device)
        self.conf_missing = torch.zeros((1, stride - 1), dtype=torch.float32, device=self.device)
        # True: the lease is judged by the GPU's %globaltimer; False: by ``clock`` (tests)
        self.device_clock = True

    def set_step(self, bs: int, confidence_present: bool) -> None:
        """Eager, before the replay: a stream-ordered fill, no host sync."""
        self.step_in[0].fill_(int(bs))
        self.step_in[1].fill_(1 if confidence_present else 0)


def live_lengths(state: StepState, control_words: torch.Tensor, heartbeat: torch.Tensor,
                 confidence: torch.Tensor | None, lease_ms: int, max_buckets: int, bucket_words: int,
                 sample_period: int = 0) -> torch.Tensor:
    """Launch the snapshot + live-length kernel; returns ``state.live`` (int32 ``[max_bs]``)."""
    num_drafts = state.stride - 1
    if confidence is None:
        confidence = state.conf_missing
    if confidence.dim() != 2 or confidence.shape[1] != num_drafts or confidence.stride(1) != 1:
        raise ValueError(f"confidence must be [bs, {num_drafts}] with unit column stride, got "
                         f"{tuple(confidence.shape)} strides {confidence.stride()}")
    if control_words.dtype != torch.int32 or control_words.numel() != state.snapshot.numel():
        raise ValueError("control_words must be the int32 words of one control block")
    if heartbeat.dtype != torch.int64:
        raise ValueError("heartbeat must be an int64 view")
    words = state.snapshot.numel()
    use_asm = state.device.type == "cuda" and not _INTERPRET
    _live_length_kernel[(1,)](
        control_words, state.fallback, heartbeat, state.snapshot, state.state, state.clock,
        state.step_in, confidence, confidence.stride(0), confidence.shape[0], state.live, state.info,
        int(lease_ms) * 1_000_000, int(sample_period),
        C_WORDS=words, BLOCK_C=triton.next_power_of_2(words), MAX_BUCKETS=max_buckets,
        BUCKET_WORDS=bucket_words, NUM_DRAFTS=num_drafts, MAX_BS=state.max_bs,
        BLOCK_B=triton.next_power_of_2(state.max_bs), USE_ASM=use_asm,
        USE_TIMER=use_asm and state.device_clock, num_warps=1)
    return state.live
