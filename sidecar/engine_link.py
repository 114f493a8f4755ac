"""The sidecar's side of the segment: attach, renew the lease, read the rings.

The sidecar never creates, truncates or unlinks the segment. It waits for the engine's file,
attaches, and re-attaches when the file at the path is another inode (the engine restarted:
its new graphs point into the new file's pages).
"""

import logging
import os
import threading
import time

from vcap.segment import RingReader, Segment, SegmentError

from .control import PolicyControl
from .telemetry import TelemetryTotals

__all__ = ["EngineLink"]

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


class EngineLink:
    """Background loop: attach/re-attach, heartbeat, drain the rings into ``totals``."""

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

    @property
    def engine_pid(self) -> int:
        segment = self.segment
        return segment.engine_pid if segment else 0

    def engine_alive(self) -> bool:
        return _pid_alive(self.engine_pid)

    def engine_fallback_active(self) -> bool:
        segment = self.segment
        return bool(segment and segment.status_u32[2])

    def engine_guard_tripped(self) -> bool:
        segment = self.segment
        return bool(segment and segment.status_u32[3])

    def dropped(self) -> list[int]:
        return [reader.dropped for reader in self.readers]

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
                self.totals.add(records)
                if self.on_records is not None:
                    self.on_records(ring, records)

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
        self.dropped_before += sum(self.dropped())
        self.control.detach()
        self.segment, self.readers = None, []
        segment.close()
