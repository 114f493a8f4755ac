"""Which request and draft position each MoE input row of a target verify holds, in the order
SGLang 0.5.23 hands rows to the MoE in each parallel layout.

A row is named by its *code*: ``slot * stride + position``, where ``slot = dp_rank * max_bs +
request`` indexes a live table laid out DP-rank-major (``[dp_size * max_bs]`` int32; one DP rank's
table is its ``live`` buffer) and ``position`` is the row's place in its request's verify block
(0 = anchor). ``PAD`` (-1) names a row that holds no request (graph or alignment padding): the
router leaves those to SGLang's own padding rules. The router's dead-row rule is then
``position >= live[slot]``, for any layout.

The layouts, each built from a DP rank's own rows (:func:`verify_rows`, request-major, padded to
the rank's token count) by SGLang's own steps:

- attention-TP slice under an all-to-all MoE backend (``layer_boundary`` ``tp_slice`` /
  ``attn_tp_reduce_scatter`` / ``move_rows``): ``rows.tensor_split(attn_tp_size)[attn_tp_rank]``
  (:func:`attn_tp_slice`);
- two-batch-overlap micro-batch (``two_batch_overlap._model_forward_filter_inputs``): the child's
  ``tbo_parent_token_range`` of the parent's rows, zero-padded to ``tbo_padded_len``
  (:func:`micro_batch`, :func:`tbo_split`);
- attention DP with a TP MoE (``dp_attention._dp_gather``): every DP rank's rows, the first
  ``global_num_tokens[d]`` of them, back to back in DP-rank order (:func:`dp_gathered`).

Everything here is torch on the rows' device with Python-int layout parameters, so it can run
inside CUDA-graph capture (no host copy) as well as on the CPU.
"""

import torch

__all__ = ["PAD", "verify_rows", "attn_tp_slice", "micro_batch", "tbo_split", "dp_gathered", "live_table",
           "decode"]

PAD = -1


def verify_rows(num_tokens: int, bs: int, stride: int, *, dp_rank: int = 0, max_bs: int = 0,
                device=None) -> torch.Tensor:
    """One DP rank's verify rows (``bs`` requests of ``stride`` rows, padded to ``num_tokens``)."""
    if stride < 1 or bs < 0 or num_tokens < 0:
        raise ValueError(f"bad verify shape: {num_tokens} tokens, {bs} requests, stride {stride}")
    if dp_rank and max_bs < bs:
        raise ValueError(f"max_bs {max_bs} must hold the {bs} requests of DP rank {dp_rank}")
    rows = torch.arange(num_tokens, dtype=torch.int32, device=device)
    codes = rows + dp_rank * max_bs * stride
    return torch.where(rows < bs * stride, codes, torch.full_like(codes, PAD))


def attn_tp_slice(codes: torch.Tensor, attn_tp_size: int, attn_tp_rank: int) -> torch.Tensor:
    """The rows the MoE of attention-TP rank ``attn_tp_rank`` gets under an all-to-all backend."""
    if not 0 <= attn_tp_rank < attn_tp_size:
        raise ValueError(f"attention-TP rank {attn_tp_rank} of {attn_tp_size}")
    return codes.tensor_split(attn_tp_size)[attn_tp_rank]


def micro_batch(codes: torch.Tensor, token_range: tuple[int, int], padded_len: int) -> torch.Tensor:
    """A two-batch-overlap child's rows: the parent's ``token_range``, padded to ``padded_len``."""
    start, end = token_range
    part = codes[start:end]
    if part.shape[0] == padded_len:
        return part
    out = torch.full((padded_len,), PAD, dtype=codes.dtype, device=codes.device)
    out[:part.shape[0]] = part
    return out


def tbo_split(num_tokens: int, stride: int, attn_tp_size: int) -> list[tuple[tuple[int, int], int]]:
    """``(token_range, padded_len)`` of both children of a verify batch (SGLang's split: half the
    requests, ``compute_split_seq_index`` / ``compute_split_token_index``)."""
    split = (num_tokens // stride) // 2 * stride
    children = []
    for start, end in ((0, split), (split, num_tokens)):
        padded = ((end - start - 1) // attn_tp_size + 1) * attn_tp_size if end > start else 0
        children.append(((start, end), padded))
    return children


def dp_gathered(codes_per_rank: list[torch.Tensor], global_num_tokens: list[int]) -> torch.Tensor:
    """The gathered MoE input of attention DP with a TP MoE: DP rank ``d``'s first
    ``global_num_tokens[d]`` rows at ``sum(global_num_tokens[:d])`` (MAX_LEN padding: all equal)."""
    if len(codes_per_rank) != len(global_num_tokens):
        raise ValueError(f"{len(codes_per_rank)} ranks of rows for {len(global_num_tokens)} token counts")
    blocks = []
    for codes, count in zip(codes_per_rank, global_num_tokens):
        block = codes[:count]
        if block.shape[0] < count:
            block = torch.cat([block, torch.full((count - block.shape[0],), PAD, dtype=codes.dtype,
                                                 device=codes.device)])
        blocks.append(block)
    return torch.cat(blocks)


def live_table(own_live: torch.Tensor, dp_rank: int, dp_size: int, stride: int,
               gathered: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``[dp_size * max_bs]`` live table a gathered MoE reads.

    This DP rank's slice is its own ``live``; another rank's is that rank's own decision when
    ``gathered`` (``[dp_size, max_bs]``, each row gathered from its owner) is given, else ``stride``
    (every row live). Both are exact: a row its owner keeps is kept by every rank; a row its owner
    drops may keep experts on the other ranks, and its output is never committed.
    """
    max_bs = own_live.shape[0]
    if out is None:
        out = torch.empty(dp_size * max_bs, dtype=torch.int32, device=own_live.device)
    table = out.view(dp_size, max_bs)
    if gathered is not None:
        table.copy_(gathered)
    else:
        table.fill_(stride)
    table[dp_rank].copy_(own_live)
    return out


def decode(codes: torch.Tensor, stride: int, max_bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dp_rank, request, position)`` per row; -1 in all three for a padding row."""
    pad = codes < 0
    slot = torch.div(codes, stride, rounding_mode="floor")
    fields = (torch.div(slot, max_bs, rounding_mode="floor"), slot % max_bs, codes % stride)
    return tuple(torch.where(pad, torch.full_like(f, PAD), f) for f in fields)
