"""The sidecar process: policy control, the engine link, gRPC and Prometheus, wired together."""

import asyncio
import ctypes
import ctypes.util
import logging
import threading
import time
from dataclasses import dataclass

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from vcap.layout import dp_segment_name
from vcap.segment import Segment, SegmentError
from vcap.v1 import controller_pb2 as pb

from .auth import check_exposure, is_local_address, read_token, server_credentials
from .controller import AutoController, ControllerConfig
from .convert import stats_to_proto
from .engine_link import EngineLink
from .history import DEFAULT_MAX_ENTRIES, PolicyHistory, default_history_path
from .logs import rate_limit
from .metrics import build_registry
from .metrics_http import MetricsServer
from .policy_control import PolicyControl
from .policy_file import PolicyFileWatcher
from .recorder import MIN_MAX_BYTES, Recording
from .server import SERVICE_NAME, ControllerServicer, WatchLimits, create_health_server, create_server

__all__ = ["Sidecar", "SidecarConfig", "ENGINE_HEALTH_SERVICE"]

log = logging.getLogger("vcap.sidecar")
# Health of the attached engine, beside the sidecar's own ("" and vcap.v1.Controller).
ENGINE_HEALTH_SERVICE = "vcap.engine"
# Freed heap goes back to the system this often (glibc keeps what one burst of requests took).
TRIM_EVERY_S = 30.0


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def _split_host_port(address: str, flag: str = "") -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag + ' ' if flag else ''}expected HOST:PORT with a port in 0..65535, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class SidecarConfig:
    segment: str = "vcap-0"
    grpc_address: str = "127.0.0.1:50061"
    metrics_address: str = "127.0.0.1:9461"   # "" disables the HTTP endpoint
    policy_file: str | None = None
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    record_file: str | None = None   # keep every telemetry record (for vcapctl tune)
    record_max_bytes: int | None = None  # rotate the record file past this size (None: recorder's default)
    controller: ControllerConfig | None = None
    poll_s: float = 0.01
    health_address: str = ""         # a second, plaintext server with health only ("" : none)
    allow_cleartext_token: bool = False
    max_watch_streams: int = 256
    max_watch_streams_per_peer: int = 128
    history_file: str | None = None  # the policy history's file (None: in memory only)
    history_entries: int = DEFAULT_MAX_ENTRIES
    dp_size: int = 1                 # attention-DP ranks of the engine on this node: one segment each
    dp_first_rank: int = 0           # the node's first DP rank (a node of a multi-node engine)
    dispatch_row_bytes: int | None = None  # bytes per dispatched MoE row (None: each header's)

    def __post_init__(self):
        if not 1 <= self.dp_size <= 1024:
            raise ValueError(f"--dp-size must be in 1..1024, got {self.dp_size}")
        if self.dp_first_rank < 0:
            raise ValueError(f"--dp-first-rank must be >= 0, got {self.dp_first_rank}")
        if self.dispatch_row_bytes is not None and not 0 <= self.dispatch_row_bytes < 1 << 32:
            raise ValueError(f"--dispatch-row-bytes must be in 0..2^32-1, got {self.dispatch_row_bytes}")
        if not self.grpc_address.startswith("unix:"):
            _split_host_port(self.grpc_address, "--grpc")
        if self.metrics_address:
            _split_host_port(self.metrics_address, "--metrics")
        if self.health_address and not self.health_address.startswith("unix:"):
            _split_host_port(self.health_address, "--health")
        if self.record_max_bytes is not None and self.record_max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"--record-max-bytes must be at least {MIN_MAX_BYTES}, got {self.record_max_bytes}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("mutual TLS needs --tls-cert and --tls-key with --tls-client-ca")
        WatchLimits(self.max_watch_streams, self.max_watch_streams_per_peer)


