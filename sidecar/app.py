"""The sidecar process: policy control, the engine link, gRPC and Prometheus, wired together."""

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from vcap.v1 import controller_pb2 as pb

from .auth import check_exposure, read_token, server_credentials
from .controller import AutoController, ControllerConfig
from .convert import stats_to_proto
from .engine_link import EngineLink
from .metrics import build_registry
from .policy_control import PolicyControl
from .policy_file import PolicyFileWatcher
from .recorder import Recording
from .server import SERVICE_NAME, ControllerServicer, create_server

__all__ = ["Sidecar", "SidecarConfig", "ENGINE_HEALTH_SERVICE"]

log = logging.getLogger("vcap.sidecar")
# Health of the attached engine, beside the sidecar's own ("" and vcap.v1.Controller).
ENGINE_HEALTH_SERVICE = "vcap.engine"


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
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
    controller: ControllerConfig | None = None
    poll_s: float = 0.01

    def __post_init__(self):
        if self.metrics_address:
            _split_host_port(self.metrics_address)
        tls = (self.tls_cert, self.tls_key, self.tls_client_ca)
        if any(tls) and not all(tls):
            raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-client-ca")


class Sidecar:
    """One sidecar. ``run()`` serves until ``stop()``; tests use ``start()`` (a thread)."""

    def __init__(self, config: SidecarConfig, write_pause=None):
        self.config = config
        self.auth_token = read_token(config.auth_token_file) if config.auth_token_file else None
        check_exposure(config.grpc_address, self.auth_token, mtls=config.tls_cert is not None)
        self.control = PolicyControl(config.segment, write_pause=write_pause)
        self.link = EngineLink(config.segment, self.control, poll_s=config.poll_s,
                               on_records=self._on_records)
        self.controller = AutoController(self.control, config.controller or ControllerConfig(),
                                         engine_config=self.link.engine_config)
        self.recording = Recording(config.record_file) if config.record_file else None
        self.servicer = ControllerServicer(self.control, self.stats, self.auth_token)
        self.registry = build_registry(self.control, self.servicer, self.link, self.controller)
        self.health = None   # the gRPC health service, created on the server's event loop
        self.grpc_port = self.metrics_port = 0
        self._metrics_server = None
        self._loop = None
        self._stopping = None
        self._thread = None
        self._ready = threading.Event()

    def _on_records(self, ring, batch) -> None:
        """Every batch of records the link reads (link thread): to the controller and --record."""
        self.controller.observe(ring, batch)
        if self.recording is not None:
            self.recording.write(self.link.segment.layout, batch.records)

    def stats(self) -> pb.Stats:
        return stats_to_proto(self.link.status(), self.link.totals_snapshot(), self.link.steps_per_second(),
                              self.control.state().generation, self.servicer.watch_updates_dropped)

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        config = self.config
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca) \
            if config.tls_cert else None
        self.health = health_aio.HealthServicer()
        server, self.grpc_port = await create_server(self.servicer, self.health, config.grpc_address, credentials)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_address:
            host, port = _split_host_port(config.metrics_address)
            self._metrics_server, _ = start_http_server(port, host, registry=self.registry)
            self.metrics_port = self._metrics_server.server_port
        self.link.start()
        watcher = PolicyFileWatcher(config.policy_file, self.control) if config.policy_file else None
        log.info("vcap sidecar: gRPC on %s (port %d), metrics on %s (port %d), segment %s",
                 config.grpc_address, self.grpc_port, config.metrics_address or "-",
                 self.metrics_port, config.segment)
        self._ready.set()
        try:
            await self._serve(watcher)
        finally:
            await server.stop(grace=1.0)
            self._close()

    async def _serve(self, watcher: PolicyFileWatcher | None) -> None:
        while not self._stopping.is_set():
            if watcher is not None:
                watcher.poll()
            await self._report_engine_health()
            # the controller's refit takes tens of ms: keep it off the gRPC loop
            await asyncio.get_running_loop().run_in_executor(None, self.controller.tick, time.monotonic())
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
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    async def _report_engine_health(self) -> None:
        engine = self.link.status()
        serving = engine.attached and engine.alive
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(ENGINE_HEALTH_SERVICE, status)

    def start(self, timeout: float = 10.0) -> "Sidecar":
        """Serve on a background thread (tests and embedding); returns once listening."""
        self._thread = threading.Thread(target=asyncio.run, args=(self.run(),), name="vcap-sidecar",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("sidecar did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
