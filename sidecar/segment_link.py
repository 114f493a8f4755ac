"""The sidecar's side of one segment (one attention-DP rank's): attach, renew the lease, read the rings.

The sidecar never creates, truncates or unlinks a segment. It waits for the engine's file,
attaches, and re-attaches when the file at the path is another inode (the engine restarted:
its new graphs point into the new file's pages). It writes a segment only while it holds the
segment's writer lock (one sidecar per segment), and treats every word it reads there as
untrusted: it reads and writes it through the file, never through the mapping (a truncated
file raises SIGBUS on access, not an error), and checks its size and header before each pass;
pids out of range are no process, and records are validated before any total.
"""

import logging
import os
import time
from dataclasses import dataclass

from vcap.segment import (STATUS_ENGINE_HEARTBEAT, STATUS_FALLBACK_ACTIVE, RingReader, Segment, SegmentConfig,
                          SegmentError)

from .policy_control import PolicyControl
from .telemetry import TelemetryTotals, Totals, unpack

__all__ = ["SegmentLink", "EngineStatus", "pid_alive"]

log = logging.getLogger("vcap.sidecar")


# Linux's largest pid_max; a header word beyond it names no process.
MAX_PID = 1 << 22
# Seconds between "waiting for the engine" lines.
WAITING_LOG_EVERY_S = 10.0


def pid_alive(pid: int) -> bool:
    """The process exists and runs: not stopped (SIGSTOP), traced-stopped, or a zombie."""
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            state = file.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc view of it (another pid namespace): existence is all we know
    return state not in (b"T", b"t", b"Z", b"X")


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One DP rank's segment as stats and metrics see it."""

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
    records_rejected: int = 0     # records that failed validation, since start
    engine_heartbeat_changed: float | None = None  # time.monotonic() the engine's heartbeat last moved
    dp_rank: int = 0
    dispatch_row_bytes: int = 0   # in force: --dispatch-row-bytes, else the header's (0: not counted)

    @property
    def attached(self) -> bool:
        return self.segment is not None

    @property
    def telemetry_dropped(self) -> int:
        return self.dropped_before + sum(self.dropped_by_ring)


