"""The sidecar's side of a node's engine: one segment per attention-DP rank, one thread for all.

Under attention DP each DP rank's engine creates its own segment (``<segment>`` for rank 0,
``<segment>-dp<r>`` for rank ``r``: :func:`vcap.layout.dp_segment_name`). The sidecar serves the
whole node, DP ranks ``first_rank .. first_rank + dp_size - 1`` (a node of a multi-node engine
hosts a slice of them): a :class:`vcap.sidecar.segment_link.SegmentLink` per rank (its own lease, writer lock
and re-attach), the one node policy written into every segment (:class:`PolicyControl`), and
every ring of every segment read into the totals and the controller. The ranks of one engine
share one configuration; a segment whose geometry differs from an attached rank's is refused.
"""

import logging
import os
import threading
from dataclasses import dataclass

from vcap.layout import dp_segment_name
from vcap.segment import Layout, SegmentConfig, segment_path

from .policy_control import PolicyControl
from .segment_link import EngineStatus, SegmentLink
from .telemetry import Totals

__all__ = ["EngineLink", "EngineStatus", "NodeStatus"]

log = logging.getLogger("vcap.sidecar")


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """Every DP rank's :class:`EngineStatus`; the node is attached (alive) only when every rank is."""

    ranks: tuple[EngineStatus, ...]

    @property
    def attached(self) -> bool:
        return all(rank.attached for rank in self.ranks)

    @property
    def alive(self) -> bool:
        return all(rank.alive for rank in self.ranks)

    @property
    def pid(self) -> int:
        return self.ranks[0].pid

    @property
    def fallback_active(self) -> bool:
        return any(rank.fallback_active for rank in self.ranks)

    @property
    def telemetry_dropped(self) -> int:
        return sum(rank.telemetry_dropped for rank in self.ranks)


class EngineLink:
    """Background loop over the node's segments; ``on_records(ring, batch)`` gets every batch
    (:class:`vcap.sidecar.telemetry.RecordBatch`) with a node-wide ring number,
    ``dp_rank * num_rings + ring``. ``dispatch_row_bytes`` (not None) overrides every header's."""

    def __init__(self, segment_name: str, control: PolicyControl, poll_s: float = 0.01,
                 on_records=None, dp_size: int = 1, dispatch_row_bytes: int | None = None,
                 first_rank: int = 0):
        if dp_size < 1 or first_rank < 0:
            raise ValueError(f"need dp_size >= 1 and first_rank >= 0, got {dp_size}, {first_rank}")
        self.segment_name, self.control, self.poll_s = segment_name, control, poll_s
        self.on_records = on_records  # e.g. the controller, or a --record file
        self.ranks = [SegmentLink(dp_segment_name(segment_name, rank), rank, control,
                                  on_records=self._forward(rank), dispatch_row_bytes=dispatch_row_bytes,
                                  fits=self._fits_for(rank))
                      for rank in range(first_rank, first_rank + dp_size)]
        self._beyond = dp_segment_name(segment_name, first_rank + dp_size)   # the next node's first
        self._extra_reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vcap-engine-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for rank in self.ranks:
            rank.detach()

    # -- what the rest of the sidecar reads -------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Every DP rank's segment is attached."""
        return all(rank.segment is not None for rank in self.ranks)

    @property
    def segment(self):
        """The node's first DP rank's segment (None while detached)."""
        return self.ranks[0].segment

    @property
    def attach_count(self) -> int:
        return sum(rank.attach_count for rank in self.ranks)

    @property
    def records_by_ring(self) -> list[int]:
        """Records read per node-wide ring (the first DP rank's rings first)."""
        return [count for rank in self.ranks for count in rank.records_by_ring]

    @property
    def readers(self):
        return [reader for rank in self.ranks for reader in rank.readers]

    @property
    def records_rejected(self) -> int:
        return sum(rank.records_rejected for rank in self.ranks)

    @property
    def last_error(self) -> str:
        return "; ".join(rank.last_error for rank in self.ranks if rank.last_error)

    @property
    def totals(self):
        return self.ranks[0].totals

    def _attached_configs(self) -> list[SegmentConfig]:
        return [segment.config for segment in (rank.segment for rank in self.ranks) if segment is not None]

    def engine_config(self) -> SegmentConfig | None:
        configs = self._attached_configs()
        return configs[0] if configs else None

    def layout(self) -> Layout | None:
        """The node's record layout (every rank's is the same)."""
        config = self.engine_config()
        return Layout(config) if config is not None else None

    def status(self) -> NodeStatus:
        return NodeStatus(tuple(rank.status() for rank in self.ranks))

    def totals_by_rank(self) -> dict[int, Totals]:
        """Each attached-once DP rank's totals since the sidecar started."""
        snapshots = {rank.dp_rank: rank.totals_snapshot() for rank in self.ranks}   # by global DP rank
        return {dp_rank: totals for dp_rank, totals in snapshots.items() if totals is not None}

    def totals_snapshot(self) -> Totals | None:
        """The node's totals: every DP rank's of the newest geometry, added up."""
        ranks = list(self.totals_by_rank().values())
        if not ranks:
            return None
        shape = (ranks[0].stride, ranks[0].num_layers)
        return Totals.of_ranks([totals for totals in ranks if (totals.stride, totals.num_layers) == shape])

    def steps_per_second(self) -> float:
        """Verify steps per second, summed over the DP ranks (as the step totals are)."""
        return sum(rank.totals.steps_per_second() for rank in self.ranks if rank.totals is not None)

    # -- the loop ------------------------------------------------------------------------------

    def _forward(self, dp_rank: int):
        def forward(ring, batch):
            if self.on_records is not None:
                config = self._rank(dp_rank).segment.config
                self.on_records(dp_rank * config.num_rings + ring, batch)
        return forward

    def _rank(self, dp_rank: int) -> SegmentLink:
        return self.ranks[dp_rank - self.ranks[0].dp_rank]

    def _fits_for(self, dp_rank: int):
        def fits(config: SegmentConfig) -> str | None:
            for other in self.ranks:
                segment = other.segment
                if other.dp_rank != dp_rank and segment is not None and segment.config != config:
                    return (f"its configuration {config} differs from DP rank {other.dp_rank}'s "
                            f"({segment.path}: {segment.config}); the DP ranks of one engine share one "
                            "configuration (remove a stale segment of an engine that is gone)")
            return None
        return fits

    def _run(self) -> None:
        while not self._stop.is_set():
            for rank in self.ranks:
                try:
                    rank.tick()
                except Exception:  # keep serving; the next tick retries from scratch
                    log.exception("engine link error on %s; detaching", rank.name)
                    rank.detach()
            self._report_extra_ranks()
            self._stop.wait(self.poll_s)

    def _report_extra_ranks(self) -> None:
        """Warn once when the node runs more DP ranks than the sidecar serves: the rank past
        --dp-size would run on its fallback policy, its lease never renewed."""
        if self._extra_reported or self.ranks[0].segment is None:
            return
        extra = segment_path(self._beyond)
        if os.path.exists(extra):
            self._extra_reported = True
            log.warning("segment %s exists, but this sidecar serves %d DP rank(s) (--dp-size %d): that rank "
                        "runs its fallback policy; give --dp-size the engine's DP ranks on this node", extra,
                        len(self.ranks), len(self.ranks))
