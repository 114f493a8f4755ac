"""The ``/metrics`` HTTP endpoint, bounded: a cap on connections served at once, an idle
timeout and a deadline per connection.

``prometheus_client.start_http_server`` starts one thread per connection with no timeout and no
cap, so half-sent requests pile up threads and file descriptors until the process runs out
(issue 16.8). Here a connection beyond :data:`MAX_CONNECTIONS` is closed at once, one that
sends nothing for :data:`IDLE_TIMEOUT_S` is dropped, and one still open :data:`DEADLINE_S` after
it was accepted is closed: a client sending a header line every few seconds held its slot for
as long as it liked, and 16 of them kept Prometheus out (found by an outside review). Each
scrape renders the registry with ``generate_latest``.
"""

import logging
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["MetricsServer", "MAX_CONNECTIONS", "IDLE_TIMEOUT_S", "DEADLINE_S"]

log = logging.getLogger("vcap.sidecar")
MAX_CONNECTIONS = 16
IDLE_TIMEOUT_S = 5.0
DEADLINE_S = 10.0   # a scrape's request and response take milliseconds


class _Handler(BaseHTTPRequestHandler):
    timeout = IDLE_TIMEOUT_S  # socket timeout: a silent client is dropped
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        if self.path.split("?", 1)[0] not in ("/", "/metrics"):
            self.send_error(404, "only /metrics here")
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # no line per scrape
        pass


class MetricsServer(ThreadingHTTPServer):
    """Serves ``registry`` on ``(host, port)`` from a daemon thread (:meth:`start`)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, host: str, port: int, registry, max_connections: int = MAX_CONNECTIONS,
                 deadline_s: float = DEADLINE_S):
        self.registry, self.deadline_s = registry, deadline_s
        self._accepted: dict[socket.socket, float] = {}   # connections being served -> when accepted
        self._accepted_lock = threading.Lock()
        self._stopped = threading.Event()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__((host, port), _Handler)
        self._thread = None

    def server_bind(self):
        # HTTPServer.server_bind also looks the host's name up (getfqdn): a DNS wait for nothing
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def start(self) -> "MetricsServer":
        self._thread = threading.Thread(target=self.serve_forever, name="vcap-metrics", daemon=True)
        self._thread.start()
        threading.Thread(target=self._close_overdue, name="vcap-metrics-deadline", daemon=True).start()
        return self

    def _close_overdue(self) -> None:
        """One thread for every connection's deadline: an overdue one is shut down, and the
        handler's blocked read returns."""
        while not self._stopped.wait(min(0.5, self.deadline_s / 4)):
            now = time.monotonic()
            with self._accepted_lock:
                overdue = [sock for sock, accepted in self._accepted.items() if now - accepted > self.deadline_s]
                for sock in overdue:
                    del self._accepted[sock]
            for sock in overdue:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        with self._accepted_lock:
            self._accepted[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request) -> None:
        with self._accepted_lock:
            self._accepted.pop(request, None)
        self._slots.release()

    def handle_error(self, request, client_address):
        # a client that timed out or went away is not the server's error
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)

    def stop(self) -> None:
        self._stopped.set()
        self.shutdown()
        self.server_close()