class SegmentLink:
    """One segment, driven by :class:`vcap.sidecar.engine_link.EngineLink`'s thread: ``tick()``
    attaches or re-attaches, renews the lease and drains the rings into ``totals`` and
    ``on_records(ring, batch)``. ``fits(config)`` may refuse a geometry (a message) before attaching."""

    def __init__(self, name: str, dp_rank: int, control: PolicyControl, on_records=None,
                 dispatch_row_bytes: int | None = None, fits=lambda config: None):
        self.name, self.dp_rank, self.control = name, dp_rank, control
        self.on_records, self.fits = on_records, fits
        self.dispatch_row_bytes_flag = dispatch_row_bytes   # None: the header says
        self.segment: Segment | None = None
        self.readers: list[RingReader] = []
        self.totals: TelemetryTotals | None = None
        self.dropped_before = 0  # drops of rings of previous engines
        self.records_by_ring: list[int] = []
        self.last_error = ""
        self.last_renewal = None
        self.attach_count = 0
        self.records_rejected = 0
        self._engine_heartbeat = (None, None)  # (value, monotonic when it changed)
        self._waiting_since = self._waiting_logged = None

    def dispatch_row_bytes(self, config: SegmentConfig | None) -> int:
        if self.dispatch_row_bytes_flag is not None:
            return self.dispatch_row_bytes_flag
        return config.dispatch_row_bytes if config is not None else 0

    def status(self) -> EngineStatus:
        segment, readers = self.segment, self.readers
        intact = segment is not None and segment.intact()
        pid = segment.engine_pid if intact else 0
        try:
            fallback_active = bool(intact and segment.read_status().view("<u4")[STATUS_FALLBACK_ACTIVE])
        except SegmentError:
            fallback_active = False
        config = segment.config if segment else None
        return EngineStatus(
            segment=segment.path if segment else None, config=config,
            pid=pid, alive=pid_alive(pid),
            fallback_active=fallback_active,
            attaches=self.attach_count, last_renewal=self.last_renewal,
            dropped_by_ring=tuple(reader.dropped for reader in readers),
            records_by_ring=tuple(self.records_by_ring[:len(readers)]), dropped_before=self.dropped_before,
            records_rejected=self.records_rejected, engine_heartbeat_changed=self._engine_heartbeat[1],
            dp_rank=self.dp_rank, dispatch_row_bytes=self.dispatch_row_bytes(config))

    def totals_snapshot(self) -> Totals | None:
        totals = self.totals
        return totals.snapshot() if totals is not None else None

    # -- the link thread -------------------------------------------------------------------------

    def tick(self) -> None:
        if self.segment is not None and self.segment.replaced():
            log.warning("segment %s was replaced or removed (engine restarted); re-attaching",
                        self.segment.path)
            self.detach()
        if self.segment is not None and not self.segment.intact():
            log.error("segment %s was truncated under us (%d bytes, its layout needs %d); detaching",
                      self.segment.path, self.segment.size(), self.segment.layout.total_size)
            self.detach()
        if self.segment is None and not self._try_attach():
            return
        self._renew_lease()
        try:
            heartbeat = int(self.segment.read_status().view("<u8")[STATUS_ENGINE_HEARTBEAT])
        except SegmentError:
            return  # truncated since the check above: the next tick detaches
        if heartbeat != self._engine_heartbeat[0]:
            self._engine_heartbeat = (heartbeat, time.monotonic())
        config = self.segment.config
        for ring, reader in enumerate(self.readers):
            records = reader.read()
            if len(records):
                self.records_by_ring[ring] += len(records)
                batch = unpack(records, num_experts=config.num_experts)
                self.records_rejected += batch.rejected
                if len(batch):
                    self.totals.add(batch)
                    if self.on_records is not None:
                        self.on_records(ring, batch)

    def _refuse(self, message: str) -> None:
        if message != self.last_error:
            log.error("%s", message)
            self.last_error = message

    def _try_attach(self) -> bool:
        try:
            segment = Segment.attach(self.name)
        except FileNotFoundError:
            self._log_waiting()
            return False
        except (SegmentError, OSError) as error:
            self._refuse(f"refusing segment: {error}")
            return False
        misfit = self.fits(segment.config)
        if misfit:
            segment.close()
            self._refuse(f"not attaching {segment.path}: {misfit}")
            return False
        try:
            segment.lock_writer()
        except SegmentError as error:
            segment.close()
            self.control.locked_out(str(error))
            self._refuse(f"not attaching: {error}")
            return False
        exposure = segment.exposure()
        if exposure:
            log.warning("%s", exposure)
        self._waiting_since = self._waiting_logged = None
        config = segment.config
        self.readers = [RingReader(segment, ring) for ring in range(config.num_rings)]
        self.records_by_ring = [0] * config.num_rings
        if self.totals is None or (self.totals.stride, self.totals.num_layers) != (
                config.stride, config.num_moe_layers):
            self.totals = TelemetryTotals(config.stride, config.num_moe_layers)
        self.totals.dispatch_row_bytes = self.dispatch_row_bytes(config)
        segment.renew_lease(sidecar_pid=os.getpid())
        self.control.attach(segment, self.dp_rank)
        self.segment = segment  # last: readers of .segment see a fully attached engine
        self._renew_lease()
        self.attach_count += 1
        self.last_error = ""
        log.info("attached to %s (DP rank %d): engine pid %d, stride %d, max_bs %d, %d MoE layers, %d ring(s), "
                 "dispatch row %d bytes", segment.path, self.dp_rank, segment.engine_pid, config.stride,
                 config.max_bs, config.num_moe_layers, config.num_rings, self.totals.dispatch_row_bytes)
        return True

    def _log_waiting(self) -> None:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if self._waiting_logged is None or now - self._waiting_logged >= WAITING_LOG_EVERY_S:
            self._waiting_logged = now
            log.info("waiting for the engine to create segment %s (DP rank %d, %.0f s so far); start the "
                     "engine with the same segment name", self.name, self.dp_rank, now - self._waiting_since)

    def _renew_lease(self) -> None:
        self.segment.renew_lease()
        self.last_renewal = time.monotonic()

    def detach(self) -> None:
        segment = self.segment
        if segment is None:
            return
        self.dropped_before += sum(reader.dropped for reader in self.readers)
        self.control.detach(self.dp_rank)
        self.segment, self.readers = None, []
        self._engine_heartbeat = (None, None)
        segment.close()
