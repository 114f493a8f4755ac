"""Protobuf messages to domain objects and back; nothing else."""

import time

from vcap.policy import Bucket, InvalidPolicy, Policy, default_policy
from vcap.v1 import controller_pb2 as pb

from .engine_link import NodeStatus
from .history import HistoryEntry
from .policy_control import PolicyRejection, PolicyState
from .telemetry import Totals

__all__ = ["policy_from_proto", "policy_to_proto", "state_to_proto", "stats_to_proto", "rejection_to_proto",
           "history_to_proto", "CONTROL_MODE_NAMES"]

_MODE_TO_PROTO = {"off": pb.MODE_OFF, "fixed": pb.MODE_FIXED, "conf": pb.MODE_CONF}
_MODE_FROM_PROTO = {value: name for name, value in _MODE_TO_PROTO.items()}
_SOURCE_TO_PROTO = {"engine": pb.POLICY_SOURCE_ENGINE, "manual": pb.POLICY_SOURCE_MANUAL,
                    "auto": pb.POLICY_SOURCE_AUTO, "file": pb.POLICY_SOURCE_FILE}
CONTROL_MODE_NAMES = {pb.CONTROL_MODE_MANUAL: "manual", pb.CONTROL_MODE_AUTO: "auto"}
_CONTROL_TO_PROTO = {name: value for value, name in CONTROL_MODE_NAMES.items()}


def policy_from_proto(message: pb.Policy) -> Policy:
    """Raises InvalidPolicy for what cannot be expressed in the domain (a missing mode)."""
    if message.mode not in _MODE_FROM_PROTO:
        raise InvalidPolicy(f"mode is required (off, fixed or conf), got enum value {message.mode}")
    if message.mode == pb.MODE_CONF and not message.buckets:
        raise InvalidPolicy("conf mode needs its buckets (at least one, starting at min_bs 1)")
    buckets = tuple(
        Bucket(min_bs=b.min_bs, k_min=b.k_min or 1, k_max=b.k_max, thresholds=tuple(b.thresholds))
        for b in message.buckets)
    return Policy(mode=_MODE_FROM_PROTO[message.mode], fixed_k=message.fixed_k,
                  buckets=buckets or default_policy().buckets,  # off and fixed need none
                  explore_period=message.explore_period)


def policy_to_proto(policy: Policy) -> pb.Policy:
    return pb.Policy(
        mode=_MODE_TO_PROTO.get(policy.mode, pb.MODE_UNSPECIFIED), fixed_k=policy.fixed_k,
        explore_period=policy.explore_period,
        buckets=[pb.Bucket(min_bs=b.min_bs, k_min=b.k_min, k_max=b.k_max, thresholds=b.thresholds)
                 for b in policy.buckets])


def rejection_to_proto(rejection: PolicyRejection | None) -> pb.PolicyRejection | None:
    if rejection is None:
        return None
    return pb.PolicyRejection(generation=rejection.generation, source=_SOURCE_TO_PROTO[rejection.source],
                              who=rejection.who, reason=rejection.reason, time_unix=rejection.time_unix)


def state_to_proto(state: PolicyState) -> pb.PolicyState:
    return pb.PolicyState(
        policy=policy_to_proto(state.policy), generation=state.generation,
        source=_SOURCE_TO_PROTO[state.source], control_mode=_CONTROL_TO_PROTO[state.control_mode],
        engine_attached=state.engine_attached, num_drafts=state.num_drafts, max_bs=state.max_bs,
        pending=state.pending, segment=state.segment, last_rejected=rejection_to_proto(state.last_rejected))


def history_to_proto(entries: list[HistoryEntry], max_entries: int, path: str | None) -> pb.PolicyHistory:
    return pb.PolicyHistory(max_entries=max_entries, path=path or "", entries=[
        pb.PolicyHistoryEntry(generation=e.generation, source=_SOURCE_TO_PROTO.get(e.source, 0), who=e.who,
                              reason=e.reason, time_unix=e.time_unix, policy=policy_to_proto(e.policy),
                              rollback_of=e.rollback_of) for e in entries])


def stats_to_proto(engine: NodeStatus, totals: Totals | None, steps_per_second: float,
                   policy_generation: int, watch_updates_dropped: int,
                   last_rejected: PolicyRejection | None = None) -> pb.Stats:
    message = pb.Stats(
        timestamp_unix=time.time(), engine_attached=engine.attached, engine_pid=engine.pid,
        engine_alive=engine.alive, engine_fallback_active=engine.fallback_active,
        policy_generation=policy_generation, telemetry_dropped=engine.telemetry_dropped,
        watch_updates_dropped=watch_updates_dropped, last_rejected=rejection_to_proto(last_rejected))
    if totals is None:
        return message
    requests = max(totals.requests, 1)
    message.MergeFrom(pb.Stats(
        last_generation_seen=totals.last_generation, verify_steps=totals.steps,
        rows_live=totals.rows_live, rows_dead=totals.rows_dead,
        drafts_accepted=totals.drafts_accepted, accepts_at_cap=totals.accepts_at_cap,
        committed_tokens=totals.committed_tokens,
        experts_streamed=int(totals.layer_streamed.sum()), experts_saved=int(totals.layer_saved.sum()),
        expert_sampled_steps=totals.sampled_steps, mean_live_length=totals.rows_live / requests,
        mean_accepted_drafts=totals.drafts_accepted / requests, guard_violations=totals.guard_violations,
        steps_per_second=steps_per_second, acceptance_by_position=totals.acceptance_by_position()))
    return message
