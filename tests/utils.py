"""Helpers shared by the tests."""

import importlib
import os
import socket
import sys
import time

import numpy as np

from vcap.policy import Bucket, Policy


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def import_bench(*names: str) -> tuple:
    """The modules of ``bench/`` named (scripts, not a package), imported with ``bench/`` on
    ``sys.path`` only while they load."""
    sys.path.insert(0, BENCH)
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(BENCH)


def policy_in_force(segment, timeout: float = 5.0):
    """``segment.read_policy()`` retried while a write is in flight (it reads None then), as the
    engine's reader keeps its last snapshot and tries again: a test that polls while the sidecar
    writes must not take the seqlock's "not now" for a missing policy."""
    deadline = time.monotonic() + timeout
    while (found := segment.read_policy()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the control block of {segment.path} stayed mid-write for {timeout} s")
        time.sleep(0.001)
    return found


_HANDED_OUT: set[int] = set()   # ports this test process has handed out: never one twice


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` free ports on 127.0.0.1, none handed out before in this process. The kernel can
    give a port again as soon as its socket closes, even to the next call, before the server it
    was taken for has bound it; two servers of one test then share a port (a Prometheus that binds
    first scrapes itself where the sidecar's metrics should be)."""
    held, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    _HANDED_OUT.update(ports)
    return ports


def wait_until(condition, timeout: float, what: str, ignore=(OSError,)):
    """Poll ``condition`` until it returns something truthy (returned); errors in ``ignore`` count as
    not yet. Raises AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except ignore:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_verbose_allclose(actual, expected, atol=0.0, rtol=0.0, max_print=5):
    """allclose that reports the mismatch count, the first bad indices and NaN disagreement."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    close = np.isclose(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    if close.all():
        return
    bad = np.argwhere(~close)
    lines = [f"{len(bad)} of {actual.size} elements differ (atol={atol}, rtol={rtol})"]
    for index in bad[:max_print]:
        index = tuple(index)
        lines.append(f"  at {index}: {actual[index]!r} vs {expected[index]!r}")
    nan_disagree = int((np.isnan(actual.astype(float)) != np.isnan(expected.astype(float))).sum())
    if nan_disagree:
        lines.append(f"  NaN in one but not the other at {nan_disagree} positions")
    raise AssertionError("\n".join(lines))


def random_policy(rng, stride: int, off: float = 0.0, fixed: float = 0.3) -> Policy:
    """SYNTHETIC: ``off`` with probability ``off``, a fixed k with ``fixed``, else ``conf`` with
    random descending thresholds (float32-exact) and random k bounds."""
    draw = rng.random()
    flat = (Bucket(1, 1, stride - 1, (0.0,) * (stride - 1)),)
    if draw < off:
        return Policy("off", 1, flat)
    if draw < off + fixed:
        return Policy("fixed", int(rng.integers(1, stride)), flat)
    thresholds = tuple(float(np.float32(t)) for t in np.sort(rng.random(stride - 1))[::-1] * 0.9)
    k_min = int(rng.integers(1, 3))
    return Policy("conf", 1, (Bucket(1, k_min, int(rng.integers(k_min, stride)), thresholds),))
