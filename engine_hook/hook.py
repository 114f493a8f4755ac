"""The hook's per-verify-step sequence, as the engine calls it (graph-safe, no host sync):

eager, before the replay: ``prepare(bs, confidence_present, num_queued)`` reads the control block
on the host (:class:`vcap.segment.ControlReader`: seqlock, last good, lease by the engine's
clock), takes the step's decisions (explore, expert sampling) and stages them with one
non-blocking copy; captured: ``begin(confidence)`` (the previous step's record staged + this
step's live lengths, one launch, device memory only; then the record is published on a side
stream, off the critical path), ``route(layer, ...)`` in every MoE layer, ``end(accepted)``
(end time and accepted counts, one tiny launch; joins the side stream). The last record is
published by the next step's graph or by ``flush()`` / ``close()``.
"""

import logging
import time

import numpy as np
import torch

from vcap.segment import (CONTROL_EXPLORE_PERIOD, CONTROL_FALLBACK, STATUS_GUARD_TRIPPED, ControlReader, Segment,
                          SegmentError)

from .buffers import (STAGED_BS, STAGED_CONF_PRESENT, STAGED_CONTROL, STAGED_EXPLORE, STAGED_HEAD,
                      STAGED_NUM_QUEUED, STAGED_SAMPLED, STAGED_STEP64, StepBuffers)
from .kernels import begin_step, end_step
from .mapping import MappedSegment
from .record import publish_record
from .router import route as _route

__all__ = ["VerifyHook", "HostSnapshot"]

log = logging.getLogger(__name__)


class HostSnapshot:
    """Pinned staging slots and the device buffer the begin kernel reads.

    Slots are used round robin; a slot is rewritten only once the copy that last read it is done
    (a CUDA event per slot; the CPU waits on it only when it runs ``num_slots`` steps ahead).

    >>> snap = HostSnapshot(segment, "cuda", sample_period=4)   # doctest: +SKIP
    >>> snap.stage(bs=5, confidence_present=True)               # eager, before each replay
    """

    def __init__(self, segment: Segment, device, *, sample_period: int = 0, num_slots: int = 4,
                 clock=time.monotonic_ns):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.segment, self.control = segment, ControlReader(segment, clock)
        self.truncated = False
        self.device = torch.device(device)
        self.max_bs = segment.config.max_bs
        self.sample_period = int(sample_period)
        words = STAGED_HEAD + segment.layout.control_size // 4  # even: control_size is a multiple of 64
        cuda = self.device.type == "cuda"
        self._host = torch.zeros((num_slots, words), dtype=torch.int32, pin_memory=cuda)
        self._slots = self._host.numpy()
        self._steps = self._slots.view(np.int64)[:, STAGED_STEP64]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]
        self._recorded = [False] * num_slots
        self.staged = torch.zeros(words, dtype=torch.int32, device=self.device)
        self.step = 0
        self.waits = 0  # times the CPU was num_slots steps ahead and waited for a copy

    def stage(self, bs: int, confidence_present: bool = True, num_queued: int = 0) -> np.ndarray:
        """Read the control block, decide this step, copy it to the device (no host sync)."""
        block, control = self._read_control()
        step = self.step
        index = step % len(self._slots)
        if self._recorded[index] and not self._events[index].query():
            self.waits += 1
            self._events[index].synchronize()
        slot = self._slots[index]
        explore_period = int(block[CONTROL_EXPLORE_PERIOD])
        slot[STAGED_BS] = min(max(int(bs), 0), self.max_bs)
        slot[STAGED_CONF_PRESENT] = 1 if confidence_present else 0
        slot[STAGED_EXPLORE] = explore_period > 0 and step % explore_period == 0
        slot[STAGED_SAMPLED] = self.sample_period > 0 and step % self.sample_period == 0
        slot[STAGED_CONTROL] = control
        slot[STAGED_NUM_QUEUED] = min(max(int(num_queued), 0), 0x7FFFFFFF)
        self._steps[index] = step
        slot[STAGED_HEAD:] = block
        self.staged.copy_(self._host[index], non_blocking=True)
        if self._events[index] is not None:
            self._events[index].record()
            self._recorded[index] = True
        self.step = step + 1
        return slot

    def _read_control(self) -> tuple[np.ndarray, int]:
        # Someone else truncated the file: the GPU's registered pages are no longer the file's, so
        # nothing the sidecar writes reaches it. Run the engine's own policy (every draft
        # verified) from the copy taken at start, until the engine restarts. One fstat and one
        # header read per step, through the file like the read below (never SIGBUS); the GPU
        # keeps its pinned pages, so its writes land nowhere harmful.
        if self.truncated or not self.segment.intact():
            if not self.truncated:
                log.error("vcap segment %s was truncated by another process: every draft is verified "
                          "and telemetry stops until the engine restarts", self.segment.path)
                self.truncated = True
            return self.control.fallback, CONTROL_FALLBACK
        return self.control.read()


