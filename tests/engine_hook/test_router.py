"""The router kernel against a plain PyTorch grouped top-k (SGLang's ``biased_grouped_topk``
semantics, lowest id first on ties) and against ``reference.remap_dead_rows``."""
import numpy as np
import pytest
import torch

from vcap.engine_hook import reference
from vcap.engine_hook.router import route


def torch_grouped_topk(logits, bias, topk, groups, topk_group, scale=1.0, apply_scale=False):
    scores = logits.float().sigmoid()
    biased = scores + bias.float()
    rows, experts = biased.shape
    grouped = biased.view(rows, groups, experts // groups)
    group_scores = grouped.topk(min(2, experts // groups), dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    mask = mask[:, :, None].expand_as(grouped).reshape(rows, experts)
    ids = biased.masked_fill(~mask, float("-inf")).topk(topk, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True)
    if apply_scale:
        weights = weights * scale
    return weights, ids.to(torch.int32)


def dead_rows(live, stride, rows):
    return torch.from_numpy(reference.dead_row_mask(live.cpu().numpy(), stride, rows))


SHAPES = [  # (requests, stride, experts, groups, topk_group, topk)
    (4, 4, 64, 4, 2, 6),     # powers of two
    (3, 6, 96, 3, 2, 6),     # non-powers of two (BLOCK_N 128)
    (1, 3, 17, 1, 1, 5),     # tiny / prime, ungrouped
]


@pytest.mark.parametrize("requests,stride,experts,groups,topk_group,topk", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-6, 1e-5)])
def test_matches_torch_grouped_topk(device, requests, stride, experts, groups, topk_group, topk, dtype, atol, rtol):
    rows = requests * stride
    logits = torch.randn(rows, experts, device=device, dtype=dtype)
    bias = 0.1 * torch.randn(experts, device=device)
    weights, ids = route(logits, bias, topk, num_expert_group=groups, topk_group=topk_group,
                         routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True)
    want_w, want_ids = torch_grouped_topk(logits, bias, topk, groups, topk_group, 2.5, True)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("requests,stride,experts,groups,topk_group,topk", SHAPES)
@pytest.mark.parametrize("strategy", ["drop", "anchor"])
def test_dead_rows_follow_the_reference_rule(device, requests, stride, experts, groups, topk_group, topk, strategy):
    rows = requests * stride
    logits = torch.randn(rows, experts, device=device)
    bias = 0.1 * torch.randn(experts, device=device)
    max_bs = requests + 2  # the buffer is sized from the engine's max batch, not from the step
    live = torch.ones(max_bs, dtype=torch.int32, device=device)
    live[:requests] = torch.randint(1, stride + 1, (requests,), device=device, dtype=torch.int32)
    all_w, all_ids = route(logits, bias, topk, num_expert_group=groups, topk_group=topk_group)
    packed = torch.empty(rows, topk, dtype=torch.int32, device=device)
    got_w, got_ids = route(logits, bias, topk, num_expert_group=groups, topk_group=topk_group, live=live,
                           stride=stride, strategy=strategy, packed_out=packed)
    want_ids, want_w = reference.remap_dead_rows(all_ids.cpu().numpy(), all_w.cpu().numpy(),
                                                 live[:requests].cpu().numpy(), stride, strategy)
    np.testing.assert_array_equal(got_ids.cpu().numpy(), want_ids)
    np.testing.assert_array_equal(got_w.cpu().numpy(), want_w)
    bits = (got_w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
    packed, bits, got_ids = packed.cpu().numpy(), bits.cpu().numpy(), got_ids.cpu().numpy()
    np.testing.assert_array_equal(packed >> 16, got_ids)
    # the interpreter's float32 -> bf16 cast may round the other way (the GPU's is RNE)
    assert np.abs((packed & 0xFFFF) - bits).max() <= (0 if device == "cuda" else 1)


def test_expert_bits_count_all_and_live_rows_of_real_requests(device):
    stride, requests, experts = 4, 3, 64
    logits = torch.randn(requests * stride, experts, device=device)
    bias = torch.zeros(experts, device=device)
    live = torch.tensor([2, 4, 1], dtype=torch.int32, device=device)
    info = torch.tensor([0, 0, 0, 2, 1, 0, 0, 0], dtype=torch.int32, device=device)  # bs 2, sampled
    bits = torch.zeros(2, 2, dtype=torch.int32, device=device)
    _, all_ids = route(logits, bias, 6, num_expert_group=4, topk_group=2)
    route(logits, bias, 6, num_expert_group=4, topk_group=2, live=live, stride=stride, info=info, expert_bits=bits)
    count = lambda words: sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in words)  # noqa: E731
    ids = all_ids.cpu().numpy()
    dead = reference.dead_row_mask(live[:2].cpu().numpy(), stride, 2 * stride)
    assert count(bits[0].cpu()) == reference.distinct_experts(ids[:8])
    assert count(bits[1].cpu()) == reference.distinct_experts(ids[:8][~dead])


def test_bad_input_is_refused(device):
    logits = torch.randn(6, 16, device=device)
    with pytest.raises(ValueError, match="strategy"):
        route(logits, torch.zeros(16, device=device), 2, strategy="keep")
    with pytest.raises(ValueError, match="grouping"):
        route(logits, torch.zeros(16, device=device), 2, num_expert_group=3)
    with pytest.raises(ValueError, match="bias"):
        route(logits, torch.zeros(15, device=device), 2)


def _row_map_reference(codes, table, stride, all_ids, all_w, strategy):
    """Row by row, in plain numpy: code -> (slot, position); dead iff position >= table[slot]."""
    ids, w = all_ids.copy(), all_w.copy()
    for row, code in enumerate(codes):
        if code < 0:
            continue
        slot, position = divmod(int(code), stride)
        if position < table[slot]:
            continue
        if strategy == "drop":
            ids[row], w[row] = -1, 0.0
        elif row >= position:  # anchor: the request's anchor row, when this input holds it
            ids[row], w[row] = all_ids[row - position], all_w[row - position]
    return ids, w


@pytest.mark.parametrize("requests,stride,experts,groups,topk_group,topk", SHAPES)
@pytest.mark.parametrize("strategy", ["drop", "anchor"])
def test_row_codes_of_the_plain_layout_are_bitwise_the_stride_rule(device, requests, stride, experts, groups,
                                                                   topk_group, topk, strategy):
    from vcap.engine_hook.row_map import verify_rows
    rows = requests * stride
    logits = torch.randn(rows, experts, device=device)
    bias = 0.1 * torch.randn(experts, device=device)
    live = torch.randint(1, stride + 1, (requests + 2,), device=device, dtype=torch.int32)
    options = dict(num_expert_group=groups, topk_group=topk_group, live=live, stride=stride, strategy=strategy)
    want_w, want_ids = route(logits, bias, topk, **options)
    codes = verify_rows(rows, requests, stride, device=device)
    got_w, got_ids = route(logits, bias, topk, row_codes=codes, **options)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strategy", ["drop", "anchor"])
def test_row_codes_route_any_layout_by_its_map(device, seed, strategy):
    """Rows in an arbitrary order with padding (what a gathered or sliced MoE input holds)."""
    rng = np.random.default_rng(seed)
    stride, dp_size, max_bs, experts, topk = int(rng.integers(2, 7)), 3, 5, 32, 4
    table = rng.integers(1, stride + 1, dp_size * max_bs).astype(np.int32)
    real = rng.choice(dp_size * max_bs * stride, size=int(rng.integers(5, 40)), replace=False)
    codes = np.concatenate([real, np.full(int(rng.integers(0, 6)), -1)]).astype(np.int32)
    start = int(rng.integers(0, len(codes)))
    codes = np.concatenate([codes[start:], codes[:start]])  # the map need not start at a request
    logits = torch.randn(len(codes), experts, device=device)
    bias = 0.1 * torch.randn(experts, device=device)
    all_w, all_ids = route(logits, bias, topk)
    got_w, got_ids = route(logits, bias, topk, live=torch.as_tensor(table, device=device), stride=stride,
                           strategy=strategy, row_codes=torch.as_tensor(codes, device=device))
    want_ids, want_w = _row_map_reference(codes, table, stride, all_ids.cpu().numpy(), all_w.cpu().numpy(),
                                          strategy)
    np.testing.assert_array_equal(got_ids.cpu().numpy(), want_ids)
    np.testing.assert_array_equal(got_w.cpu().numpy(), want_w)


def test_row_codes_must_match_the_rows(device):
    logits = torch.randn(6, 16, device=device)
    live = torch.ones(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="row_codes"):
        route(logits, torch.zeros(16, device=device), 2, live=live, stride=3,
              row_codes=torch.zeros(5, dtype=torch.int32, device=device))


@pytest.mark.parametrize("strategy", ["drop", "anchor"])
def test_fallback_gate_path_remaps_dead_rows_by_the_same_rule(strategy, monkeypatch):
    """Gate options vcap's router lacks go through SGLang's gate and then ``_remap_after``: it
    follows VCAP_DEAD_ROWS as the router does (under ``anchor`` it dropped, giving -1 to a
    backend chosen because it cannot take -1; found by an outside review)."""
    from types import SimpleNamespace

    from vcap.engine_hook import sglang_hooks
    monkeypatch.setenv(sglang_hooks.ENV_DEAD_ROWS, strategy)
    requests, stride, topk = 5, 4, 3
    live = torch.randint(1, stride + 1, (requests + 2,), dtype=torch.int32)
    state = SimpleNamespace(stride=stride, max_bs=requests + 2, live=live)
    ids = torch.randint(0, 64, (requests * stride, topk), dtype=torch.int32)
    weights = torch.rand(requests * stride, topk)
    packed = torch.randint(0, 1 << 30, (requests * stride, topk), dtype=torch.int32)
    want_ids, want_w = reference.remap_dead_rows(ids.numpy(), weights.numpy(), live[:requests].numpy(), stride, strategy)
    want_packed = reference.remap_dead_rows(packed.numpy(), weights.numpy(), live[:requests].numpy(), stride, strategy)[0]
    if strategy == "drop":
        want_packed[want_ids == -1] = -65536
    got_w, got_ids = sglang_hooks._remap_after(weights, ids, packed, state)
    np.testing.assert_array_equal(got_ids.numpy(), want_ids)
    np.testing.assert_array_equal(got_w.numpy(), want_w)
    np.testing.assert_array_equal(packed.numpy(), want_packed)
