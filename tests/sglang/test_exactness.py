"""Exactness through SGLang 0.5.23's own accept code on the CPU (its torch paths), with vcap's
patches applied by SGLang's hook registry: a capped verify commits exactly the tokens of a verify
with k drafts, and dead rows are never committed.

The logits, drafts and confidences are random (synthetic); the live lengths come from vcap's
hook reading a real segment the way the engine does, so they follow a real policy.
"""

import numpy as np
import pytest
import torch

from vcap.engine_hook import reference, sglang_hooks
from vcap.policy import Bucket, Policy
from vcap.segment import (FLAG_GUARD_VIOLATION, STATUS_GUARD_TRIPPED, STATUS_GUARD_VIOLATIONS, RingReader, Segment,
                          SegmentConfig)

from tests.utils import random_policy

STRIDE, MAX_BS, VOCAB = 6, 16, 48


@pytest.fixture
def engine(patched, segment_name):
    """TP rank 0 of an engine: a VerifyHook on a real segment (CPU tensors, no CUDA)."""
    from vcap.engine_hook.hook import VerifyHook
    segment = Segment.create(segment_name, SegmentConfig(stride=STRIDE, max_bs=MAX_BS, num_moe_layers=2))
    hook = VerifyHook(segment, device="cpu")
    state = sglang_hooks.engine_state
    saved = dict(vars(state))
    state.hook, state.live, state.stride, state.max_bs, state.group = hook, hook.live, STRIDE, MAX_BS, None
    yield segment, hook, Segment.attach(segment_name)
    vars(state).update(saved)
    hook.close()
    segment.unlink()


def _greedy_accept(target_tokens: np.ndarray, draft_tokens: np.ndarray, live: np.ndarray) -> list[np.ndarray]:
    """Greedy verify with a cutoff, in plain numpy: ``target_tokens [bs, stride]`` are the target's
    argmax at each verify row, ``draft_tokens [bs, stride-1]`` the drafts. The committed tokens of
    each request: its accepted drafts (at most ``L - 1``), then the target's token at the first
    rejected or cut position (the bonus token)."""
    matches = target_tokens[:, :-1] == draft_tokens
    accepted = reference.cap_accepted(np.cumprod(matches, axis=1).sum(axis=1), live)
    return [np.append(draft_tokens[b, :a], target_tokens[b, a]) for b, a in enumerate(accepted)]


def _drafts_matching(target_argmax, rng):
    """Drafts that agree with the target for a random prefix of each request, then differ."""
    bs = target_argmax.shape[0]
    drafts = target_argmax[:, :STRIDE - 1].clone()
    agree = torch.as_tensor(rng.integers(0, STRIDE, bs))
    for b in range(bs):
        if agree[b] < STRIDE - 1:
            drafts[b, agree[b]] = (target_argmax[b, agree[b]] + 1) % VOCAB
    return drafts


def test_capped_greedy_accept_equals_a_verify_with_k_drafts(engine):
    from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy
    from sglang.srt.speculative.dspark_components import dspark_verify
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult, DraftProposal

    _, hook, sidecar = engine
    rng = np.random.default_rng(3)
    capped_requests = 0
    for generation in range(1, 41):
        policy = random_policy(rng, STRIDE)
        sidecar.write_policy(policy, generation, "manual")
        sidecar.heartbeat[0] += 1
        bs = int(rng.integers(1, MAX_BS + 1))
        confidence = torch.as_tensor(rng.random((bs, STRIDE - 1)), dtype=torch.float32)
        logits = torch.randn(bs * STRIDE, VOCAB)
        target_argmax = logits.argmax(-1).view(bs, STRIDE)
        drafts = _drafts_matching(target_argmax, rng)
        candidates = torch.cat([torch.randint(0, VOCAB, (bs, 1)), drafts], dim=1)
        block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None,
                                 greedy_mask=torch.ones(bs, dtype=torch.bool),
                                 temperatures=torch.ones(bs, 1), greedy_draft=True)
        proposal = DraftProposal(draft_block_ids=candidates, draft_block=block, confidence=confidence)

        sglang_hooks.after_propose(proposal, None, bs=bs)  # what the patched propose runs
        live = hook.live[:bs].clone()
        expected_live = reference.live_lengths(confidence.numpy(), policy, bs, STRIDE)
        assert live.tolist() == expected_live.tolist(), (generation, policy)

        # SGLang's accept, called as the eager path calls it: without a cutoff
        correct_len, bonus, _ = dspark_verify.accept_draft_tokens(
            candidates=candidates, target_logits=logits, draft_block=block, sampling_info=None,
            draft_input=None, gamma=STRIDE - 1, verify_num_draft_tokens=STRIDE)
        for b in range(bs):
            length = int(live[b])
            alone_len, alone_bonus, _ = AcceptGreedy.execute(
                candidates=candidates[b:b + 1, :length].contiguous(),
                target_logits=logits[b * STRIDE:b * STRIDE + length], verify_num_draft_tokens=length)
            assert int(correct_len[b]) == int(alone_len[0]) <= length - 1, (generation, b, length)
            assert int(bonus[b]) == int(alone_bonus[0])
            committed = candidates[b, 1:1 + int(correct_len[b])].tolist() + [int(bonus[b])]
            assert committed == _greedy_accept(
                target_argmax[b:b + 1].numpy(), drafts[b:b + 1].numpy(), live[b:b + 1].numpy())[0].tolist()
            capped_requests += length < STRIDE
    assert capped_requests > 50  # the policies really cut


