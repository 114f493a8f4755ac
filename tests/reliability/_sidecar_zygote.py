"""Forks sidecars on demand for the crash soak (tests/reliability/test_sidecar_crash.py).

Started once; it imports everything, then forks one sidecar per ``spawn`` line on stdin, so a
restart costs what a sidecar's own start costs, not a Python start. Every sidecar writes JSON
lines to stdout (one ``os.write`` each: atomic on a pipe):

- ``{"event": "forked", "pid", "t_ns"}`` from the zygote, at once
- ``{"event": "attached", "pid", "port", "attach_s", "generation", "source", "policy_ok"}``
- ``{"event": "writing", "pid", "generation", "t_ns"}`` before each policy write begins
- ``{"event": "wrote", "pid", "generation", "t_ns"}`` after each complete policy write
  (``t_ns``: when that write began)
- ``{"event": "paused", "pid", "generation", "t_ns"}`` inside the write number ``pause_at``
  (the seqlock is odd; the sidecar sleeps there until it is killed)

The sidecar is ``vcap.sidecar.app.Sidecar`` with ``write_pause=``; it writes
``policy_for(generation)`` through ``PolicyControl.set_policy``, as a gRPC SetPolicy would.
"""

import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.reliability._helpers import policy_for  # noqa: E402
from vcap.sidecar.app import Sidecar, SidecarConfig  # noqa: E402
from vcap.sidecar.convert import policy_to_proto  # noqa: E402


def _say(**fields) -> None:
    os.write(1, (json.dumps(fields) + "\n").encode())


def _child(segment: str, seed: int, pause_at: int) -> None:
    started = time.monotonic()
    rng = random.Random(seed)
    writes = [0]

    def pause():
        writes[0] += 1
        if writes[0] == pause_at:
            _say(event="paused", pid=os.getpid(), generation=sidecar.control.generation,
                 t_ns=time.monotonic_ns())
            time.sleep(3600)

    sidecar = Sidecar(SidecarConfig(segment=segment, grpc_address="127.0.0.1:0", metrics_address="",
                                    poll_s=0.005), write_pause=pause)
    sidecar.start(timeout=30)
    while not sidecar.link.attach_count:  # set once the policy in force was adopted
        time.sleep(0.001)
    state = sidecar.control.state()
    _say(event="attached", pid=os.getpid(), port=sidecar.grpc_port,
         attach_s=time.monotonic() - started, generation=state.generation, source=state.source,
         policy=policy_to_proto(state.policy).SerializeToString().hex())
    while True:
        time.sleep(rng.uniform(0.0, 0.03))
        generation = sidecar.control.generation + 1
        began = time.monotonic_ns()
        # announced before it starts: a sidecar killed between its write and "wrote" still said so
        _say(event="writing", pid=os.getpid(), generation=generation, t_ns=began)
        sidecar.control.set_policy(policy_for(generation), "manual", who="crash-soak")
        _say(event="wrote", pid=os.getpid(), generation=generation, t_ns=began)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    segment = sys.argv[1]
    _say(event="ready", pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        child = os.fork()
        if child:
            _say(event="forked", pid=child, t_ns=time.monotonic_ns())
        else:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _child(segment, command["seed"], command.get("pause_at", 0))
            finally:
                os._exit(1)


if __name__ == "__main__":
    main()
