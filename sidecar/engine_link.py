"""The sidecar's side of the segment: attach, renew the lease, read the rings.

The sidecar never creates, truncates or unlinks the segment. It waits for the engine's file,
attaches, and re-attaches when the file at the path is another inode (the engine restarted:
its new graphs point into the new file's pages).
"""

import logging
import os
import threading
import time
from dataclasses import dataclass

from vcap.segment import STATUS_FALLBACK_ACTIVE, RingReader, Segment, SegmentConfig, SegmentError

from .policy_control import PolicyControl
from .telemetry import TelemetryTotals, Totals, unpack

__all__ = ["EngineLink", "EngineStatus"]

log = logging.getLogger("vcap.sidecar")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """The link as stats and metrics see it."""

    segment: str | None           # the attached segment's path
    config: SegmentConfig | None  # its geometry
    pid: int
    alive: bool
    fallback_active: bool
    attaches: int
    last_renewal: float | None    # time.monotonic() of the last lease renewal
    dropped_by_ring: tuple[int, ...]
    records_by_ring: tuple[int, ...]
    dropped_before: int           # by the rings of previous engines

    @property
    def attached(self) -> bool:
        return self.segment is not None

    @property
    def telemetry_dropped(self) -> int:
        return self.dropped_before + sum(self.dropped_by_ring)


class EngineLink:
    """Background loop: attach/re-attach, heartbeat, drain the rings into ``totals`` and
    ``on_records(ring, batch)`` (:class:`vcap.sidecar.telemetry.RecordBatch`)."""

    def __init__(self, segment_name: str, control: PolicyControl, poll_s: float = 0.01,
                 on_records=None):
        self.segment_name, self.control, self.poll_s = segment_name, control, poll_s
        self.on_records = on_records  # e.g. the controller, or a --record file
        self.segment: Segment | None = None
        self.readers: list[RingReader] = []
        self.totals: TelemetryTotals | None = None
        self.dropped_before = 0  # drops of rings of previous engines
        self.records_by_ring: list[int] = []
        self.last_error = ""
        self.last_renewal = None
        self.attach_count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vcap-engine-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._detach()

    @property
    def attached(self) -> bool:
        return self.segment is not None

    def engine_config(self) -> SegmentConfig | None:
        segment = self.segment
        return segment.config if segment is not None else None

    def status(self) -> EngineStatus:
        segment, readers = self.segment, self.readers
        pid = segment.engine_pid if segment else 0
        return EngineStatus(
            segment=segment.path if segment else None, config=segment.config if segment else None,
            pid=pid, alive=_pid_alive(pid), fallback_active=bool(segment and segment.status_u32[STATUS_FALLBACK_ACTIVE]),
            attaches=self.attach_count, last_renewal=self.last_renewal,
            dropped_by_ring=tuple(reader.dropped for reader in readers),
            records_by_ring=tuple(self.records_by_ring[:len(readers)]), dropped_before=self.dropped_before)

    def totals_snapshot(self) -> Totals | None:
        totals = self.totals
        return totals.snapshot() if totals is not None else None

    def steps_per_second(self) -> float:
        totals = self.totals
        return totals.steps_per_second() if totals is not None else 0.0

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # keep serving; the next tick retries from scratch
                log.exception("engine link error; detaching")
                self._detach()
            self._stop.wait(self.poll_s)

    def _tick(self) -> None:
        if self.segment is not None and self.segment.replaced():
            log.warning("segment %s was replaced or removed (engine restarted); re-attaching",
                        self.segment.path)
            self._detach()
        if self.segment is None and not self._try_attach():
            return
        self._renew_lease()
        for ring, reader in enumerate(self.readers):
            records = reader.read()
            if len(records):
                self.records_by_ring[ring] += len(records)
                batch = unpack(records)
                self.totals.add(batch)
                if self.on_records is not None:
                    self.on_records(ring, batch)

    def _try_attach(self) -> bool:
        try:
            segment = Segment.attach(self.segment_name)
        except FileNotFoundError:
            return False
        except SegmentError as error:
            if str(error) != self.last_error:
                log.error("refusing segment: %s", error)
                self.last_error = str(error)
            return False
        config = segment.config
        self.readers = [RingReader(segment, ring) for ring in range(config.num_rings)]
        self.records_by_ring = [0] * config.num_rings
        if self.totals is None or (self.totals.stride, self.totals.num_layers) != (
                config.stride, config.num_moe_layers):
            self.totals = TelemetryTotals(config.stride, config.num_moe_layers)
        segment.sidecar_pid[0] = os.getpid()
        segment.heartbeat[0] += 1
        self.control.attach(segment)
        self.segment = segment  # last: readers of .segment see a fully attached engine
        self._renew_lease()
        self.attach_count += 1
        self.last_error = ""
        log.info("attached to %s: engine pid %d, stride %d, max_bs %d, %d MoE layers, %d ring(s)",
                 segment.path, segment.engine_pid, config.stride, config.max_bs,
                 config.num_moe_layers, config.num_rings)
        return True

    def _renew_lease(self) -> None:
        self.segment.heartbeat[0] += 1
        self.last_renewal = time.monotonic()

    def _detach(self) -> None:
        segment = self.segment
        if segment is None:
            return
        self.dropped_before += sum(reader.dropped for reader in self.readers)
        self.control.detach()
        self.segment, self.readers = None, []
        segment.close()
