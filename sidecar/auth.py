"""Who may change the policy.

By default the sidecar listens on loopback (or a unix socket) and anyone on the machine who can
reach it may change the policy. Listening beyond the machine requires a bearer token (read from
a file that is not world-readable, compared in constant time) or mutual TLS. Beyond loopback the
token guards every Controller method, reads included (they disclose the segment, the engine's
pid, the policy and the statistics), and travels only over TLS (``--tls-cert``/``--tls-key``);
``--allow-cleartext-token`` downgrades that to a loud warning. Health stays open.
"""

import hmac
import ipaddress
import os
import stat

import grpc

from .files import open_regular, read_regular

__all__ = ["AuthError", "require_token", "read_token", "is_local_address", "check_exposure",
           "server_credentials"]


class AuthError(Exception):
    """A mutating call without the right bearer token."""


def read_token(path: str) -> str:
    """The token in ``path``.

    Raises:
        ValueError: the file is readable by every local user, or the token is short.
    """
    with os.fdopen(open_regular(path), encoding="utf-8") as file:
        mode = os.fstat(file.fileno()).st_mode
        if mode & stat.S_IROTH:
            raise ValueError(f"{path}: readable by every local user (mode {mode & 0o777:04o}); "
                             f"chmod o-r {path} (0400 or 0440)")
        token = file.read().strip()
    if len(token) < 16:
        raise ValueError(f"{path}: the token must be at least 16 characters")
    return token


def require_token(context, token: str | None) -> None:
    """Raises AuthError unless ``token`` is None or the call carries ``Bearer <token>``."""
    if token is None:
        return
    metadata = dict(context.invocation_metadata() or ())
    given = metadata.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        if given:
            raise AuthError("the bearer token does not match the sidecar's (--auth-token-file): "
                            "vcapctl --token-file FILE must hold the same token")
        raise AuthError("this call needs 'authorization: Bearer <token>' (vcapctl --token-file FILE): "
                        "every change does, and beyond loopback every read too")


def is_local_address(address: str) -> bool:
    """True for unix sockets and loopback host:port addresses."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(grpc_address: str, token: str | None, tls: bool, mtls: bool,
                   allow_cleartext_token: bool = False) -> list[str]:
    """Refuse to listen beyond the machine without a token or mTLS, or with a token in clear;
    returns the warnings to log at start-up.

    Raises:
        ValueError: naming the address and what to add.
    """
    if is_local_address(grpc_address):
        return []
    if token is None and not mtls:
        raise ValueError(
            f"--grpc {grpc_address} listens beyond this machine: give --auth-token-file with "
            "--tls-cert/--tls-key, or --tls-cert/--tls-key/--tls-client-ca (mutual TLS), or listen on 127.0.0.1")
    if token is not None and not tls:
        message = (f"--grpc {grpc_address} listens beyond this machine with a bearer token but without "
                   "TLS: the token travels in clear and anyone on the path can read it")
        if not allow_cleartext_token:
            raise ValueError(f"{message}; give --tls-cert and --tls-key (or --allow-cleartext-token "
                             "to accept that)")
        return [f"{message.upper()} (--allow-cleartext-token)"]
    return []


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS from PEM files: the server's certificate and key; with the CA of its clients, mutual
    TLS (a client certificate required)."""
    return grpc.ssl_server_credentials([(read_regular(key), read_regular(cert))],
                                       root_certificates=read_regular(client_ca) if client_ca else None,
                                       require_client_auth=client_ca is not None)