def test_an_accept_that_skips_the_cutoff_trips_the_guard(engine):
    """The accept path made to skip the cutoff on purpose (SGLang's original, unpatched):
    the device-side guard counts it and every later step runs with every row live."""
    from sglang.srt.speculative.dspark_components import dspark_verify
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult, DraftProposal

    segment, hook, sidecar = engine
    sidecar.write_policy(Policy("fixed", 1, (Bucket(1, 1, STRIDE - 1, (0.0,) * (STRIDE - 1)),)), 1, "manual")
    sidecar.heartbeat[0] += 1
    bs = 4
    logits = torch.randn(bs * STRIDE, VOCAB)
    drafts = logits.argmax(-1).view(bs, STRIDE)[:, :STRIDE - 1].clone()  # every draft right
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.long), drafts], dim=1)
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None, greedy_mask=torch.ones(bs, dtype=torch.bool),
                             temperatures=torch.ones(bs, 1), greedy_draft=True)
    confidence = torch.full((bs, STRIDE - 1), 0.9)
    proposal = DraftProposal(draft_block_ids=candidates, draft_block=block, confidence=confidence)
    sglang_hooks.after_propose(proposal, None, bs=bs)
    assert hook.live[:bs].tolist() == [2] * bs
    unpatched = dspark_verify.accept_draft_tokens.__wrapped__
    outs = type("AcceptOuts", (), {})()
    outs.correct_len, _, _ = unpatched(candidates=candidates, target_logits=logits, draft_block=block,
                                       sampling_info=None, draft_input=None, gamma=STRIDE - 1,
                                       verify_num_draft_tokens=STRIDE)
    assert outs.correct_len.tolist() == [STRIDE - 1] * bs  # more than L - 1 = 1
    sglang_hooks.after_accept(outs)
    sglang_hooks.after_propose(proposal, None, bs=bs)  # the next step
    hook.flush()
    assert segment.status_u32[STATUS_GUARD_TRIPPED] == 1 and segment.status_u64[STATUS_GUARD_VIOLATIONS] >= 1
    assert hook.live[:bs].tolist() == [STRIDE] * bs  # off for good
    assert sglang_hooks.engine_state.guard_reported


def test_the_record_carries_the_schedulers_queue(engine):
    """The queue length seen when the scheduler chose its batch reaches that step's record."""
    from types import SimpleNamespace

    segment, hook, _ = engine
    reader = RingReader(segment, 0)
    confidence = torch.full((2, STRIDE - 1), 0.9)
    proposal = SimpleNamespace(confidence=confidence, draft_block=SimpleNamespace(draft_tokens=torch.zeros(2, 5)))
    for queued in (3, 0, 17):
        sglang_hooks.after_next_batch(None, SimpleNamespace(waiting_queue=[None] * queued), None, None)
        sglang_hooks.after_propose(proposal, None, bs=2)
        sglang_hooks.after_accept(SimpleNamespace(correct_len=torch.zeros(2, dtype=torch.int32)))
    hook.flush()
    records = reader.read()
    assert [int(r["num_queued"]) for r in records] == [3, 0, 17]
    assert not (records["flags"] & FLAG_GUARD_VIOLATION).any()
