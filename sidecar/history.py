"""The last policies the sidecar applied, kept across its restarts (``vcapctl history``/``rollback``).

One JSON object per line, appended on every accepted change (``generation``, ``source``,
``who``, ``reason``, ``time_unix``, ``policy``, ``rollback_of``). The file is bounded: once it
holds twice :attr:`PolicyHistory.max_entries` lines or more than ``max_bytes``, it is rewritten
with the newest entries (a temporary file renamed over it, so a crash leaves the old or the new
one whole). A line that does not parse (a write cut by a crash, a hand edit) is skipped and
logged. The file is created on the first change, mode 0600, never through a symlink, and
refused when another user owns it (``/dev/shm`` is shared by every local user): the history
then lives in memory only, which is said once.
"""

import json
import logging
import os
import time
from collections import deque
from dataclasses import asdict, dataclass

from vcap.layout import MAX_BUCKETS
from vcap.policy import Bucket, Policy, validate

from .files import open_regular

__all__ = ["PolicyHistory", "HistoryEntry", "UnknownGeneration", "default_history_path",
           "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_BYTES"]

log = logging.getLogger("vcap.sidecar")
DEFAULT_MAX_ENTRIES = 100
DEFAULT_MAX_BYTES = 4 << 20   # 100 entries of the largest geometry (64 buckets of 254 thresholds) fit
MAX_TEXT = 1024               # who and reason, as kept
MAX_GENERATION = (1 << 32) - 1


class UnknownGeneration(LookupError):
    """A rollback to a generation the history does not hold."""


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    generation: int
    source: str
    who: str
    reason: str
    time_unix: float
    policy: Policy
    rollback_of: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=True)

    @staticmethod
    def from_json(line: str) -> "HistoryEntry":
        """Raises ValueError (or KeyError/TypeError) on a line that is not an entry."""
        data = json.loads(line)
        raw = data["policy"]
        policy = Policy(mode=str(raw["mode"]), fixed_k=int(raw["fixed_k"]),
                        buckets=tuple(Bucket(int(b["min_bs"]), int(b["k_min"]), int(b["k_max"]),
                                             tuple(float(t) for t in b["thresholds"])) for b in raw["buckets"]),
                        explore_period=int(raw["explore_period"]))
        validate(policy, None, MAX_BUCKETS)   # a hand edit must not reach the engine by a rollback
        generation, rollback_of = int(data["generation"]), int(data.get("rollback_of", 0))
        # generations are the control block's u32 words; 0 is "none"
        if not 0 < generation <= MAX_GENERATION or not 0 <= rollback_of <= MAX_GENERATION:
            raise ValueError(f"generation {generation} or rollback_of {rollback_of} outside 1..{MAX_GENERATION}")
        return HistoryEntry(generation, str(data["source"]), str(data["who"])[:MAX_TEXT],
                            str(data["reason"])[:MAX_TEXT], float(data["time_unix"]), policy, rollback_of)


def default_history_path(segment_name: str) -> str:
    """Beside the segment: ``/dev/shm/<name>.history`` (Kubernetes keeps it across a sidecar's
    restart, as it keeps the segment)."""
    return (segment_name if os.sep in segment_name else os.path.join("/dev/shm", segment_name)) + ".history"