class Sidecar:
    """One sidecar. ``run()`` serves until ``stop()``; tests use ``start()`` (a thread)."""

    def __init__(self, config: SidecarConfig, write_pause=None):
        self.config = config
        rate_limit(logging.getLogger("vcap"))  # vcap and vcap.sidecar; never vcap.audit
        self.auth_token = read_token(config.auth_token_file) if config.auth_token_file else None
        beyond_loopback = not is_local_address(config.grpc_address)
        self.warnings = check_exposure(config.grpc_address, self.auth_token, tls=config.tls_cert is not None,
                                       mtls=config.tls_client_ca is not None,
                                       allow_cleartext_token=config.allow_cleartext_token)
        if config.metrics_address and not is_local_address(config.metrics_address):
            self.warnings.append(f"--metrics {config.metrics_address} listens beyond this machine without "
                                 "authentication: anyone who reaches the port reads the engine's statistics")
        ranks = range(config.dp_first_rank, config.dp_first_rank + config.dp_size)
        for dp_rank in ranks:
            _refuse_if_driven(dp_segment_name(config.segment, dp_rank))
        self.control = PolicyControl(config.segment, write_pause=write_pause,
                                     history=PolicyHistory(config.history_file, config.history_entries),
                                     dp_size=config.dp_size)
        self.link = EngineLink(config.segment, self.control, poll_s=config.poll_s,
                               on_records=self._on_records, dp_size=config.dp_size,
                               dispatch_row_bytes=config.dispatch_row_bytes, first_rank=config.dp_first_rank)
        self.controller = AutoController(self.control, config.controller or ControllerConfig(),
                                         engine_config=self.link.engine_config)
        self.recording = None
        if config.record_file:
            try:
                self.recording = (Recording(config.record_file) if config.record_max_bytes is None
                                  else Recording(config.record_file, max_bytes=config.record_max_bytes))
            except (OSError, ValueError) as error:
                raise ValueError(f"--record: {error}") from None
        self.servicer = ControllerServicer(
            self.control, self.stats, self.auth_token, token_guards_reads=beyond_loopback,
            watch_limits=WatchLimits(config.max_watch_streams, config.max_watch_streams_per_peer))
        self.registry = build_registry(self.control, self.servicer, self.link, self.controller)
        self.health = None   # the gRPC health service, created on the server's event loop
        self.grpc_port = self.metrics_port = self.health_port = 0
        self._metrics_server = None
        self._loop = None
        self._stopping = None
        self._thread = None
        self._ready = threading.Event()

    def _on_records(self, ring, batch) -> None:
        """Every batch of records the link reads, of every DP rank's rings (link thread): to the
        controller and --record."""
        self.controller.observe(ring, batch)
        if self.recording is not None:
            self.recording.write(self.link.layout(), batch.records)

    def stats(self) -> pb.Stats:
        return stats_to_proto(self.link.status(), self.link.totals_snapshot(), self.link.steps_per_second(),
                              self.control.state().generation, self.servicer.watch_updates_dropped,
                              self.control.last_rejected)

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        config = self.config
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca) \
            if config.tls_cert else None
        self.health = health_aio.HealthServicer()
        servers = []
        try:
            server, self.grpc_port = await create_server(self.servicer, self.health, config.grpc_address, credentials)
            servers.append(server)
            if config.health_address:
                health_server, self.health_port = await create_health_server(self.health, config.health_address)
                servers.append(health_server)
            for service in ("", SERVICE_NAME):
                await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
            if config.metrics_address:
                host, port = _split_host_port(config.metrics_address)
                try:
                    self._metrics_server = MetricsServer(host, port, self.registry).start()
                except OSError as error:
                    raise OSError(f"--metrics {config.metrics_address}: cannot listen there "
                                  f"({error.strerror or error})") from None
                self.metrics_port = self._metrics_server.server_port
        except BaseException:
            for started in servers:
                await started.stop(grace=None)
            raise
        self.link.start()
        watcher = PolicyFileWatcher(config.policy_file, self.control) if config.policy_file else None
        for warning in self.warnings:
            log.warning("%s", warning)
        ranks = range(config.dp_first_rank, config.dp_first_rank + config.dp_size)
        log.info("vcap sidecar: gRPC on %s (port %d), metrics on %s (port %d), segment %s",
                 config.grpc_address, self.grpc_port, config.metrics_address or "-", self.metrics_port,
                 dp_segment_name(config.segment, ranks[0]) if len(ranks) == 1 else
                 f"{dp_segment_name(config.segment, ranks[0])} .. {dp_segment_name(config.segment, ranks[-1])} "
                 f"(DP ranks {ranks[0]}..{ranks[-1]})")
        log.info("next: `vcapctl --target %s%s get` shows the policy in force%s", self._target(),
                 (" --tls-ca <CA of --tls-cert>" if config.tls_cert else "")
                 + (" --token-file <the token file>" if config.auth_token_file else ""),
                 f"; metrics at http://{config.metrics_address.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"
                 if config.metrics_address else "")
        self._ready.set()
        try:
            await self._serve(watcher)
        finally:
            for started in servers:
                await started.stop(grace=1.0)
            self._close()

    def _target(self) -> str:
        address = self.config.grpc_address
        if address.startswith("unix:"):
            return address
        host = address.rsplit(":", 1)[0]
        return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{self.grpc_port}"

    async def _serve(self, watcher: PolicyFileWatcher | None) -> None:
        trimmed = time.monotonic()
        while not self._stopping.is_set():
            try:
                if watcher is not None:
                    watcher.poll()
                await self._report_engine_health()
                # the controller's refit takes tens of ms: keep it off the gRPC loop
                await asyncio.get_running_loop().run_in_executor(None, self.controller.tick, time.monotonic())
            except Exception:  # one bad tick must not end the server; the next one retries
                log.exception("sidecar tick failed; serving on")
            if _TRIM is not None and time.monotonic() - trimmed > TRIM_EVERY_S:
                _TRIM(0)
                trimmed = time.monotonic()
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    def _close(self) -> None:
        self.link.stop()
        self.controller.close()
        if self.recording is not None:
            self.recording.close()
        if self._metrics_server is not None:
            self._metrics_server.stop()

    async def _report_engine_health(self) -> None:
        engine = self.link.status()
        serving = engine.attached and engine.alive
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(ENGINE_HEALTH_SERVICE, status)

    def start(self, timeout: float = 10.0) -> "Sidecar":
        """Serve on a background thread (tests and embedding); returns once listening.

        Raises:
            OSError: an address cannot be bound (the error ``run`` raised).
        """
        failure = []

        def serve():
            try:
                asyncio.run(self.run())
            except BaseException as error:  # reported to the caller of start()
                failure.append(error)
                self._ready.set()
        self._thread = threading.Thread(target=serve, name="vcap-sidecar", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("sidecar did not start")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=10)


def _refuse_if_driven(segment_name: str, grace_s: float = 2.0) -> None:
    """Refuse to start on a segment another sidecar writes (its lock is held), naming it. A
    holder that is exiting (killed a moment ago, restarted by its supervisor) gets ``grace_s``.

    Raises:
        ValueError: the other sidecar's pid and what to do.
    """
    try:
        segment = Segment.attach(segment_name)
    except (OSError, SegmentError):  # not there yet, or refused later with its own message
        return
    deadline = time.monotonic() + grace_s
    try:
        while True:
            try:
                segment.lock_writer()
                return
            except SegmentError as error:
                if time.monotonic() > deadline:
                    raise ValueError(str(error)) from None
            time.sleep(0.05)
    finally:
        segment.close()
