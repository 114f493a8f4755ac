"""The policy the sidecar wants in force, and the rules for changing it.

Every change is validated whole before anything is written; a change that names an expected
generation applies only if that is still the current one. A policy accepted before any engine
attached is kept and written on attach, and again when the engine is replaced. A sidecar that
starts next to a running engine adopts the policy it finds in the segment.

Every accepted change goes to the policy history (``history.py``), which a rollback reads; a
refused one (invalid request or policy file) is kept as the last rejection, Envoy-style: the
policy in force stays and the API says what was refused and why. Generations continue from the
history, so they are not reused across restarts.

Under attention DP the node has one segment per DP rank and one policy: every write goes into
every attached segment with one generation, after the checks that could refuse it (a truncated
segment refuses the whole change). A DP rank whose segment is missing gets the policy when it
attaches (``pending`` says one is still to come), as a late engine does.
"""

import json
import logging
import threading
import time
from dataclasses import dataclass

from vcap.policy import InvalidPolicy, Policy, default_policy, describe, validate, validated
from vcap.segment import CONTROL_GENERATION, SOURCES, Segment, SegmentError, SegmentTruncated

from .history import HistoryEntry, PolicyHistory

__all__ = ["PolicyControl", "PolicyState", "PolicyRejection", "StaleGeneration", "CONTROL_MODES", "audit_text"]

audit_log = logging.getLogger("vcap.audit")
log = logging.getLogger("vcap.sidecar")

CONTROL_MODES = ("manual", "auto")
# Longest caller-given text (a reason, a certificate's name) kept in one audit line.
MAX_AUDIT_TEXT = 200


def audit_text(text: str) -> str:
    """Caller-given text for the audit log: escaped as in a JSON string (a newline cannot forge
    a line, a control character cannot hide one), at most MAX_AUDIT_TEXT characters of it."""
    cut = f"...({len(text)} chars)" if len(text) > MAX_AUDIT_TEXT else ""
    return json.dumps(text[:MAX_AUDIT_TEXT], ensure_ascii=True)[1:-1] + cut


class StaleGeneration(Exception):
    """The caller's expected generation is no longer the current one."""


@dataclass(frozen=True, slots=True)
class PolicyRejection:
    """A policy refused whole; ``generation`` is the one in force then, which stayed."""

    generation: int
    source: str
    who: str
    reason: str
    time_unix: float


@dataclass(frozen=True, slots=True)
class PolicyState:
    policy: Policy
    generation: int
    source: str          # engine, manual, auto, file
    control_mode: str    # manual, auto
    engine_attached: bool
    num_drafts: int
    max_bs: int
    pending: bool
    segment: str
    last_rejected: PolicyRejection | None = None


