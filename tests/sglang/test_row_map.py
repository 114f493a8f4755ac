"""vcap's row map against SGLang 0.5.23's own layout functions (the real wheel, on the CPU): for
random batch mixes and paddings, each row SGLang hands the MoE holds the request and position
``engine_hook.row_map`` says, in attention-DP gathers, attention-TP slices (all-to-all backends)
and two-batch-overlap micro-batches. Rows travel through SGLang's code as ``code + 1`` in a float
tensor, so SGLang's zero padding reads back as ``PAD``."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vcap.engine_hook import row_map
from vcap.engine_hook.row_map import PAD

SEEDS = range(12)


def _as_rows(codes):
    return (codes + 1).to(torch.float32)[:, None].contiguous()


def _as_codes(rows):
    return rows[:, 0].round().to(torch.int32) - 1


def _dp_batch(rng, dp_size, attn_tp_size, stride):
    """Per DP rank: (requests, padded token count) as SGLang's prepare_mlp_sync_batch pads them:
    a graph bucket per rank, ``ceil_align`` to attention TP, then MAX_LEN (all the max) or SUM_LEN."""
    bs = [int(b) for b in rng.integers(0, 7, dp_size)]
    padded = [(b + int(rng.integers(0, 3))) * stride for b in bs]
    padded = [-(-n // attn_tp_size) * attn_tp_size for n in padded]
    if rng.random() < 0.5:
        padded = [max(padded)] * dp_size
    return bs, padded


def _publish_parallel(monkeypatch, module, **fields):
    parallel = SimpleNamespace(**{"attn_cp_size": 1, "attn_cp_rank": 0, "attn_tp_rank": 0, "attn_tp_size": 1,
                                  **fields})
    monkeypatch.setattr(module, "get_parallel", lambda: parallel)
    return parallel


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_dp_gather_puts_each_rank_where_the_row_map_says(monkeypatch, seed):
    """``dp_attention._dp_gather_via_all_reduce`` (SUM_LEN, and the layout MAX_LEN gathers too):
    each DP rank writes its rows at ``get_dp_local_info``'s offset of a zeroed buffer, then the sum."""
    import sglang.srt.layers.dp_attention as dp_attention
    rng = np.random.default_rng(seed)
    dp_size, stride = int(rng.integers(1, 5)), int(rng.integers(2, 9))
    max_bs = 8
    bs, padded = _dp_batch(rng, dp_size, 1, stride)
    flags = SimpleNamespace(dp=SimpleNamespace(scoped_gather_slot=None, use_world_group_for_gather=False,
                                               joiner_skip_all_gather=False))
    monkeypatch.setattr(dp_attention, "get_flags", lambda: flags)
    monkeypatch.setattr(dp_attention, "memcpy_func", dp_attention.memcpy_cpu)
    monkeypatch.setattr(dp_attention, "tensor_model_parallel_all_reduce", lambda t: t)
    locals_ = [row_map.verify_rows(padded[d], bs[d], stride, dp_rank=d, max_bs=max_bs) for d in range(dp_size)]
    total = torch.zeros(sum(padded), 1)
    for d in range(dp_size):
        _publish_parallel(monkeypatch, dp_attention, attn_dp_size=dp_size, attn_dp_rank=d, tp_size=dp_size)
        batch = SimpleNamespace(dp_local_start_pos=None, global_num_tokens_gpu=torch.tensor(padded),
                                global_num_tokens_cpu=padded, dp_padding_mode=None)
        gathered = torch.empty(sum(padded), 1)
        dp_attention._dp_gather_via_all_reduce(gathered, _as_rows(locals_[d]), batch, is_partial=True)
        total += gathered  # the all-reduce
    want = _as_codes(total)
    assert torch.equal(row_map.dp_gathered(locals_, padded), want)
    dp, request, position = row_map.decode(want, stride, max_bs)
    for d in range(dp_size):  # every real row of every rank, once
        mine = (dp == d).nonzero().flatten()
        assert len(mine) == bs[d] * stride
        assert torch.equal(request[mine] * stride + position[mine], torch.arange(bs[d] * stride))


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_dp_max_len_all_gather_with_attention_tp_matches(monkeypatch, seed):
    """``_dp_gather_via_all_gather`` with attention TP: a reduce-scatter over attention TP, then an
    all-gather over the TP group (rank = dp * attn_tp + attn_tp_rank): the collectives are stand-ins
    that do what NCCL's do, the rest is SGLang's."""
    import sglang.srt.layers.dp_attention as dp_attention
    rng = np.random.default_rng(100 + seed)
    dp_size, attn_tp_size, stride, max_bs = int(rng.integers(1, 4)), int(rng.integers(1, 4)), \
        int(rng.integers(2, 9)), 8
    bs, padded = _dp_batch(rng, dp_size, attn_tp_size, stride)
    padded = [max(padded)] * dp_size  # MAX_LEN
    flags = SimpleNamespace(dp=SimpleNamespace(scoped_gather_slot=None, use_world_group_for_gather=False,
                                               joiner_skip_all_gather=False))
    monkeypatch.setattr(dp_attention, "get_flags", lambda: flags)
    locals_ = [row_map.verify_rows(padded[d], bs[d], stride, dp_rank=d, max_bs=max_bs) for d in range(dp_size)]
    sent = {}
    for d in range(dp_size):
        for t in range(attn_tp_size):
            rank = d * attn_tp_size + t
            # the sum over attention TP of rank 0's rows and the others' zeros (replicate), sliced
            full = _as_rows(locals_[d])
            attn_tp_group = SimpleNamespace(reduce_scatter_tensor=lambda out, inp, t=t, full=full: out.copy_(
                full.tensor_split(attn_tp_size)[t]))
            tp_group = SimpleNamespace(all_gather_into_tensor=lambda out, inp, rank=rank: sent.update(
                {rank: inp.clone()}))
            _publish_parallel(monkeypatch, dp_attention, attn_dp_size=dp_size, attn_dp_rank=d,
                              tp_size=dp_size * attn_tp_size, attn_tp_size=attn_tp_size, attn_tp_rank=t,
                              attn_tp_group=attn_tp_group, tp_group=tp_group)
            local = _as_rows(locals_[d])
            dp_attention._dp_gather_via_all_gather(torch.empty(sum(padded), 1), local, SimpleNamespace(),
                                                   is_partial=False)
    gathered = torch.cat([sent[r] for r in range(dp_size * attn_tp_size)])  # all_gather_into_tensor
    assert torch.equal(row_map.dp_gathered(locals_, padded), _as_codes(gathered))


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_tp_slices_under_all_to_all_match_sglangs_tp_slice(monkeypatch, seed):
    """``layer_boundary.ops.tp_slice`` / ``attn_tp_reduce_scatter`` (``tensor_split``), and the
    slice bounds ``forward_batch_info._attn_tp_local_shard_bounds`` gives the padded-row count."""
    import sglang.srt.layers.layer_boundary.ops as ops
    import sglang.srt.model_executor.forward_batch_info as forward_batch_info
    rng = np.random.default_rng(200 + seed)
    attn_tp_size, stride, bs = int(rng.integers(1, 5)), int(rng.integers(2, 9)), int(rng.integers(0, 9))
    num_tokens = -(-(bs + int(rng.integers(0, 3))) * stride // attn_tp_size) * attn_tp_size
    codes = row_map.verify_rows(num_tokens, bs, stride)
    seen = []
    for t in range(attn_tp_size):
        parallel = _publish_parallel(monkeypatch, ops, tp_size=attn_tp_size, tp_rank=t, attn_tp_size=attn_tp_size,
                                     attn_tp_rank=t)
        monkeypatch.setattr(ops, "attn_tp_reduce_scatter_tensor", lambda out, inp: None)
        monkeypatch.setattr(forward_batch_info, "get_parallel", lambda parallel=parallel: parallel)
        sliced, _ = ops.tp_slice(_as_rows(codes), None)
        mine = row_map.attn_tp_slice(codes, attn_tp_size, t)
        assert torch.equal(mine, _as_codes(sliced))
        assert torch.equal(mine, _as_codes(ops.attn_tp_reduce_scatter(_as_rows(codes))))
        width, offset = forward_batch_info._attn_tp_local_shard_bounds(num_tokens, sharded=True)
        assert torch.equal(mine, codes[offset:offset + width])
        seen.append(mine)
    assert torch.equal(torch.cat(seen), codes)  # every row on exactly one attention-TP rank


@pytest.mark.parametrize("seed", SEEDS)
def test_two_batch_overlap_children_match_sglangs_split_and_filter(monkeypatch, seed):
    """``compute_split_indices_for_cuda_graph_replay`` (half the requests) and
    ``_model_forward_filter_inputs`` (the child's token range, zero-padded to ``tbo_padded_len``),
    then an attention-TP slice of the child under an all-to-all backend."""
    from sglang.srt.batch_overlap import two_batch_overlap as tbo
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    rng = np.random.default_rng(300 + seed)
    attn_tp_size, stride, bs = int(rng.integers(1, 4)), int(rng.integers(2, 9)), int(rng.integers(0, 12))
    num_tokens = bs * stride
    codes = row_map.verify_rows(num_tokens, bs, stride)
    split_seq, split_token = tbo.compute_split_indices_for_cuda_graph_replay(
        ForwardMode.TARGET_VERIFY, num_tokens, SimpleNamespace(draft_token_num=stride))
    children = row_map.tbo_split(num_tokens, stride, attn_tp_size)
    assert [r for r, _ in children] == [(0, split_token), (split_token, num_tokens)]
    assert split_token == split_seq * stride
    rebuilt = []
    for index, (token_range, padded_len) in enumerate(children):
        child = SimpleNamespace(tbo_parent_token_range=token_range, tbo_padded_len=padded_len)
        rows = _as_rows(codes)
        out = tbo._model_forward_filter_inputs(hidden_states=rows, residual=None, positions=rows[:, 0],
                                               output_forward_batch=child, tbo_subbatch_index=index)
        mine = row_map.micro_batch(codes, token_range, padded_len)
        assert torch.equal(mine, _as_codes(out["hidden_states"]))
        assert padded_len % attn_tp_size == 0
        for t in range(attn_tp_size):
            sliced = row_map.attn_tp_slice(mine, attn_tp_size, t)
            assert torch.equal(sliced, _as_codes(out["hidden_states"].tensor_split(attn_tp_size)[t]))
        rebuilt.append(mine[mine != PAD])
    assert torch.equal(torch.cat(rebuilt), codes[codes != PAD])


def test_live_table_holds_each_ranks_own_decision():
    own = torch.tensor([2, 3, 1], dtype=torch.int32)
    conservative = row_map.live_table(own, 1, 3, stride=4)
    assert conservative.view(3, 3).tolist() == [[4, 4, 4], [2, 3, 1], [4, 4, 4]]
    gathered = torch.tensor([[1, 1, 2], [9, 9, 9], [3, 4, 1]], dtype=torch.int32)
    assert row_map.live_table(own, 1, 3, 4, gathered=gathered).view(3, 3).tolist() == [[1, 1, 2], [2, 3, 1],
                                                                                        [3, 4, 1]]
