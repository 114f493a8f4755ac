"""The eager half of the staged path: once per step, before the graph replay, read the control
block on the host (seqlock, last good kept, lease judged by the engine's own clock, fallback
when expired: the rule of ``vcap.segment.ControlReader``, on raw words so nothing is decoded),
take the step's decisions (explore, expert sampling), and stage them with one non-blocking
host-to-device copy from a pinned slot into the device buffer the begin kernel reads. The GPU
then reads device memory only; no fence and no mapped read stays on its critical path.

Staged words (int32, ``STAGED_HEAD + control_words``)::

    0 bs   1 confidence_present   2 explore   3 sampled   4 source (0 live, 1 held, 2 fallback)
    5 num_queued   6..7 step (int64, little-endian)   8..15 zero   16.. the control block used

Pinned slots are used round robin; a slot is rewritten only once the copy that last read it is
done (a CUDA event per slot; the CPU waits on it only when it runs ``num_slots`` steps ahead).
"""

import time

import numpy as np
import torch

from vcap.segment import Segment

__all__ = ["HostControl", "HostSnapshot", "STAGED_HEAD", "SOURCE_LIVE", "SOURCE_HELD", "SOURCE_FALLBACK"]

STAGED_HEAD = 16
SOURCE_LIVE, SOURCE_HELD, SOURCE_FALLBACK = 0, 1, 2
_EXPLORE_WORD = 5


class HostControl:
    """The control block this step uses, as raw int32 words, and why (a ``SOURCE_*``).

    Same rule as :class:`vcap.segment.ControlReader`: keeps the last good block while a write is
    in flight; the fallback once the heartbeat has not moved, or the block stayed odd, for
    ``lease_ms`` of ``clock`` (the engine's monotonic clock, in ns).
    """

    def __init__(self, segment: Segment, clock=time.monotonic_ns):
        self.segment, self.clock = segment, clock
        self.lease_ns = segment.config.lease_ms * 1_000_000
        layout = segment.layout
        self._words = segment.control_words
        self._heartbeat_view = segment.heartbeat
        self.fallback = np.frombuffer(segment.read_block(layout.fallback_offset), dtype="<i4").copy()
        self.last_good = None
        now = clock()
        self._heartbeat, self._heartbeat_changed = int(self._heartbeat_view[0]), now
        self._odd_since = None

    def read(self) -> tuple[np.ndarray, int]:
        now = self.clock()
        heartbeat = int(self._heartbeat_view[0])
        if heartbeat != self._heartbeat:
            self._heartbeat, self._heartbeat_changed = heartbeat, now
        body = None
        before = int(self._words[0])
        if not before & 1:
            copy = self._words.copy()  # x86-64 keeps loads in order: seq, body, seq
            if int(self._words[0]) == before:
                body = copy.view("<i4")
        if body is None:
            if self._odd_since is None:
                self._odd_since = now
        else:
            self._odd_since = None
            self.last_good = body
        expired = (now - self._heartbeat_changed > self.lease_ns
                   or (self._odd_since is not None and now - self._odd_since > self.lease_ns))
        if expired or self.last_good is None:
            return self.fallback, SOURCE_FALLBACK
        return self.last_good, SOURCE_LIVE if body is not None else SOURCE_HELD


class HostSnapshot:
    """Pinned staging slots and the device buffer the staged begin kernel reads.

    >>> snap = HostSnapshot(segment, "cuda", sample_period=4)   # doctest: +SKIP
    >>> snap.stage(bs=5, confidence_present=True)               # eager, before each replay
    """

    def __init__(self, segment: Segment, device, *, sample_period: int = 0, num_slots: int = 4,
                 clock=time.monotonic_ns):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.control = HostControl(segment, clock)
        self.device = torch.device(device)
        self.max_bs = segment.config.max_bs
        self.sample_period = int(sample_period)
        self.control_words = segment.layout.control_size // 4
        words = STAGED_HEAD + self.control_words  # even: control_size is a multiple of 64
        cuda = self.device.type == "cuda"
        self._host = torch.zeros((num_slots, words), dtype=torch.int32, pin_memory=cuda)
        self._slots = self._host.numpy()
        self._steps = self._slots.view(np.int64)[:, 3]  # words 6..7 of every slot
        self._events = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]
        self._recorded = [False] * num_slots
        self.staged = torch.zeros(words, dtype=torch.int32, device=self.device)
        self.step = 0
        self.waits = 0  # times the CPU was num_slots steps ahead and waited for a copy

    def stage(self, bs: int, confidence_present: bool = True, num_queued: int = 0) -> np.ndarray:
        """Read the control block, decide this step, copy it to the device (no host sync)."""
        block, source = self.control.read()
        step = self.step
        index = step % len(self._slots)
        if self._recorded[index] and not self._events[index].query():
            self.waits += 1
            self._events[index].synchronize()
        slot = self._slots[index]
        explore_period = int(block[_EXPLORE_WORD])
        explore = explore_period > 0 and step % explore_period == 0
        sampled = self.sample_period > 0 and step % self.sample_period == 0
        slot[:6] = (min(max(int(bs), 0), self.max_bs), 1 if confidence_present else 0, explore, sampled, source,
                    min(max(int(num_queued), 0), 0x7FFFFFFF))
        self._steps[index] = step
        slot[STAGED_HEAD:] = block
        self.staged.copy_(self._host[index], non_blocking=True)
        if self._events[index] is not None:
            self._events[index].record()
            self._recorded[index] = True
        self.step = step + 1
        return slot