class VerifyHook:
    """Everything one rank needs per verify step, allocated before graph capture.

    >>> hook = VerifyHook(Segment.create("vcap-e0", config))            # doctest: +SKIP
    >>> hook.prepare(bs=5, confidence_present=True, num_queued=3)       # eager, per step
    >>> with torch.cuda.graph(graph):                                   # doctest: +SKIP
    ...     hook.begin(confidence); ids = hook.route(0, logits, bias, 6); hook.end(accepted)
    """

    def __init__(self, segment: Segment, *, ring: int = 0, device=None, strategy: str = "drop",
                 count_experts: bool = True, clock=time.monotonic_ns):
        if strategy not in ("drop", "anchor"):
            raise ValueError(f"strategy must be 'drop' or 'anchor', got {strategy!r}")
        self.segment, self.strategy = segment, strategy
        self.mapped = MappedSegment(segment, ring=ring, device=device)
        self.layout, self.config = segment.layout, segment.config
        self.device = self.mapped.device
        num_words = (self.config.num_experts + 31) // 32
        self.expert_bits = None
        if count_experts and self.config.num_moe_layers and self.config.expert_sample_period:
            self.expert_bits = torch.zeros((self.config.num_moe_layers, 2, num_words), dtype=torch.int32,
                                           device=self.device)
        sample_period = self.config.expert_sample_period if self.expert_bits is not None else 0
        self.host = HostSnapshot(segment, self.device, sample_period=sample_period, clock=clock)
        self.buffers = StepBuffers(self.layout, self.device)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def live(self) -> torch.Tensor:
        """``L`` per request slot (int32 ``[max_bs]``); padded slots hold 1."""
        return self.buffers.live

    @property
    def info(self) -> torch.Tensor:
        """This step's decision (``buffers.INFO_*``): generation, mode, flags, bs, sampled, control, queue."""
        return self.buffers.info

    @property
    def snapshot_words(self) -> torch.Tensor:
        """The control block words the current step uses."""
        return self.host.staged[STAGED_HEAD:]

    def prepare(self, bs: int, confidence_present: bool = True, num_queued: int = 0) -> None:
        """Eager, before each replay: the step's real batch size, whether confidence exists, and
        how many requests wait in the engine's queue (for the record)."""
        if not 0 <= bs <= self.config.max_bs:
            raise ValueError(f"bs must be in 0..{self.config.max_bs}, got {bs}")
        self.host.stage(bs, confidence_present, num_queued)

    def begin(self, confidence: torch.Tensor | None) -> torch.Tensor:
        """This step's live lengths (one launch); the previous record goes out on a side stream."""
        live = begin_step(self.buffers, self.host.staged, confidence, self.expert_bits)
        if self.host.truncated:
            return live   # telemetry stops: the ring's pages are gone (on the CPU, writing is SIGBUS)
        if self._side is None:
            publish_record(self.buffers, self.mapped)
        else:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                publish_record(self.buffers, self.mapped)
        return live

    def route(self, layer: int, scores: torch.Tensor, bias: torch.Tensor, topk: int, **gate) -> tuple:
        """The MoE gate of verify layer ``layer`` with dead rows applied; ``gate`` as :func:`router.route`."""
        bits = self.expert_bits[layer] if self.expert_bits is not None else None
        return _route(scores, bias, topk, live=self.buffers.live, stride=self.config.stride,
                      strategy=self.strategy, info=self.buffers.info, expert_bits=bits, **gate)

    def end(self, accepted: torch.Tensor | None = None) -> None:
        """Close the step: its end time and accepted counts, for its record."""
        end_step(self.buffers, accepted)
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def flush(self) -> None:
        """Publish the last step's record now (eager; e.g. at shutdown). Idempotent."""
        begin_step(self.buffers, self.host.staged, None, self.expert_bits, stage_only=True)
        if not self.host.truncated:
            publish_record(self.buffers, self.mapped)

    def guard_tripped(self) -> bool:
        """Read from the mapped status block: host memory, so no CUDA sync."""
        if self.host.truncated or not self.segment.intact():
            return False
        try:
            return bool(self.segment.read_status().view("<u4")[STATUS_GUARD_TRIPPED])
        except SegmentError:
            return False

    def close(self) -> None:
        """Publish the last record, then unregister the mapping (even if publishing fails)."""
        try:
            self.flush()
        finally:
            self.mapped.close()
