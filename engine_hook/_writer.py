"""The selftest's second process: plain Python (no torch, no CUDA) rewriting the policy.

    python -m vcap.engine_hook._writer SEGMENT COUNT PERIOD_US

Writes generations 1..COUNT (until SIGTERM) (``policy_for``), bumps the lease heartbeat with each, and prints
one JSON line: the CLOCK_MONOTONIC time of each completed write.
"""

import json
import random
import signal
import sys
import time

from vcap.policy import Bucket, Policy
from vcap.segment import Segment

__all__ = ["policy_for"]


def policy_for(generation: int, num_drafts: int, max_buckets: int) -> Policy:
    """A valid policy that is a pure function of its generation (so a reader can check it)."""
    rng = random.Random(generation)
    mode = ("off", "fixed", "conf", "conf", "conf")[rng.randrange(5)]
    count = rng.randint(1, max_buckets)
    min_bs = sorted(rng.sample(range(2, 64), count - 1))
    buckets = []
    for start in [1] + min_bs:
        k_min = rng.randint(1, num_drafts)
        k_max = rng.randint(k_min, num_drafts)
        thresholds = tuple(round(rng.random() ** 2, 4) for _ in range(num_drafts))
        buckets.append(Bucket(start, k_min, k_max, thresholds))
    return Policy(mode=mode, fixed_k=rng.randint(1, num_drafts), buckets=tuple(buckets),
                  explore_period=rng.choice((0, 0, 0, 3)))


def main(argv=None) -> None:
    name, count, period_us = (argv or sys.argv[1:])[:3]
    segment = Segment.attach(name)
    config = segment.config
    period_ns = int(float(period_us) * 1000)
    times, stop = [], []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    next_ns = time.monotonic_ns()
    for generation in range(1, int(count) + 1):
        if stop:
            break
        segment.write_policy(policy_for(generation, config.num_drafts, config.max_buckets), generation, "auto")
        segment.renew_lease()
        times.append(time.monotonic_ns())
        next_ns += period_ns
        while time.monotonic_ns() < next_ns:
            pass
    print(json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
