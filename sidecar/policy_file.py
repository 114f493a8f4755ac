"""A policy file the sidecar watches (``--policy-file``, e.g. a mounted ConfigMap).

The file applies when the sidecar starts and whenever its content changes; a gRPC change
overrides it until then. A sidecar that restarts with the file unchanged since it applied it (the
policy history records each applied content's digest) keeps the policy in force, which may be a
later gRPC change; on a new engine's segment, which holds none, the file applies. An invalid file is rejected whole, whatever is wrong with it (too big,
nested too deep, numbers out of any range, not YAML): the last good policy stays in force, and
the rejection is logged, counted (``vcap_policy_rejections_total{source="file"}``) and reported as
the last rejection in GetPolicy and WatchStats. Kubernetes updates a ConfigMap volume by swapping a symlink, so the
watcher compares content, not modification times. Format (YAML or JSON)::

    mode: conf            # off | fixed | conf
    fixed_k: 3
    explore_period: 0
    buckets:
      - {min_bs: 1, k_min: 1, k_max: 5, thresholds: [0.0, 0.5, 0.3, 0.2, 0.1]}
      - {min_bs: 32, thresholds: [0.3]}
"""

import hashlib
import logging
import struct

import yaml

from vcap.policy import Bucket, InvalidPolicy, Policy

from .files import read_regular
from .history import MAX_TEXT

__all__ = ["PolicyFileWatcher", "parse_policy", "MAX_FILE_BYTES", "MAX_DEPTH"]

log = logging.getLogger("vcap.sidecar")
# A policy of the largest geometry written out in YAML with comments fits easily.
MAX_FILE_BYTES = 256 * 1024
# mapping -> buckets list -> bucket mapping -> thresholds list, with room to spare
MAX_DEPTH = 8


def _float32(value) -> float:
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


def _depth(text: str) -> int:
    """How deep the YAML nests, from its event stream (no recursion, no objects built)."""
    depth = deepest = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return deepest


def parse_policy(text: str) -> Policy:
    """A Policy from the file's text. Raises InvalidPolicy naming what is wrong; nothing else."""
    if len(text) > MAX_FILE_BYTES:
        raise InvalidPolicy(f"the file has {len(text)} characters, more than a policy needs ({MAX_FILE_BYTES})")
    try:
        if _depth(text) > MAX_DEPTH:
            raise InvalidPolicy(f"nested deeper than {MAX_DEPTH} levels; a policy is 4 deep")
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InvalidPolicy(f"not YAML/JSON: {error}") from None
    except (ValueError, OverflowError, RecursionError, MemoryError) as error:
        if isinstance(error, InvalidPolicy):
            raise
        raise InvalidPolicy(f"not a policy: {type(error).__name__}: {str(error)[:200]}") from None
    if not isinstance(data, dict):
        raise InvalidPolicy("the policy file must hold a mapping with at least 'mode'")
    unknown = set(data) - {"mode", "fixed_k", "explore_period", "buckets"}
    if unknown:
        raise InvalidPolicy(f"unknown keys: {', '.join(sorted(unknown))}")
    try:
        buckets = tuple(
            Bucket(min_bs=int(b.get("min_bs", 1)), k_min=int(b.get("k_min", 1)),
                   k_max=int(b.get("k_max", 0)),
                   thresholds=tuple(_float32(t) for t in b.get("thresholds", [0.0])))
            for b in data.get("buckets") or [{}])
        return Policy(mode=str(data.get("mode", "")), fixed_k=int(data.get("fixed_k", 0)),
                      buckets=buckets, explore_period=int(data.get("explore_period", 0)))
    except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as error:
        raise InvalidPolicy(f"malformed policy file: {type(error).__name__}: {str(error)[:200]}") from None


class PolicyFileWatcher:
    """Applies the file's policy (source ``file``) whenever its content changes."""

    def __init__(self, path: str, control):
        self.path, self.control = path, control
        self._digest = None
        self.last_error = ""

    def poll(self) -> None:
        try:
            content = read_regular(self.path, MAX_FILE_BYTES + 1)   # a FIFO would block the sidecar
        except OSError as error:
            self._report(f"cannot read {self.path}: {error}")
            return
        digest = hashlib.sha256(content).digest()
        if digest == self._digest:
            return
        reason = f"file content sha256:{digest.hex()[:16]}"
        if self._digest is None and self._applied_before(reason):
            # A restart with the file unchanged since it was applied: the policy in force may be a
            # later change (a manual one during an incident); keep it. A new engine's segment
            # holds none: the file applies there.
            state = self.control.state()
            if not state.engine_attached:
                return   # decide once the segment shows what is in force
            if state.source != "engine":
                self._digest = digest
                log.info("policy file %s unchanged since it was applied: keeping the policy in force "
                         "(generation %d, set by %s); edit the file to apply it again",
                         self.path, state.generation, state.source)
                return
        self._digest = digest
        try:
            policy = parse_policy(content.decode("utf-8", errors="replace"))
            self.control.set_policy(policy, "file", who=f"policy file {self.path}", reason=reason)
            self.last_error = ""
        except Exception as error:  # the boundary: no file may stop the sidecar
            reason = str(error) if isinstance(error, InvalidPolicy) else f"{type(error).__name__}: {error}"
            self.control.reject("file", f"policy file {self.path}", reason)
            self._report(f"{self.path}: rejected whole, the last good policy stays in force: {reason[:500]}")

    def _applied_before(self, reason: str) -> bool:
        """The policy history's newest entry from this file records this content."""
        who = f"policy file {self.path}"[:MAX_TEXT]
        with self.control.lock:
            entry = next((e for e in self.control.history.newest() if e.source == "file" and e.who == who), None)
        return entry is not None and entry.reason == reason

    def _report(self, message: str) -> None:
        if message != self.last_error:
            log.error("%s", message)
            self.last_error = message
