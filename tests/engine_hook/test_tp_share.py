"""Rank 0's live lengths through mapped inboxes (``engine_hook/tp_share.py``).

The kernels against their torch reference on fresh random inputs (several peers in one process),
the failure paths (no publish, a flag of another step), then two processes of one TP group
through the production function ``decide_live_lengths``: rank 0 runs the real hook with a new
random policy written into its segment before every step (as the sidecar would), rank 1 only
receives, and nothing else keeps the two in step (a TP verify's all-reduces would): every step
both must hold rank 0's lengths, and rank 0's must be the reference rule's.

Two GPUs: one each, the inbox mapped over CUDA IPC (what SGLang runs). One GPU: both ranks on it,
still CUDA IPC between two processes. No GPU: shared files, the kernels under Triton's
interpreter (CI). The group is a stand-in for SGLang's GroupCoordinator over torch.distributed
(gloo): ``rank_in_group``, ``world_size``, ``all_gather_object``, ``broadcast``.
"""

import os
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vcap.engine_hook.tp_share import INBOX_HEAD, LiveShare, publish_reference, receive_reference  # noqa: E402

from tests.utils import random_policy  # noqa: E402

STRIDE = 6


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inboxes(count: int, max_bs: int, device) -> list:
    return [torch.zeros(INBOX_HEAD + 2 * max_bs, dtype=torch.int32, device=device) for _ in range(count)]


def test_publish_and_receive_match_the_reference():
    rng = np.random.default_rng()
    device = _device()
    for _ in range(3):
        max_bs, num_peers = int(rng.integers(1, 300)), int(rng.integers(1, 8))
        kernel_inboxes, reference_inboxes = _inboxes(num_peers, max_bs, device), _inboxes(num_peers, max_bs, device)
        publisher = LiveShare(0, torch.zeros(1, dtype=torch.int32, device=device), kernel_inboxes, max_bs, STRIDE)
        receivers = [LiveShare(r + 1, inbox, [], max_bs, STRIDE, max_spins=4) for r, inbox in enumerate(kernel_inboxes)]
        reference_epoch = torch.zeros(1, dtype=torch.int32, device=device)
        reference_errors = torch.zeros(1, dtype=torch.int32, device=device)
        reference_states = [(torch.zeros(1, dtype=torch.int32, device=device),
                             torch.zeros(1, dtype=torch.int32, device=device)) for _ in range(num_peers)]
        for _ in range(int(rng.integers(1, 5))):
            live = torch.as_tensor(rng.integers(1, STRIDE + 1, max_bs), dtype=torch.int32, device=device)
            publisher.publish(live)
            publish_reference(live, reference_epoch, reference_inboxes, reference_errors)
            for got, want in zip(kernel_inboxes, reference_inboxes):
                assert torch.equal(got, want)
            assert publisher.error_count() == 0 == int(reference_errors.item())
            for receiver, inbox, (epoch, errors) in zip(receivers, reference_inboxes, reference_states):
                got = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
                want = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
                receiver.receive(got)
                receive_reference(inbox, want, epoch, errors, STRIDE)
                assert torch.equal(got, want) and torch.equal(got, live)
            for got, want in zip(kernel_inboxes, reference_inboxes):  # the acks too
                assert torch.equal(got, want)
                assert torch.equal(receiver.epoch, epoch) and receiver.error_count() == 0 == int(errors.item())


def test_a_receiver_without_a_publish_verifies_every_draft_and_counts_it():
    device, max_bs = _device(), 9
    inbox = _inboxes(1, max_bs, device)[0]
    receiver = LiveShare(1, inbox, [], max_bs, STRIDE, max_spins=8)
    live = torch.ones(max_bs, dtype=torch.int32, device=device)
    receiver.receive(live)
    assert live.tolist() == [STRIDE] * max_bs and receiver.error_count() == 1
    # the next step goes on: rank 0's publish of step 2 is taken
    publisher = LiveShare(0, torch.zeros(1, dtype=torch.int32, device=device), [inbox], max_bs, STRIDE)
    publisher.epoch.fill_(1)
    sent = torch.arange(1, max_bs + 1, dtype=torch.int32, device=device) % STRIDE + 1
    publisher.publish(sent)
    receiver.receive(live)
    assert torch.equal(live, sent) and receiver.error_count() == 1


def test_rank0_never_overwrites_lengths_a_rank_has_not_read():
    """Rank 0 two steps ahead (nothing between the steps keeps it back): it waits for the ack of
    the step whose slot it reuses; with no ack at all (the peer hung) it gives up after its spins,
    counts it, and the peer, finding another step's flag, verifies every draft and counts it."""
    device, max_bs = _device(), 5
    inbox = _inboxes(1, max_bs, device)[0]
    publisher = LiveShare(0, torch.zeros(1, dtype=torch.int32, device=device), [inbox], max_bs, STRIDE, max_spins=8)
    receiver = LiveShare(1, inbox, [], max_bs, STRIDE, max_spins=8)
    steps = [torch.full((max_bs,), value, dtype=torch.int32, device=device) for value in (2, 3, 4, 5)]
    got = torch.zeros(max_bs, dtype=torch.int32, device=device)
    publisher.publish(steps[0])
    publisher.publish(steps[1])
    receiver.receive(got)                     # step 1 read and acked: its slot is free
    assert torch.equal(got, steps[0])
    publisher.publish(steps[2])               # reuses step 1's slot: no wait, no error
    assert publisher.error_count() == 0
    publisher.publish(steps[3])               # reuses step 2's slot, never read: gives up, counted
    assert publisher.error_count() == 1
    receiver.receive(got)                     # step 2's slot now holds step 4
    assert got.tolist() == [STRIDE] * max_bs and receiver.error_count() == 1
    receiver.receive(got)                     # step 3 is intact
    assert torch.equal(got, steps[2]) and receiver.error_count() == 1


