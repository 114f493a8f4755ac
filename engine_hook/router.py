"""The MoE router with the dead-row rule folded in: DeepSeek-V3/V4 grouped top-k gating (the
semantics of SGLang's ``moe_fused_gate``: score function + correction bias for ranking,
``n_group``/``topk_group`` group selection by top-2 sums, top-k with the lowest id winning ties,
weights from the bias-free scores, renormalise, optional routed scaling) that also reads the
step's live lengths from a device buffer, so dead verify rows cost no launch of their own.

Dead rows (position ``r % stride >= live[r // stride]``) get id -1 and weight 0 (``drop``) or
the anchor row's ids and weights (``anchor``: the row is routed from the anchor's scores, so
the result is bitwise the anchor's). ``packed_out`` receives FlashInfer's routed-MoE form
``(id << 16) | bf16_bits(weight)`` (what SGLang's gate writes for ``packed_out``), dead rows
included. On sampled steps (``info[4]``) the kernel sets one bit per distinct expert of all
rows and of live rows in ``expert_bits`` (for the telemetry record).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .buffers import INFO_BS, INFO_SAMPLED

__all__ = ["route", "SCORING_FUNCS", "STRATEGIES"]

_INFO_BS, _INFO_SAMPLED = tl.constexpr(INFO_BS), tl.constexpr(INFO_SAMPLED)

SCORING_FUNCS = {"sigmoid": 0, "sqrtsoftplus": 1, "sqrtsoftplus_log1p": 2}
STRATEGIES = {"drop": 0, "anchor": 1}


@triton.jit
def _topk(scores, row_bias, offs_n, mask_n, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
          EXPERTS_PER_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, SCORING: tl.constexpr):
    if SCORING == 0:
        activated = tl.sigmoid(scores)
    elif SCORING == 1:
        # log1p(exp(-|x|)) written out, as the DeepSeek-V4 reference computes it
        z = tl.exp(-tl.abs(scores))
        u = 1.0 + z
        exact = u == 1.0
        log1p_z = tl.where(exact, z, z * tl.log(u) / tl.where(exact, 1.0, u - 1.0))
        activated = tl.sqrt(tl.maximum(scores, 0.0) + log1p_z)
    else:
        # DeepSeek-V4.1 (SGLang's SQRTSOFTPLUS_LOG1P): libm's exp/log1p and IEEE sqrt, not the fast ones
        softplus = tl.where(scores > 20.0, scores, libdevice.log1p(libdevice.exp(scores)))
        activated = libdevice.sqrt(softplus)
    biased = activated + row_bias
    biased = tl.where(mask_n[None, :], biased, -float("inf"))
    if SCORING == 2:  # V4.1 ranks NaN first (as torch.topk does); every other scoring ranks it last
        biased = tl.where(biased == biased, biased, float("inf"))
    else:
        biased = tl.where(biased == biased, biased, -1e30)
    if N_GROUP > 1:
        offs_g = tl.arange(0, BLOCK_G)
        group_of_n = offs_n // EXPERTS_PER_GROUP
        group_score = tl.full([BLOCK_M, BLOCK_G], -float("inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            vals = tl.where((group_of_n[None, :] == g) & mask_n[None, :], biased, -float("inf"))
            top1 = tl.max(vals, axis=1)[:, None]
            top2 = tl.max(tl.where(vals >= top1, -float("inf"), vals), axis=1)[:, None]
            group_score = tl.where(offs_g[None, :] == g, top1 + top2, group_score)
        keep = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in tl.static_range(TOPK_GROUP):
            gmax = tl.max(group_score, axis=1)[:, None]
            winner = tl.min(tl.where(group_score == gmax, offs_g[None, :], N_GROUP + 1), axis=1)[:, None]
            keep = tl.where(group_of_n[None, :] == winner, 1.0, keep)
            group_score = tl.where(offs_g[None, :] == winner, -float("inf"), group_score)
        biased = tl.where(keep > 0.0, biased, -float("inf"))
    offs_k = tl.arange(0, BLOCK_K)
    values = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    remaining = tl.broadcast_to(mask_n[None, :], (BLOCK_M, BLOCK_N))
    cur = biased
    for k in tl.static_range(K):
        best = tl.max(cur, axis=1)[:, None]
        lane = tl.where(remaining & (cur == best), offs_n[None, :], N + 1)
        win = tl.min(lane, axis=1)[:, None].to(tl.int32)
        win_value = tl.sum(tl.where(offs_n[None, :] == win, activated, 0.0), axis=1)[:, None]
        slot = offs_k[None, :] == k
        values = tl.where(slot, win_value, values)
        ids = tl.where(slot, win, ids)
        remaining = remaining & (offs_n[None, :] != win)
        cur = tl.where(remaining, cur, -float("inf"))
    return values, ids


@triton.jit
def _set_bits(bits_ptr, ids, mask):
    tl.atomic_or(bits_ptr + (ids >> 5), (1 << (ids & 31)).to(tl.int32), mask=mask & (ids >= 0))


@triton.jit
def _router_kernel(scores_ptr, bias_ptr, weights_ptr, ids_ptr, packed_ptr, live_ptr, info_ptr, bits_ptr, padding_ptr,
                   rows_ptr, M, scale, slot_base, stride_sm, stride_wm, stride_im, stride_pm,
                   N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   EXPERTS_PER_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, SCORING: tl.constexpr,
                   RENORMALIZE: tl.constexpr, APPLY_SCALE: tl.constexpr, HAS_LIVE: tl.constexpr,
                   STRIDE: tl.constexpr, MAX_BS: tl.constexpr, STRATEGY: tl.constexpr,
                   HAS_PACKED: tl.constexpr, HAS_BITS: tl.constexpr, NUM_WORDS: tl.constexpr,
                   HAS_PADDING: tl.constexpr, HAS_ROWS: tl.constexpr):
    # Longer than most: the gate, the dead-row rule and the expert bitmaps stay in one launch per
    # MoE layer, so the rule costs no launch of its own.
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dead = offs_m < 0
    src_m = offs_m
    own = mask_m
    if HAS_LIVE:
        if HAS_ROWS:  # a row map (engine_hook.row_map): code = slot * STRIDE + position, -1 = padding
            code = tl.load(rows_ptr + offs_m, mask=mask_m, other=-1)
            real = mask_m & (code >= 0)
            slot = tl.where(real, code // STRIDE, 0)
            position = tl.where(real, code % STRIDE, 0)
            live = tl.load(live_ptr + slot, mask=real & (slot < MAX_BS), other=STRIDE)
            dead = real & (position >= live)
            own = real & (slot >= slot_base)
            if STRATEGY == 1:  # the anchor must be a row of this input (not of an earlier slice)
                dead = dead & (offs_m >= position)
                src_m = tl.where(dead, offs_m - position, offs_m)
        else:
            request = offs_m // STRIDE
            live = tl.load(live_ptr + request, mask=mask_m & (request < MAX_BS), other=1)
            dead = mask_m & ((offs_m % STRIDE) >= live)
            if STRATEGY == 1:
                src_m = tl.where(dead, request * STRIDE, offs_m)
    padded = offs_m < 0
    if HAS_PADDING:  # SGLang's num_token_non_padded: rows past it are graph padding, id -1 / weight 0
        padded = mask_m & (offs_m >= tl.load(padding_ptr))
    mask2d = mask_m[:, None] & mask_n[None, :]
    scores = tl.load(scores_ptr + src_m.to(tl.int64)[:, None] * stride_sm + offs_n[None, :],
                     mask=mask2d, other=0.0).to(tl.float32)
    values, ids = _topk(scores, bias[None, :], offs_n, mask_n, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                        N_GROUP, TOPK_GROUP, EXPERTS_PER_GROUP, BLOCK_G, SCORING)
    mask_k = offs_k < K
    total = tl.sum(tl.where(mask_k[None, :], values, 0.0), axis=1)[:, None]
    if RENORMALIZE:
        values = values / tl.where(total > 0.0, total, 1.0)
    if APPLY_SCALE:
        values = values * scale
    if HAS_BITS:
        # sampled steps only (decided by the hook for the step); only the rows of real requests count
        sampled = tl.load(info_ptr + _INFO_SAMPLED)
        real_rows = M
        if HAS_LIVE:
            real_rows = tl.load(info_ptr + _INFO_BS) * STRIDE
        if HAS_ROWS:
            in_step = own & (slot < slot_base + tl.load(info_ptr + _INFO_BS))
        else:
            in_step = mask_m & (offs_m < real_rows)
        row_sampled = in_step & ((offs_m * 0 + sampled) != 0) & (padded == 0)
        own_ids = ids
        if HAS_LIVE:
            if STRATEGY == 1:
                own = tl.load(scores_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + offs_n[None, :],
                              mask=mask2d & row_sampled[:, None], other=0.0).to(tl.float32)
                _, own_ids = _topk(own, bias[None, :], offs_n, mask_n, N, K, BLOCK_M, BLOCK_N,
                                   BLOCK_K, N_GROUP, TOPK_GROUP, EXPERTS_PER_GROUP, BLOCK_G, SCORING)
        pair = row_sampled[:, None] & mask_k[None, :]
        _set_bits(bits_ptr, own_ids, pair)
        _set_bits(bits_ptr + NUM_WORDS, ids, pair & (dead == 0)[:, None])
    if HAS_LIVE:
        if STRATEGY == 0:
            values = tl.where(dead[:, None], 0.0, values)
            ids = tl.where(dead[:, None], -1, ids)
    if HAS_PADDING:
        values = tl.where(padded[:, None], 0.0, values)
        ids = tl.where(padded[:, None], -1, ids)
    store_mask = mask_m[:, None] & mask_k[None, :]
    tl.store(weights_ptr + offs_m.to(tl.int64)[:, None] * stride_wm + offs_k[None, :], values, mask=store_mask)
    tl.store(ids_ptr + offs_m.to(tl.int64)[:, None] * stride_im + offs_k[None, :], ids, mask=store_mask)
    if HAS_PACKED:
        weight_bits = values.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        packed = (ids << 16) | (weight_bits & 0xFFFF)
        tl.store(packed_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + offs_k[None, :], packed, mask=store_mask)


def _check_inputs(scores, bias, topk, num_expert_group, topk_group, scoring_func, live, stride, strategy,
                  packed_out, info, expert_bits, num_token_non_padded, row_codes) -> None:
    if scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(f"scores must be [M, E] with unit column stride, got {tuple(scores.shape)} {scores.stride()}")
    if scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"scores must be float32/float16/bfloat16, got {scores.dtype}")
    num_rows, num_experts = scores.shape
    if bias.shape != (num_experts,) or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous [{num_experts}] vector, got {tuple(bias.shape)}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {sorted(SCORING_FUNCS)}, got {scoring_func!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'drop' or 'anchor', got {strategy!r}")
    if num_expert_group < 1 or num_experts % num_expert_group or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"bad grouping: {num_experts} experts, {num_expert_group} groups, topk_group {topk_group}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in 1..{num_experts}, got {topk}")
    if live is not None and (live.dtype != torch.int32 or live.dim() != 1 or stride < 2):
        raise ValueError("live must be an int32 [max_bs] buffer and stride >= 2")
    if expert_bits is not None and (info is None or expert_bits.dtype != torch.int32
                                    or expert_bits.shape != (2, (num_experts + 31) // 32)
                                    or not expert_bits.is_contiguous()):
        raise ValueError(f"expert_bits must be contiguous int32 [2, {(num_experts + 31) // 32}] and needs info")
    if num_token_non_padded is not None and (num_token_non_padded.numel() != 1
                                             or num_token_non_padded.dtype not in (torch.int32, torch.int64)):
        raise ValueError("num_token_non_padded must be a one-element int32/int64 tensor")
    if row_codes is not None and (live is None or row_codes.dtype != torch.int32 or row_codes.shape != (num_rows,)
                                  or not row_codes.is_contiguous()):
        raise ValueError(f"row_codes must be a contiguous int32 [{num_rows}] vector and needs live")
    if packed_out is not None and (packed_out.dtype != torch.int32 or packed_out.shape != (num_rows, topk)
                                   or packed_out.stride(1) != 1):
        raise ValueError(f"packed_out must be int32 [{num_rows}, {topk}] with unit column stride")


def route(scores: torch.Tensor, bias: torch.Tensor, topk: int, *, num_expert_group: int = 1,
          topk_group: int = 1, scoring_func: str = "sigmoid", renormalize: bool = True,
          routed_scaling_factor: float = 1.0, apply_routed_scaling_factor_on_output: bool = False,
          live: torch.Tensor | None = None, stride: int = 0, strategy: str = "drop",
          packed_out: torch.Tensor | None = None, info: torch.Tensor | None = None,
          expert_bits: torch.Tensor | None = None, num_token_non_padded: torch.Tensor | None = None,
          row_codes: torch.Tensor | None = None, slot_base: int = 0,
          out: tuple[torch.Tensor, torch.Tensor] | None = None,
          block_m: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k routing of ``scores [M, E]``; returns ``(weights f32 [M, topk], ids i32 [M, topk])``.

    With ``live`` (int32 ``[max_bs]``, L per request) and ``stride``, rows are verify rows,
    request-major, and dead rows follow ``strategy``. ``expert_bits`` (int32 ``[2, ceil(E/32)]``,
    all rows then live rows) needs ``info`` (the step info :func:`kernels.begin_step` writes).
    ``num_token_non_padded`` (a device scalar, SGLang's) marks the rows past it as padding:
    id -1 and weight 0, as SGLang's gate writes them. ``row_codes`` (int32 ``[M]``,
    :mod:`.row_map`) names each row's live-table slot and position instead of ``row // stride``;
    ``live`` is then the live table and ``slot_base`` this rank's first slot (for ``expert_bits``).

    Raises:
        ValueError: on a shape, dtype, stride or option the kernel does not take.
    """
    _check_inputs(scores, bias, topk, num_expert_group, topk_group, scoring_func, live, stride, strategy,
                  packed_out, info, expert_bits, num_token_non_padded, row_codes)
    num_rows, num_experts = scores.shape
    if out is None:
        weights = torch.empty((num_rows, topk), dtype=torch.float32, device=scores.device)
        ids = torch.empty((num_rows, topk), dtype=torch.int32, device=scores.device)
    else:
        weights, ids = out
        if weights.shape != (num_rows, topk) or ids.shape != (num_rows, topk) or weights.stride(1) != 1 \
                or ids.stride(1) != 1 or weights.dtype != torch.float32 or ids.dtype != torch.int32:
            raise ValueError("out must be (float32, int32) [M, topk] with unit column stride")
    if num_rows == 0:
        return weights, ids
    block_n = triton.next_power_of_2(num_experts)
    block_m = block_m or max(1, min(4, 256 // block_n))
    dummy = ids
    _router_kernel[(triton.cdiv(num_rows, block_m),)](
        scores, bias, weights, ids, packed_out if packed_out is not None else dummy,
        live if live is not None else dummy, info if info is not None else dummy,
        expert_bits if expert_bits is not None else dummy,
        num_token_non_padded if num_token_non_padded is not None else dummy,
        row_codes if row_codes is not None else dummy,
        num_rows, float(routed_scaling_factor), int(slot_base), scores.stride(0), weights.stride(0), ids.stride(0),
        packed_out.stride(0) if packed_out is not None else 0,
        N=num_experts, K=topk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(topk),
        N_GROUP=num_expert_group, TOPK_GROUP=topk_group, EXPERTS_PER_GROUP=num_experts // num_expert_group,
        BLOCK_G=triton.next_power_of_2(num_expert_group), SCORING=SCORING_FUNCS[scoring_func],
        RENORMALIZE=bool(renormalize), APPLY_SCALE=bool(apply_routed_scaling_factor_on_output),
        HAS_LIVE=live is not None, STRIDE=max(stride, 2), MAX_BS=live.numel() if live is not None else 1,
        STRATEGY=STRATEGIES[strategy], HAS_PACKED=packed_out is not None, HAS_BITS=expert_bits is not None,
        NUM_WORDS=(num_experts + 31) // 32, HAS_PADDING=num_token_non_padded is not None,
        HAS_ROWS=row_codes is not None,
        num_warps=num_warps or (1 if block_n <= 512 else 4))
    return weights, ids
