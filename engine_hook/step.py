"""The hook's per-verify-step sequence, as the engine calls it (all graph-safe, no host sync).

``path="staged"`` (the default):

eager, before the replay: ``prepare(bs, confidence_present, num_queued)`` reads the control block
on the host (seqlock, last good, lease by the engine's clock) and stages it with one non-blocking
copy; captured: ``begin(confidence)`` (the previous step's record staged + this step's live
lengths, one launch, device memory only; then the record is published on a side stream, off the
critical path), ``route(layer, ...)`` in every MoE layer, ``end(accepted=...)`` (end time and
accepted counts, one tiny launch; joins the side stream). The last record is published by the
next step's graph or by ``flush()`` / ``close()``.

``path="mapped"``: the GPU reads the mapped control block itself (``live_length``) and ``end``
publishes the step's record in-line (``telemetry.publish``).
"""

import torch

from vcap.segment import Segment

from .host_snapshot import STAGED_HEAD, HostSnapshot
from .live_length import StepState, live_lengths
from .mapping import MappedSegment
from .router import route as _route
from .staged_step import StagedBuffers, staged_begin, staged_end, staged_publish
from .telemetry import publish

__all__ = ["VerifyHook", "PATHS"]

PATHS = ("staged", "mapped")


class VerifyHook:
    """Everything one rank needs per verify step, allocated before graph capture.

    >>> hook = VerifyHook(Segment.create("vcap-e0", config))            # doctest: +SKIP
    >>> hook.prepare(bs=5, confidence_present=True)                     # eager, per step
    >>> with torch.cuda.graph(graph):                                   # doctest: +SKIP
    ...     hook.begin(confidence); ids = hook.route(0, logits, bias, 6); hook.end(accepted=accepted)
    """

    def __init__(self, segment: Segment, *, ring: int = 0, device=None, strategy: str = "drop",
                 count_experts: bool = True, path: str = "staged", clock=None):
        if strategy not in ("drop", "anchor"):
            raise ValueError(f"strategy must be 'drop' or 'anchor', got {strategy!r}")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        self.segment, self.strategy, self.path = segment, strategy, path
        self.mapped = MappedSegment(segment, ring=ring, device=device)
        self.layout, self.config = segment.layout, segment.config
        self.device = self.mapped.device
        num_words = (self.config.num_experts + 31) // 32
        self.expert_bits = None
        if count_experts and self.config.num_moe_layers and self.config.expert_sample_period:
            self.expert_bits = torch.zeros((self.config.num_moe_layers, 2, num_words), dtype=torch.int32,
                                           device=self.device)
        sample_period = self.config.expert_sample_period if self.expert_bits is not None else 0
        self._side = None
        if path == "staged":
            extra = {} if clock is None else {"clock": clock}
            self.host = HostSnapshot(segment, self.device, sample_period=sample_period, **extra)
            self.state = StagedBuffers(self.layout, self.device)
            if self.device.type == "cuda":
                self._side = torch.cuda.Stream(self.device)
        else:
            self.state = StepState(self.layout.control_size // 4, self.config.max_bs, self.config.stride,
                                   self.device, self.mapped.fallback_words)
        self._sample_period = sample_period
        self._num_queued = 0

    @property
    def live(self) -> torch.Tensor:
        """``L`` per request slot (int32 ``[max_bs]``); padded slots hold 1."""
        return self.state.live

    @property
    def info(self) -> torch.Tensor:
        """This step's decision: generation, mode, flags, bs, sampled, source (0 live, 1 held, 2 fallback)."""
        return self.state.info

    @property
    def snapshot_words(self) -> torch.Tensor:
        """The control block words the current step uses (staged) or last read good (mapped)."""
        return self.host.staged[STAGED_HEAD:] if self.path == "staged" else self.state.snapshot

    def prepare(self, bs: int, confidence_present: bool = True, num_queued: int = 0) -> None:
        """Eager, before each replay: the step's real batch size and whether confidence exists."""
        if not 0 <= bs <= self.config.max_bs:
            raise ValueError(f"bs must be in 0..{self.config.max_bs}, got {bs}")
        if self.path == "staged":
            self.host.stage(bs, confidence_present, num_queued)
        else:
            self.state.set_step(bs, confidence_present)
            self._num_queued = num_queued

    def begin(self, confidence: torch.Tensor | None) -> torch.Tensor:
        """This step's live lengths (one launch); staged: the previous record goes out on a side stream."""
        if self.path == "mapped":
            return live_lengths(self.state, self.mapped.control_words, self.mapped.heartbeat, confidence,
                                self.config.lease_ms, self.config.max_buckets, self.layout.bucket_size // 4,
                                self._sample_period)
        live = staged_begin(self.state, self.host.staged, confidence, self.expert_bits)
        if self._side is None:
            staged_publish(self.state, self.mapped)
        else:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                staged_publish(self.state, self.mapped)
        return live

    def route(self, layer: int, scores: torch.Tensor, bias: torch.Tensor, topk: int, **gate) -> tuple:
        """The MoE gate of verify layer ``layer`` with dead rows applied; ``gate`` as :func:`router.route`."""
        bits = self.expert_bits[layer] if self.expert_bits is not None else None
        return _route(scores, bias, topk, live=self.state.live, stride=self.config.stride,
                      strategy=self.strategy, info=self.state.info, expert_bits=bits, **gate)

    def end(self, confidence: torch.Tensor | None = None, accepted: torch.Tensor | None = None,
            num_queued: int | None = None) -> None:
        """Close the step. Mapped: publish its record. Staged: stamp its end and accepted counts
        (``confidence`` is the one ``begin`` saw; ``num_queued`` goes to ``prepare``)."""
        if self.path == "mapped":
            publish(self.mapped, self.state, confidence=confidence, accepted=accepted,
                    expert_bits=self.expert_bits,
                    num_queued=self._num_queued if num_queued is None else num_queued)
            return
        staged_end(self.state, accepted)
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def flush(self) -> None:
        """Staged: publish the last step's record now (eager; e.g. at shutdown). Idempotent."""
        if self.path == "staged":
            staged_begin(self.state, self.host.staged, None, self.expert_bits, stage_only=True)
            staged_publish(self.state, self.mapped)

    def guard_tripped(self) -> bool:
        """Read from the mapped status block: host memory, so no CUDA sync."""
        return bool(self.segment.status_u32[3])

    def close(self) -> None:
        """Publish the last record, then unregister the mapping (even if publishing fails)."""
        try:
            self.flush()
        finally:
            self.mapped.close()
