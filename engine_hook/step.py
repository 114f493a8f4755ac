"""The hook's per-verify-step sequence, as the engine calls it (all graph-safe):

eager, before the replay: ``prepare(bs, confidence_present)`` (stream-ordered fills, no sync);
captured: ``begin(confidence)`` (snapshot + live lengths, one launch), ``route(layer, ...)`` in
every MoE layer (the router itself, no extra launch), ``end(confidence, accepted)`` (telemetry
record, one launch).
"""

import torch

from vcap.segment import Segment

from .live_length import StepState, live_lengths
from .mapping import MappedSegment
from .router import route as _route
from .telemetry import publish

__all__ = ["VerifyHook"]


class VerifyHook:
    """Everything one rank needs per verify step, allocated before graph capture.

    >>> hook = VerifyHook(Segment.create("vcap-e0", config))            # doctest: +SKIP
    >>> hook.prepare(bs=5, confidence_present=True)                     # eager, per step
    >>> with torch.cuda.graph(graph):                                   # doctest: +SKIP
    ...     hook.begin(confidence); ids = hook.route(0, logits, bias, 6); hook.end(confidence, accepted)
    """

    def __init__(self, segment: Segment, *, ring: int = 0, device=None, strategy: str = "drop",
                 count_experts: bool = True):
        if strategy not in ("drop", "anchor"):
            raise ValueError(f"strategy must be 'drop' or 'anchor', got {strategy!r}")
        self.segment, self.strategy = segment, strategy
        self.mapped = MappedSegment(segment, ring=ring, device=device)
        self.layout, self.config = segment.layout, segment.config
        self.device = self.mapped.device
        self.state = StepState(self.layout.control_size // 4, self.config.max_bs, self.config.stride,
                               self.device, self.mapped.fallback_words)
        num_words = (self.config.num_experts + 31) // 32
        self.expert_bits = None
        if count_experts and self.config.num_moe_layers and self.config.expert_sample_period:
            self.expert_bits = torch.zeros((self.config.num_moe_layers, 2, num_words), dtype=torch.int32,
                                           device=self.device)

    @property
    def live(self) -> torch.Tensor:
        """``L`` per request slot (int32 ``[max_bs]``); padded slots hold 1."""
        return self.state.live

    @property
    def info(self) -> torch.Tensor:
        """This step's decision: generation, mode, flags, bs, sampled, source (0 live, 1 held, 2 fallback)."""
        return self.state.info

    def prepare(self, bs: int, confidence_present: bool = True) -> None:
        """Eager, before each replay: the step's real batch size and whether confidence exists."""
        if not 0 <= bs <= self.config.max_bs:
            raise ValueError(f"bs must be in 0..{self.config.max_bs}, got {bs}")
        self.state.set_step(bs, confidence_present)

    def begin(self, confidence: torch.Tensor | None) -> torch.Tensor:
        """Snapshot the policy and compute the live lengths (one launch)."""
        return live_lengths(self.state, self.mapped.control_words, self.mapped.heartbeat, confidence,
                            self.config.lease_ms, self.config.max_buckets, self.layout.bucket_size // 4,
                            self.config.expert_sample_period if self.expert_bits is not None else 0)

    def route(self, layer: int, scores: torch.Tensor, bias: torch.Tensor, topk: int, **gate) -> tuple:
        """The MoE gate of verify layer ``layer`` with dead rows applied; ``gate`` as :func:`router.route`."""
        bits = self.expert_bits[layer] if self.expert_bits is not None else None
        return _route(scores, bias, topk, live=self.state.live, stride=self.config.stride,
                      strategy=self.strategy, info=self.state.info, expert_bits=bits, **gate)

    def end(self, confidence: torch.Tensor | None = None, accepted: torch.Tensor | None = None,
            num_queued: int = 0) -> None:
        """Publish this step's telemetry record (one launch, no host sync)."""
        publish(self.mapped, self.state, confidence=confidence, accepted=accepted,
                expert_bits=self.expert_bits, num_queued=num_queued)

    def guard_tripped(self) -> bool:
        """Read from the mapped status block: host memory, so no CUDA sync."""
        return bool(self.segment.status_u32[3])

    def close(self) -> None:
        self.mapped.close()