class PolicyHistory:
    """The newest ``max_entries`` entries, in memory and (with a ``path``) in a JSON-lines file.

    Not thread safe: PolicyControl calls it under its lock.
    """

    def __init__(self, path: str | None = None, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 2 or max_bytes < 4096:
            raise ValueError(f"need history max_entries >= 2 and max_bytes >= 4096, got {max_entries}, {max_bytes}")
        self.path, self.max_entries, self.max_bytes = path or None, max_entries, max_bytes
        self.entries: deque[HistoryEntry] = deque(maxlen=max_entries)
        self._lines = 0   # lines in the file now
        self._torn_tail = False
        if self.path:
            self._load()

    @property
    def newest_generation(self) -> int:
        return max((entry.generation for entry in self.entries), default=0)

    def append(self, entry: HistoryEntry) -> None:
        entry = HistoryEntry(entry.generation, entry.source, entry.who[:MAX_TEXT], entry.reason[:MAX_TEXT],
                             entry.time_unix, entry.policy, entry.rollback_of)
        self.entries.append(entry)
        if not self.path:
            return
        try:
            if self._lines + 1 >= 2 * self.max_entries or self._size() > self.max_bytes:
                self._rewrite()
            else:
                fd = self._open(os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                with os.fdopen(fd, "a", encoding="ascii") as file:
                    file.write(("\n" if self._torn_tail else "") + entry.to_json() + "\n")
                self._torn_tail = False
                self._lines += 1
        except (OSError, ValueError) as error:
            log.error("policy history %s: %s; keeping it in memory only from now", self.path, error)
            self.path = None

    def newest(self, limit: int = 0) -> list[HistoryEntry]:
        entries = list(reversed(self.entries))
        return entries[:limit] if limit else entries

    def find(self, generation: int) -> HistoryEntry:
        """Raises UnknownGeneration naming the generations kept."""
        for entry in reversed(self.entries):
            if entry.generation == generation:
                return entry
        raise UnknownGeneration(f"generation {generation} is not in the policy history ({self._kept()})")

    def before(self, generation: int, policy: Policy | None) -> HistoryEntry:
        """The newest entry older than ``generation`` whose policy differs from ``policy``.

        Raises:
            UnknownGeneration: there is none.
        """
        for entry in reversed(self.entries):
            if entry.generation < generation and entry.policy != policy:
                return entry
        raise UnknownGeneration(f"no other policy before generation {generation} in the policy history "
                                f"({self._kept()})")

    # -- the file --------------------------------------------------------------------------------

    def kept_control_mode(self) -> str | None:
        """The control mode :meth:`save_control_mode` kept beside the file (``manual`` or
        ``auto``), so that a restarted sidecar resumes it; None without a file or a valid one."""
        if not self.path:
            return None
        try:
            fd = self._open(os.O_RDONLY, self.path + ".mode")
            with os.fdopen(fd, "rb") as file:
                mode = file.read(16).decode("ascii", errors="replace").strip()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("control mode %s.mode: %s; starting in manual mode", self.path, error)
            return None
        if mode not in ("manual", "auto"):
            log.warning("control mode %s.mode holds %r, not manual or auto; starting in manual mode", self.path, mode)
            return None
        return mode

    def save_control_mode(self, mode: str) -> None:
        """Keep ``mode`` beside the file (written whole: a temporary file renamed over it)."""
        if not self.path:
            return
        temporary = f"{self.path}.mode.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as file:
                file.write(mode + "\n")
            os.replace(temporary, self.path + ".mode")
        except OSError as error:
            log.error("control mode %s.mode: %s; a restart starts in manual mode", self.path, error)
            if os.path.lexists(temporary):
                os.unlink(temporary)

    def _kept(self) -> str:
        if not self.entries:
            return "it is empty"
        return f"it keeps generations {self.entries[0].generation}..{self.entries[-1].generation}"

    def _open(self, flags: int, path: str | None = None) -> int:
        """An fd of the file (or ``path`` beside it), never through a symlink, refused when
        another user owns it."""
        fd = open_regular(path or self.path, flags, follow_symlinks=False)   # a FIFO would block the start
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            os.close(fd)
            raise ValueError(f"owned by uid {info.st_uid}, not this process's {os.geteuid()}; remove it or "
                             "give another --state-dir")
        return fd

    def _size(self) -> int:
        try:
            return os.lstat(self.path).st_size
        except FileNotFoundError:
            return 0

    def _load(self) -> None:
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            log.error("policy history %s: %s; keeping it in memory only", self.path, error)
            self.path = None
            return
        with os.fdopen(fd, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size > self.max_bytes:   # only the tail can hold the newest entries
                file.seek(size - self.max_bytes)
                file.readline()
            data = file.read(self.max_bytes)
        lines = data.splitlines()
        # a line a crash cut short: the next append starts a new line, or both would be lost
        self._torn_tail = bool(data) and not data.endswith(b"\n")
        skipped = 0
        for line in lines:
            try:
                self.entries.append(HistoryEntry.from_json(line.decode("ascii")))
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
                skipped += 1
        self._lines = len(lines)
        if skipped:
            log.warning("policy history %s: skipped %d line(s) that are not entries", self.path, skipped)

    def _rewrite(self) -> None:
        kept, size = [], 0
        for entry in reversed(self.entries):
            line = entry.to_json() + "\n"
            if kept and size + len(line) > self.max_bytes // 2:
                break
            kept.append(line)
            size += len(line)
        temporary = f"{self.path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as file:
                file.writelines(reversed(kept))
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.lexists(temporary):
                os.unlink(temporary)
            raise
        self._lines = len(kept)
