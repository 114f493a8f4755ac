from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_OFF: _ClassVar[Mode]
    MODE_FIXED: _ClassVar[Mode]
    MODE_CONF: _ClassVar[Mode]

class PolicySource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_SOURCE_UNSPECIFIED: _ClassVar[PolicySource]
    POLICY_SOURCE_ENGINE: _ClassVar[PolicySource]
    POLICY_SOURCE_MANUAL: _ClassVar[PolicySource]
    POLICY_SOURCE_AUTO: _ClassVar[PolicySource]
    POLICY_SOURCE_FILE: _ClassVar[PolicySource]

class ControlMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_MODE_UNSPECIFIED: _ClassVar[ControlMode]
    CONTROL_MODE_MANUAL: _ClassVar[ControlMode]
    CONTROL_MODE_AUTO: _ClassVar[ControlMode]
MODE_UNSPECIFIED: Mode
MODE_OFF: Mode
MODE_FIXED: Mode
MODE_CONF: Mode
POLICY_SOURCE_UNSPECIFIED: PolicySource
POLICY_SOURCE_ENGINE: PolicySource
POLICY_SOURCE_MANUAL: PolicySource
POLICY_SOURCE_AUTO: PolicySource
POLICY_SOURCE_FILE: PolicySource
CONTROL_MODE_UNSPECIFIED: ControlMode
CONTROL_MODE_MANUAL: ControlMode
CONTROL_MODE_AUTO: ControlMode

class Bucket(_message.Message):
    __slots__ = ("min_bs", "k_min", "k_max", "thresholds")
    MIN_BS_FIELD_NUMBER: _ClassVar[int]
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    K_MAX_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    min_bs: int
    k_min: int
    k_max: int
    thresholds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, min_bs: _Optional[int] = ..., k_min: _Optional[int] = ..., k_max: _Optional[int] = ..., thresholds: _Optional[_Iterable[float]] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("mode", "fixed_k", "buckets", "explore_period")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FIXED_K_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    EXPLORE_PERIOD_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    fixed_k: int
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    explore_period: int
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., fixed_k: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., explore_period: _Optional[int] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyState(_message.Message):
    __slots__ = ("policy", "generation", "source", "control_mode", "engine_attached", "num_drafts", "max_bs", "pending", "segment", "last_rejected")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_REJECTED_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    generation: int
    source: PolicySource
    control_mode: ControlMode
    engine_attached: bool
    num_drafts: int
    max_bs: int
    pending: bool
    segment: str
    last_rejected: PolicyRejection
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ..., generation: _Optional[int] = ..., source: _Optional[_Union[PolicySource, str]] = ..., control_mode: _Optional[_Union[ControlMode, str]] = ..., engine_attached: _Optional[bool] = ..., num_drafts: _Optional[int] = ..., max_bs: _Optional[int] = ..., pending: _Optional[bool] = ..., segment: _Optional[str] = ..., last_rejected: _Optional[_Union[PolicyRejection, _Mapping]] = ...) -> None: ...

class PolicyRejection(_message.Message):
    __slots__ = ("generation", "source", "who", "reason", "time_unix")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    generation: int
    source: PolicySource
    who: str
    reason: str
    time_unix: float
    def __init__(self, generation: _Optional[int] = ..., source: _Optional[_Union[PolicySource, str]] = ..., who: _Optional[str] = ..., reason: _Optional[str] = ..., time_unix: _Optional[float] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy", "expected_generation", "reason")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    expected_generation: int
    reason: str
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ..., expected_generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SetControlModeRequest(_message.Message):
    __slots__ = ("control_mode",)
    CONTROL_MODE_FIELD_NUMBER: _ClassVar[int]
    control_mode: ControlMode
    def __init__(self, control_mode: _Optional[_Union[ControlMode, str]] = ...) -> None: ...

class ListPolicyHistoryRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class PolicyHistoryEntry(_message.Message):
    __slots__ = ("generation", "source", "who", "reason", "time_unix", "policy", "rollback_of")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_OF_FIELD_NUMBER: _ClassVar[int]
    generation: int
    source: PolicySource
    who: str
    reason: str
    time_unix: float
    policy: Policy
    rollback_of: int
    def __init__(self, generation: _Optional[int] = ..., source: _Optional[_Union[PolicySource, str]] = ..., who: _Optional[str] = ..., reason: _Optional[str] = ..., time_unix: _Optional[float] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., rollback_of: _Optional[int] = ...) -> None: ...

class PolicyHistory(_message.Message):
    __slots__ = ("entries", "max_entries", "path")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PolicyHistoryEntry]
    max_entries: int
    path: str
    def __init__(self, entries: _Optional[_Iterable[_Union[PolicyHistoryEntry, _Mapping]]] = ..., max_entries: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("generation", "expected_generation", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    expected_generation: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., expected_generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("timestamp_unix", "engine_attached", "engine_pid", "engine_alive", "engine_fallback_active", "policy_generation", "last_generation_seen", "verify_steps", "rows_live", "rows_dead", "drafts_accepted", "accepts_at_cap", "committed_tokens", "experts_streamed", "experts_saved", "expert_sampled_steps", "telemetry_dropped", "steps_per_second", "mean_live_length", "mean_accepted_drafts", "acceptance_by_position", "guard_violations", "watch_updates_dropped", "last_rejected")
    TIMESTAMP_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FALLBACK_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    POLICY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_GENERATION_SEEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_LIVE_FIELD_NUMBER: _ClassVar[int]
    ROWS_DEAD_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_AT_CAP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_STREAMED_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_SAVED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SAMPLED_STEPS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_LIVE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    GUARD_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    WATCH_UPDATES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_REJECTED_FIELD_NUMBER: _ClassVar[int]
    timestamp_unix: float
    engine_attached: bool
    engine_pid: int
    engine_alive: bool
    engine_fallback_active: bool
    policy_generation: int
    last_generation_seen: int
    verify_steps: int
    rows_live: int
    rows_dead: int
    drafts_accepted: int
    accepts_at_cap: int
    committed_tokens: int
    experts_streamed: int
    experts_saved: int
    expert_sampled_steps: int
    telemetry_dropped: int
    steps_per_second: float
    mean_live_length: float
    mean_accepted_drafts: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    guard_violations: int
    watch_updates_dropped: int
    last_rejected: PolicyRejection
    def __init__(self, timestamp_unix: _Optional[float] = ..., engine_attached: _Optional[bool] = ..., engine_pid: _Optional[int] = ..., engine_alive: _Optional[bool] = ..., engine_fallback_active: _Optional[bool] = ..., policy_generation: _Optional[int] = ..., last_generation_seen: _Optional[int] = ..., verify_steps: _Optional[int] = ..., rows_live: _Optional[int] = ..., rows_dead: _Optional[int] = ..., drafts_accepted: _Optional[int] = ..., accepts_at_cap: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., experts_streamed: _Optional[int] = ..., experts_saved: _Optional[int] = ..., expert_sampled_steps: _Optional[int] = ..., telemetry_dropped: _Optional[int] = ..., steps_per_second: _Optional[float] = ..., mean_live_length: _Optional[float] = ..., mean_accepted_drafts: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., guard_violations: _Optional[int] = ..., watch_updates_dropped: _Optional[int] = ..., last_rejected: _Optional[_Union[PolicyRejection, _Mapping]] = ...) -> None: ...
