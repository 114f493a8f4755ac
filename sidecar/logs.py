"""Rate-limited logging: a line repeated within :data:`WINDOW_S` is logged once, and the next
one after the window says how many were held back (issue 16.8: a failing loop logged 1,767
tracebacks in 10 s). The audit log is never limited."""

import logging
import threading
import time

__all__ = ["RateLimit", "rate_limit", "WINDOW_S"]

WINDOW_S = 10.0
_MAX_KEYS = 1024


class RateLimit(logging.Filter):
    """Passes the first of identical records (same logger, level, message and exception type)
    per ``window_s``; counts the rest and reports the count on the next one that passes."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._seen: dict[tuple, list] = {}   # key -> [first passed at, held back since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        try:
            message = record.getMessage()
        except Exception:  # a bad format string is the handler's to report
            return True
        key = (record.name, record.levelno, message, error)
        now = self.clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.window_s:
                entry[1] += 1
                return False
            held = entry[1] if entry is not None else 0
            if len(self._seen) >= _MAX_KEYS:
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
            self._seen[key] = [now, 0]
        if held:
            record.msg, record.args = f"{message} ({held} identical lines held back)", None
        return True


def rate_limit(logger: logging.Logger, window_s: float = WINDOW_S) -> RateLimit:
    """Install (once) a :class:`RateLimit` on ``logger`` and its ``.sidecar`` child."""
    for target in (logger, logging.getLogger(f"{logger.name}.sidecar")):
        for existing in target.filters:
            if isinstance(existing, RateLimit):
                break
        else:
            target.addFilter(RateLimit(window_s))
    return next(f for f in logging.getLogger(f"{logger.name}.sidecar").filters if isinstance(f, RateLimit))
