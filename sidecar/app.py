"""The sidecar process: policy control, the engine link, gRPC and Prometheus, wired together."""

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import start_http_server

from vcap.v1 import controller_pb2 as pb

from .auth import check_exposure, read_token
from .control import PolicyControl
from .controller import AutoController, ControllerConfig
from .engine_link import EngineLink
from .metrics import build_registry
from .policy_file import PolicyFileWatcher
from .recorder import Recorder
from .server import create_server

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
        self.control = PolicyControl(config.segment, write_pause=write_pause)
        self.link = EngineLink(config.segment, self.control, poll_s=config.poll_s,
                               on_records=self._on_records)
        self.controller = AutoController(self.control, config.controller or ControllerConfig())
        self.recorder = None
        self.watch_updates_dropped = 0
        self.health = None
        self.registry = build_registry(self)
        self.grpc_port = self.metrics_port = 0
        self.auth_token = read_token(config.auth_token_file) if config.auth_token_file else None
        mtls = config.tls_cert is not None
        check_exposure(config.grpc_address, self.auth_token, mtls)
        self._metrics_server = None
        self._loop = None
        self._stopping = None
        self._thread = None
        self._ready = threading.Event()

    def _on_records(self, ring, records) -> None:
        """Every batch of records the link reads: to the controller, and to --record."""
        self.controller.observe(ring, records)
        if self.config.record_file:
            segment = self.link.segment
            if self.recorder is None or self.recorder.layout.config != segment.config:
                if self.recorder is not None:
                    self.recorder.close()
                try:
                    self.recorder = Recorder(self.config.record_file, segment.layout)
                except ValueError as error:  # another engine geometry: stop recording, keep serving
                    log.error("recording stopped: %s", error)
                    self.config.record_file = None
                    return
            self.recorder.write(records)

    # -- statistics ----------------------------------------------------------------------------

    def stats(self) -> pb.Stats:
        link, totals = self.link, self.link.totals
        state = self.control.state()
        message = pb.Stats(
            timestamp_unix=time.time(), engine_attached=link.attached, engine_pid=link.engine_pid,
            engine_alive=link.engine_alive(), engine_fallback_active=link.engine_fallback_active(),
            policy_generation=state.generation,
            telemetry_dropped=link.dropped_before + sum(link.dropped()),
            watch_updates_dropped=self.watch_updates_dropped)
        if totals is not None:
            with totals.lock:
                requests = max(totals.requests, 1)
                message.MergeFrom(pb.Stats(
                    last_generation_seen=totals.last_generation, verify_steps=totals.steps,
                    rows_live=totals.rows_live, rows_dead=totals.rows_dead,
                    drafts_accepted=totals.drafts_accepted, accepts_at_cap=totals.accepts_at_cap,
                    committed_tokens=totals.committed_tokens,
                    experts_streamed=int(totals.layer_streamed.sum()),
                    experts_saved=int(totals.layer_saved.sum()),
                    expert_sampled_steps=totals.sampled_steps,
                    mean_live_length=totals.rows_live / requests,
                    mean_accepted_drafts=totals.drafts_accepted / requests,
                    guard_violations=totals.guard_violations))
            message.steps_per_second = totals.steps_per_second()
            message.acceptance_by_position.extend(totals.acceptance_by_position())
        return message

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        credentials = None
        if self.config.tls_cert:
            def read(path):
                with open(path, "rb") as file:
                    return file.read()
            credentials = grpc.ssl_server_credentials(
                [(read(self.config.tls_key), read(self.config.tls_cert))],
                root_certificates=read(self.config.tls_client_ca), require_client_auth=True)
        server, self.grpc_port = await create_server(
            self, self.config.grpc_address, credentials=credentials, auth_token=self.auth_token)
        if self.config.metrics_address:
            host, port = _split_host_port(self.config.metrics_address)
            self._metrics_server, _ = start_http_server(port, host, registry=self.registry)
            self.metrics_port = self._metrics_server.server_port
        self.link.start()
        watcher = PolicyFileWatcher(self.config.policy_file, self.control) if self.config.policy_file else None
        log.info("vcap sidecar: gRPC on %s (port %d), metrics on %s (port %d), segment %s",
                 self.config.grpc_address, self.grpc_port, self.config.metrics_address or "-",
                 self.metrics_port, self.config.segment)
        self._ready.set()
        try:
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
        finally:
            await server.stop(grace=1.0)
            self.link.stop()
            self.controller.close()
            if self.recorder is not None:
                self.recorder.close()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()

    async def _report_engine_health(self) -> None:
        serving = self.link.attached and self.link.engine_alive()
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