def test_live_must_be_the_share_s_buffer_shape():
    device = _device()
    share = LiveShare(1, _inboxes(1, 4, device)[0], [], 4, STRIDE)
    with pytest.raises(ValueError, match="int32 \\[4\\]"):
        share.receive(torch.zeros(5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="int32"):
        share.receive(torch.zeros(4, dtype=torch.int64, device=device))


def _scripted_gather(other_rank):
    """An all_gather_object for rank 0 of two, the other rank answering ``other_rank(obj)``."""
    rounds = []

    def gather(obj):
        rounds.append(obj)
        return [obj, other_rank(obj, len(rounds))]
    return gather, rounds


@pytest.mark.parametrize("other, reason", [
    (lambda obj, round: (obj[0], None, "rank 1 could not export its inbox: pidfd_getfd denied") if round == 1
     else None, "could not export"),
    (lambda obj, round: ("another-host/boot", None, None) if round == 1 else None, "several machines"),
])
def test_every_rank_keeps_the_broadcast_when_one_cannot_share(other, reason, caplog):
    from vcap.engine_hook.tp_share import build
    gather, rounds = _scripted_gather(other)
    with caplog.at_level("WARNING", logger="vcap.engine_hook"):
        share = build(0, 2, 8, STRIDE, _device(), gather)
    assert share is None and len(rounds) == 2  # both rounds run, so no rank is left waiting
    assert reason in caplog.text


# -- two processes of one TP group ------------------------------------------------------------


def _setup() -> tuple[str, int]:
    """(device of rank r as a format string, steps) for the machine at hand."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return "cuda:{rank}", 10_000
    if count == 1:
        return "cuda:0", 10_000
    return "cpu", 24


class _Group:
    def __init__(self, rank: int, world_size: int):
        self.rank_in_group, self.world_size = rank, world_size

    def all_gather_object(self, obj):
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, tensor, src: int = 0):
        raise AssertionError("the share replaces the broadcast on one node")


def _rank(rank: int, world_size: int, init_file: str, name: str, results):
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from vcap.engine_hook import reference
    from vcap.engine_hook.hook import VerifyHook
    from vcap.engine_hook.sglang_hooks import EngineState, _build_share, decide_live_lengths
    from vcap.segment import Segment, SegmentConfig

    device_format, steps = _setup()
    device = device_format.format(rank=rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    max_bs = 64
    state = EngineState()
    state.stride, state.max_bs, state.rank, state.group = STRIDE, max_bs, rank, _Group(rank, world_size)
    segment = sidecar = None
    if rank == 0:
        segment = Segment.create(name, SegmentConfig(stride=STRIDE, max_bs=max_bs, num_moe_layers=2))
        sidecar = Segment.attach(segment.path)
        state.hook = VerifyHook(segment, device=device)
        state.live = state.hook.live
    else:
        state.live = torch.full((max_bs,), STRIDE, dtype=torch.int32, device=device)
    state.share = _build_share(state.group, max_bs, STRIDE, device).bind(state.live)
    rng = np.random.default_rng(7)  # the same stream on both ranks: the same batches and confidences
    history = torch.zeros((steps, max_bs), dtype=torch.int32, device=device)
    expected = np.zeros((steps, max_bs), dtype=np.int32)
    for step in range(steps):
        bs = int(rng.integers(1, max_bs + 1))
        confidence = torch.as_tensor(rng.random((bs, STRIDE - 1)), dtype=torch.float32, device=device)
        policy = random_policy(rng, STRIDE, off=0.1, fixed=0.25)
        if rank == 0:  # the policy changes under the share, every step
            sidecar.heartbeat[0] += 1
            sidecar.write_policy(policy, step + 1, "manual")
            expected[step, :bs] = reference.live_lengths(confidence.cpu().numpy(), policy, bs, STRIDE)
        decide_live_lengths(state, confidence, bs)
        history[step].copy_(state.live)  # device copy: no sync inside the loop
    observed = history.cpu().numpy()
    errors = state.share.error_count()
    if rank == 0:
        state.hook.close()
        sidecar.close()
        segment.unlink()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    results.put((rank, observed, expected if rank == 0 else None, errors))


def test_every_rank_holds_rank0_live_lengths_every_step():
    from .conftest import run_ranks
    outcome = run_ranks(_rank, 2, f"vcap-share-{uuid.uuid4().hex[:8]}")
    rank0, expected, errors0 = outcome[0]
    rank1, _, errors1 = outcome[1]
    steps = rank0.shape[0]
    bs_of_step = (expected > 0).sum(axis=1)
    for step in range(steps):  # rank 0 follows the rule, on the rows of the step's batch
        bs = bs_of_step[step]
        assert rank0[step, :bs].tolist() == expected[step, :bs].tolist(), f"step {step}"
    disagreements = int((rank0 != rank1).any(axis=1).sum())
    print(f"\nrank-0 rule through mapped inboxes, {_setup()[0]}: {steps} steps, {disagreements} with rank 1 "
          f"off rank 0's lengths, receive errors {errors0}/{errors1}")
    assert disagreements == 0 and errors0 == errors1 == 0
    assert len({tuple(row) for row in rank0}) > steps // 4  # the lengths did change under it
