"""Rank 0 decides, over the eager broadcast (the fallback when the TP group spans several nodes;
one node uses mapped inboxes, ``test_tp_share.py``): two processes of one TP group, rank 1 given a
different policy on purpose; both end up routing and cutting with rank 0's live lengths.

Two GPUs: NCCL, one GPU each (what SGLang runs). One GPU: both ranks on it over gloo. No GPU:
gloo on CPU tensors, the kernels under Triton's interpreter (CI).

The group is a thin stand-in for SGLang's GroupCoordinator (``world_size``, ``rank_in_group``,
``broadcast(tensor, src)``) over torch.distributed, the same collective SGLang's ``SpecTpSync``
uses; SGLang itself does not run on the GPU machine.
"""

import os
import time
import uuid

import pytest

torch = pytest.importorskip("torch")

STRIDE, MAX_BS = 6, 64


def _setup() -> tuple[str, str, int]:
    """(backend, device of rank r as a format string, steps) for the machine at hand."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return "nccl", "cuda:{rank}", 200
    if count == 1:
        return "gloo", "cuda:0", 200
    return "gloo", "cpu", 30


class _Group:
    def __init__(self, rank: int, world_size: int):
        self.rank_in_group, self.world_size = rank, world_size

    def broadcast(self, tensor, src: int = 0):
        torch.distributed.broadcast(tensor, src=src)
        return tensor


def _rank(rank: int, world_size: int, init_file: str, name: str, results):
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import numpy as np
    from vcap.engine_hook import reference
    from vcap.engine_hook.sglang_hooks import EngineState, decide_live_lengths
    from vcap.engine_hook.hook import VerifyHook
    from vcap.policy import Bucket, Policy
    from vcap.segment import Segment, SegmentConfig

    backend, device_format, steps = _setup()
    device = device_format.format(rank=rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                         world_size=world_size)
    segment = Segment.create(f"{name}-r{rank}", SegmentConfig(stride=STRIDE, max_bs=MAX_BS, num_moe_layers=2))
    # a different policy on each rank, on purpose
    thresholds = (0.0, 0.5, 0.3, 0.2, 0.1) if rank == 0 else (0.9,) * 5
    policy = Policy("conf", 1, (Bucket(1, 1, 5, thresholds),))
    sidecar = Segment.attach(segment.path)
    sidecar.write_policy(policy, 1 + rank, "manual")
    state = EngineState()
    state.hook = VerifyHook(segment, device=device)
    state.live, state.stride, state.max_bs = state.hook.live, STRIDE, MAX_BS
    state.group, state.rank = _Group(rank, world_size), rank
    rng = np.random.default_rng(11)  # same stream on both ranks: the same confidences
    mismatches, broadcast_s = 0, []
    rank0_policy = Policy("conf", 1, (Bucket(1, 1, 5, (0.0, 0.5, 0.3, 0.2, 0.1)),))
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for step in range(steps):
        sidecar.heartbeat[0] += 1
        bs = int(rng.integers(1, MAX_BS + 1))
        confidence = torch.as_tensor(rng.random((bs, STRIDE - 1)), dtype=torch.float32, device=device)
        synchronize()
        start = time.perf_counter()
        decide_live_lengths(state, confidence, bs)
        synchronize()
        broadcast_s.append(time.perf_counter() - start)
        expected = reference.live_lengths(confidence.cpu().numpy(), rank0_policy, bs, STRIDE)
        mismatches += int(state.live[:bs].cpu().tolist() != expected.tolist())
    state.hook.close()
    segment.unlink()
    torch.distributed.destroy_process_group()
    results.put((rank, mismatches, steps, float(np.median(broadcast_s[5:]) * 1e6)))


def test_both_ranks_use_rank0_live_lengths():
    from .conftest import run_ranks
    outcome = sorted((rank, *rest) for rank, rest in
                     run_ranks(_rank, 2, f"vcap-tp-{uuid.uuid4().hex[:8]}", timeout=300).items())
    backend, device, _ = _setup()
    print(f"\nrank-0 rule, {backend} on {device}: {outcome} (rank, steps not using rank 0's L, steps, "
          "median us per step for live lengths + broadcast)")
    assert [mismatches for _, mismatches, _, _ in outcome] == [0, 0]
    assert all(steps > 0 for _, _, steps, _ in outcome)
