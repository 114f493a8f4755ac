"""Protobuf messages to domain objects and back; nothing else."""

from vcap.policy import Bucket, InvalidPolicy, Policy
from vcap.v1 import controller_pb2 as pb

from .control import PolicyState

__all__ = ["policy_from_proto", "policy_to_proto", "state_to_proto", "CONTROL_MODE_NAMES"]

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
    buckets = tuple(
        Bucket(min_bs=b.min_bs, k_min=b.k_min or 1, k_max=b.k_max, thresholds=tuple(b.thresholds))
        for b in message.buckets)
    if not buckets:  # off and fixed need none: verify up to every draft
        buckets = (Bucket(min_bs=1, k_min=1, k_max=0, thresholds=(0.0,)),)
    return Policy(mode=_MODE_FROM_PROTO[message.mode], fixed_k=message.fixed_k, buckets=buckets,
                  explore_period=message.explore_period)


def policy_to_proto(policy: Policy) -> pb.Policy:
    return pb.Policy(
        mode=_MODE_TO_PROTO.get(policy.mode, pb.MODE_UNSPECIFIED), fixed_k=policy.fixed_k,
        explore_period=policy.explore_period,
        buckets=[pb.Bucket(min_bs=b.min_bs, k_min=b.k_min, k_max=b.k_max, thresholds=b.thresholds)
                 for b in policy.buckets])


def state_to_proto(state: PolicyState) -> pb.PolicyState:
    return pb.PolicyState(
        policy=policy_to_proto(state.policy), generation=state.generation,
        source=_SOURCE_TO_PROTO[state.source], control_mode=_CONTROL_TO_PROTO[state.control_mode],
        engine_attached=state.engine_attached, num_drafts=state.num_drafts, max_bs=state.max_bs,
        pending=state.pending, segment=state.segment)
