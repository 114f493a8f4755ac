import os

import numpy as np
import pytest

# Without CUDA the kernels run under Triton's interpreter, which must be chosen before triton is
# imported (torch may import it), so look for the driver's device nodes rather than ask torch.
if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


class StepRig:
    """The step kernels on a real segment, with the staged words written by the test (no host
    read) and the device clock replaced by ``clock_ns``."""

    def __init__(self, name, device, max_bs, stride, layers=2):
        from vcap.engine_hook.buffers import StepBuffers
        from vcap.engine_hook.mapping import MappedSegment
        from vcap.segment import RingReader, Segment, SegmentConfig

        self.segment = Segment.create(name, SegmentConfig(stride=stride, max_bs=max_bs, num_moe_layers=layers,
                                                          ring_slots=4, num_experts=64))
        self.mapped = MappedSegment(self.segment, device=device)
        self.buffers = StepBuffers(self.segment.layout, device)
        self.buffers.device_clock = False
        self.reader = RingReader(self.segment, 0)
        self.device, self.step_number, self.clock_ns = device, 0, 1_000_000

    def staged(self, policy, generation, bs, present=True, explore=False, sampled=False, control=0, num_queued=0):
        """The words the host would stage for a step (``control``: a ``vcap.segment.CONTROL_*``)."""
        from vcap.engine_hook import buffers
        from vcap.segment import encode_policy

        layout = self.segment.layout
        words = np.zeros(buffers.STAGED_HEAD + layout.control_size // 4, dtype=np.int32)
        words[buffers.STAGED_HEAD:] = np.frombuffer(encode_policy(policy, layout, generation, "auto"), dtype="<i4")
        words[buffers.STAGED_BS], words[buffers.STAGED_CONF_PRESENT] = bs, present
        words[buffers.STAGED_EXPLORE], words[buffers.STAGED_SAMPLED] = explore, sampled
        words[buffers.STAGED_CONTROL], words[buffers.STAGED_NUM_QUEUED] = control, num_queued
        words.view(np.int64)[buffers.STAGED_STEP64] = self.step_number
        return torch.from_numpy(words).to(self.device)

    def step(self, staged, confidence, accepted=None, expert_bits=None):
        """One verify step: begin (then the previous record's publish), end 7 us after begin."""
        from vcap.engine_hook.kernels import begin_step, end_step
        from vcap.engine_hook.record import publish_record

        self.clock_ns += 1_000_000
        self.buffers.clock.fill_(self.clock_ns)
        live = begin_step(self.buffers, staged, confidence, expert_bits)
        publish_record(self.buffers, self.mapped)
        self.buffers.clock.fill_(self.clock_ns + 7_000)
        end_step(self.buffers, accepted)
        self.step_number += 1
        return live.cpu().numpy().copy(), self.buffers.info.cpu().numpy().copy()

    def flush(self, staged, expert_bits=None):
        """A stage-only begin and a publish (what ``VerifyHook.flush`` runs); returns new records."""
        import torch

        from vcap.engine_hook.kernels import begin_step
        from vcap.engine_hook.record import publish_record

        begin_step(self.buffers, staged, None, expert_bits, stage_only=True)
        publish_record(self.buffers, self.mapped)
        if self.device != "cpu":  # the record lands in mapped host memory when the kernel has run
            torch.cuda.synchronize(self.device)
        return self.reader.read()

    def close(self):
        self.mapped.close()
        self.segment.unlink()


@pytest.fixture
def step_rig(segment_name, device):
    """``step_rig(max_bs, stride, layers=2)``: a :class:`StepRig`, closed after the test."""
    rigs = []

    def make(max_bs, stride, layers=2):
        rigs.append(StepRig(segment_name, device, max_bs, stride, layers))
        return rigs[-1]
    yield make
    for rig in rigs:
        rig.close()


from .libdevice_shim import install as _install_libdevice_shim  # noqa: E402

_install_libdevice_shim()


def run_ranks(target, world_size: int, *args, timeout: float = 600) -> dict:
    """``target(rank, world_size, init_file, *args, results)`` in one spawned process per rank
    (a torch.distributed group through ``init_file``); each puts ``(rank, ...)`` into ``results``.
    Returns {rank: the rest of its tuple}."""
    import multiprocessing as mp
    import tempfile
    context = mp.get_context("spawn")
    results = context.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    processes = [context.Process(target=target, args=(rank, world_size, init_file, *args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcome = {rank: tuple(rest) for rank, *rest in (results.get(timeout=timeout) for _ in processes)}
    for process in processes:
        process.join(timeout=60)
    return outcome
