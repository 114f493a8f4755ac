"""Who may change the policy.

By default the sidecar listens on loopback (or a unix socket) and anyone on the machine who can
reach it may change the policy. Listening beyond the machine requires a bearer token for the
mutating RPCs (read from a file, compared in constant time) or mutual TLS; read-only RPCs stay
open.
"""

import hmac
import ipaddress

import grpc

__all__ = ["AuthError", "require_token", "read_token", "is_local_address", "check_exposure",
           "server_credentials"]


class AuthError(Exception):
    """A mutating call without the right bearer token."""


def read_token(path: str) -> str:
    with open(path, encoding="utf-8") as file:
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
        raise AuthError("this call changes the policy and needs 'authorization: Bearer <token>'")


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


def check_exposure(grpc_address: str, token: str | None, mtls: bool) -> None:
    """Refuse to listen beyond the machine without a token or mTLS.

    Raises:
        ValueError: naming the address and what to add.
    """
    if not is_local_address(grpc_address) and token is None and not mtls:
        raise ValueError(
            f"--grpc {grpc_address} listens beyond this machine: give --auth-token-file or "
            "--tls-cert/--tls-key/--tls-client-ca (mutual TLS), or listen on 127.0.0.1")


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """Mutual TLS from PEM files: the server's certificate and key, and the CA of its clients."""
    def read(path):
        with open(path, "rb") as file:
            return file.read()
    return grpc.ssl_server_credentials([(read(key), read(cert))], root_certificates=read(client_ca),
                                       require_client_auth=True)