class PolicyControl:
    """Holds the desired policy and writes it into the attached segment's control block."""

    def __init__(self, segment_name: str, write_pause=None, history: PolicyHistory | None = None,
                 dp_size: int = 1):
        self.segment_name, self.dp_size = segment_name, dp_size
        self.lock = threading.Lock()
        self.segments: dict[int, Segment] = {}   # by DP rank, the attached ones
        self._adopted: int | None = None   # generation of the policy adopted from a segment, until a change
        self.policy: Policy | None = None   # None: nothing chosen here, adopt the engine's
        self.history = history or PolicyHistory()
        self.generation = self.history.newest_generation
        self.last_rejected: PolicyRejection | None = None
        self.rejections_by_source = {"manual": 0, "auto": 0, "file": 0}
        self.source = "engine"
        self.control_mode = "manual"
        if self.history.kept_control_mode() == "auto":   # as it was before a restart
            self.control_mode = "auto"
            log.info("control mode auto, as before the sidecar restarted (kept in %s.mode)", self.history.path)
        self.pending = False
        # why the link cannot attach: another sidecar writes the segment (its lock is held)
        self.driven_by_another: str | None = None
        self.changes_by_source = {"manual": 0, "auto": 0, "file": 0}
        self._write_pause = write_pause  # test hook: called in the middle of a write

    # -- called by the engine link -----------------------------------------------------------

    @property
    def segment(self) -> Segment | None:
        """The lowest DP rank's attached segment (the node's geometry), or None."""
        return self.segments[min(self.segments)] if self.segments else None

    def _missing(self) -> bool:
        return len(self.segments) < self.dp_size

    def attach(self, segment: Segment, dp_rank: int = 0) -> None:
        """A (new) engine segment of DP rank ``dp_rank``: write our policy into every attached
        segment (one new generation for all), or adopt the one in force."""
        with self.lock:
            self.segments[dp_rank] = segment
            self.driven_by_another = None
            num_drafts, max_buckets = segment.config.num_drafts, segment.config.max_buckets
            # The raw generation word counts even in a block a dead sidecar left mid-write, so
            # generations are never reused; the body of such a block is never adopted.
            try:
                raw_generation = segment.read_u32(segment.layout.control_offset + 4 * CONTROL_GENERATION)
            except SegmentTruncated:
                raw_generation = 0  # the link detaches it at its next tick
            self.generation = max(self.generation, raw_generation)
            found, generation, source = segment.read_policy() or (None, 0, "engine")
            # A sidecar that died while writing the node left some segments one policy ahead:
            # the newest one found is the one to adopt.
            newer = self._adopted is not None and generation > self._adopted
            if (self.policy is None or newer) and found is not None and source in ("manual", "auto", "file"):
                try:
                    validate(found, num_drafts, max_buckets)
                    self.policy, self.source, self._adopted = found, source, generation
                    log.info("adopted the policy in force in %s (generation %d, set by %s)",
                             segment.path, generation, source)
                    if len(self.segments) > 1:  # the other ranks' segments get it too
                        self._write(found, source)
                    self.pending = self._missing()
                    return
                except InvalidPolicy as error:
                    log.error("not adopting the policy in %s: %s", segment.path, error)
            if self.policy is None:
                # A block left mid-write stays so: the engine runs its fallback until a policy
                # is set, which the next write (over the odd sequence) does.
                self.pending = False
                return
            try:
                resolved = validated(self.policy, num_drafts, max_buckets)
            except InvalidPolicy as error:
                log.error("kept policy does not fit the engine (%s); leaving the engine's in force", error)
                self.policy, self.source, self.pending = None, "engine", False
                return
            self.policy = resolved
            self._write(resolved, self.source)
            self.pending = self._missing()

    def locked_out(self, reason: str) -> None:
        """The segment exists and another sidecar writes it: until this one attaches, changes are
        refused, so none is queued to overwrite, on a later attach, the policy the other set."""
        with self.lock:
            self.driven_by_another = reason

    def detach(self, dp_rank: int = 0) -> None:
        with self.lock:
            self.segments.pop(dp_rank, None)
            self.pending = self.policy is not None

    # -- called by the API, the policy file and the controller -------------------------------

    def set_policy(self, policy: Policy, source: str, who: str,
                   expected_generation: int | None = None, reason: str = "") -> PolicyState:
        """Validate and apply a whole policy.

        Raises:
            InvalidPolicy: a field is wrong; nothing was written.
            StaleGeneration: ``expected_generation`` is not the current generation.
        """
        with self.lock:
            return self._set_locked(policy, source, who, expected_generation, reason)

    def rollback(self, generation: int, who: str, expected_generation: int | None = None,
                 reason: str = "") -> PolicyState:
        """Apply the policy of history entry ``generation`` again (0: the newest older one that
        differs from the policy in force), as a manual change through :meth:`set_policy`'s rules.

        Raises:
            UnknownGeneration: the history holds no such entry.
            InvalidPolicy: that policy does not fit the attached engine; nothing was written.
            StaleGeneration: as set_policy.
        """
        with self.lock:
            if generation:
                entry = self.history.find(generation)
            else:
                entry = self.history.before(self.generation + 1 if self.policy is None else self.generation,
                                            self.policy)
            why = f"rollback to generation {entry.generation}" + (f": {reason}" if reason else "")
            return self._set_locked(entry.policy, "manual", who, expected_generation, why,
                                    rollback_of=entry.generation)

    def reject(self, source: str, who: str, reason: str) -> None:
        """Keep a refused policy's reason (the policy in force stays); counted per source."""
        with self.lock:
            self.last_rejected = PolicyRejection(self.generation, source, who[:MAX_AUDIT_TEXT * 2],
                                                 reason[:1024], time.time())
            self.rejections_by_source[source] += 1

    def _set_locked(self, policy: Policy, source: str, who: str, expected_generation: int | None,
                    reason: str, rollback_of: int = 0) -> PolicyState:
        segment = self.segment
        if segment is None and self.driven_by_another:
            raise SegmentError(f"{self.driven_by_another}; this sidecar changes nothing while it does")
        num_drafts = segment.config.num_drafts if segment else None
        max_buckets = segment.config.max_buckets if segment else 8
        resolved = validated(policy, num_drafts, max_buckets)
        if expected_generation is not None and expected_generation != self.generation:
            raise StaleGeneration(
                f"expected generation {expected_generation}, current is {self.generation}")
        for attached in self.segments.values():   # every segment gets it, or none does
            if not attached.intact():
                raise SegmentError(f"{attached.path} is truncated; not writing until the engine restores it")
        old_policy, old_generation = self.policy, self.generation
        self._adopted = None
        if source == "manual" and self.control_mode == "auto":
            audit_log.info("control mode change by %s at %s: auto -> manual (a manual policy change)",
                           audit_text(who), time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            self.control_mode = "manual"
            self.history.save_control_mode("manual")
        if segment is not None:
            self._write(resolved, source)
            self.pending = self._missing()
        else:
            self.generation += 1
            self.pending = True
        self.policy, self.source = resolved, source
        self.changes_by_source[source] += 1
        self.history.append(HistoryEntry(self.generation, source, who, reason, time.time(), resolved,
                                         rollback_of))
        audit_log.info("policy change by %s via %s at %s: generation %d -> %d%s; old %s; new %s",
                       audit_text(who), source, time.strftime("%Y-%m-%dT%H:%M:%S%z"), old_generation,
                       self.generation, f" ({audit_text(reason)})" if reason else "", describe(old_policy),
                       describe(resolved))
        return self._state_locked()

    def set_control_mode(self, mode: str, who: str = "unknown") -> PolicyState:
        if mode not in CONTROL_MODES:
            raise InvalidPolicy(f"control mode must be one of {', '.join(CONTROL_MODES)}, got {mode!r}")
        with self.lock:
            if mode != self.control_mode:
                audit_log.info("control mode change by %s at %s: %s -> %s", audit_text(who),
                               time.strftime("%Y-%m-%dT%H:%M:%S%z"), self.control_mode, mode)
                self.history.save_control_mode(mode)
            self.control_mode = mode
            return self._state_locked()

    def state(self) -> PolicyState:
        with self.lock:
            return self._state_locked()

    # -- internals -----------------------------------------------------------------------------

    def _write(self, policy: Policy, source: str) -> None:
        """One new generation, written into every attached segment in DP-rank order. Each
        segment's seqlock keeps its readers from a torn block; a truncated segment is skipped
        (and one cut after this check is written through the file, never SIGBUS): the link
        detaches it, and its next attach writes the policy."""
        self.generation += 1
        for dp_rank in sorted(self.segments):
            segment = self.segments[dp_rank]
            if segment.intact():
                segment.write_policy(policy, self.generation, source, pause=self._write_pause)

    def _engine_policy(self, segment: Segment) -> Policy:
        """The policy the engine's blocks hold, if it is valid (every word there is untrusted:
        a negative min_bs once made GetPolicy answer UNKNOWN for every caller); else its
        default."""
        num_drafts, max_buckets = segment.config.num_drafts, segment.config.max_buckets
        try:
            blocks = (segment.read_policy(), segment.fallback_policy())
        except SegmentTruncated:  # the link detaches it at its next tick
            blocks = ()
        for found in blocks:
            if found is None or found[2] not in SOURCES:
                continue
            try:
                validate(found[0], num_drafts, max_buckets)
                return found[0]
            except InvalidPolicy:
                continue
        return default_policy(num_drafts)

    def _state_locked(self) -> PolicyState:
        segment = self.segment
        policy = self.policy
        if policy is None and segment is not None:
            policy = self._engine_policy(segment)
        if policy is None:  # no engine yet: every draft, whatever the engine's count
            policy = default_policy()
        return PolicyState(
            policy=policy, generation=self.generation, source=self.source,
            control_mode=self.control_mode, engine_attached=segment is not None and not self._missing(),
            num_drafts=segment.config.num_drafts if segment else 0,
            max_bs=segment.config.max_bs if segment else 0, pending=self.pending,
            segment=segment.path if segment else self.segment_name, last_rejected=self.last_rejected)
