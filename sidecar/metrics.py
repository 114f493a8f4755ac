"""Prometheus metrics of the sidecar, all under the ``vcap_`` namespace.

One collector per source (policy control, gRPC server, engine link, telemetry totals,
controller), each a table of :class:`Metric` read at scrape time: aggregation costs one numpy
pass per batch of records, not one call per request. The tables are the only list of names:
``describe()`` and :data:`METRIC_NAMES` derive from them. Expert counts come from sampled steps
only (``vcap_expert_sampled_steps_total`` counts them).

Under attention DP one sidecar serves every DP rank's segment: what each rank's engine does
(attached, alive, lease, rings, steps, rows, experts, dispatch) carries a ``dp_rank`` label, so
``sum without (dp_rank)`` (or ``sum by (job, instance)``) gives the node; the per-position,
per-layer and histogram families are the node's already.
"""

import time
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily)
from prometheus_client.registry import Collector

from .controller import ControllerReadings
from .controller.calibration import observed_drafts, uniform_bins
from .telemetry import STEP_SECONDS_BUCKETS, Totals

__all__ = ["METRIC_NAMES", "Metric", "SourceCollector", "build_registry", "calibration_report"]

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "info": InfoMetricFamily,
             "histogram": HistogramMetricFamily}


@dataclass(frozen=True, slots=True)
class Metric:
    """One family: ``read(source)`` gives its value, ``{label value: value}`` when ``label`` is
    set (``{(value, value): value}`` for a tuple of labels), a dict for an info, ``(counts,
    bounds, sum)`` for a histogram, or None (not exported now). Counters are named without
    ``_total``, infos without ``_info``."""

    name: str
    kind: str
    documentation: str
    read: Callable[[Any], Any]
    label: str | tuple[str, ...] | None = None

    @property
    def labels(self) -> list[str]:
        return [] if not self.label else [self.label] if isinstance(self.label, str) else list(self.label)

    @property
    def exposed_name(self) -> str:
        """The name as Prometheus shows it (dashboards and rules use these)."""
        return self.name + {"counter": "_total", "info": "_info"}.get(self.kind, "")

    def family(self, value=None):
        """The family with ``value``'s samples; an empty one (``describe``) without."""
        family = _FAMILIES[self.kind](self.name, self.documentation, labels=self.labels or None)
        if value is None:
            return family
        if self.label:
            for key, sample in value.items():
                family.add_metric([str(part) for part in key] if isinstance(key, tuple) else [str(key)], sample)
        elif self.kind == "info":
            family.add_metric([], value)
        elif self.kind == "histogram":
            family.add_metric([], _cumulative(*value[:2]), sum_value=value[2])
        else:
            family.add_metric([], value)
        return family


def _cumulative(counts, bounds) -> list[tuple[str, int]]:
    """Histogram buckets from per-bucket counts (the last entry: above the last bound)."""
    buckets, running = [], 0
    for bound, count in zip(bounds, counts):
        running += int(count)
        buckets.append((str(float(bound)), running))
    return buckets + [("+Inf", running + int(sum(counts[len(bounds):])))]


class SourceCollector(Collector):
    """The metrics of one source; ``source()`` is called once per scrape (None: export none)."""

    def __init__(self, metrics: tuple[Metric, ...], source: Callable[[], Any]):
        self.metrics, self.source = metrics, source

    def describe(self):
        return [metric.family() for metric in self.metrics]

    def collect(self):
        source = self.source()
        if source is None:
            return
        for metric in self.metrics:
            value = metric.read(source)
            if value is not None:
                yield metric.family(value)


def _age(monotonic: float | None) -> float:
    return time.monotonic() - monotonic if monotonic else float("nan")


def _policy_info(state) -> dict[str, str]:
    return {"mode": state.policy.mode, "source": state.source, "control": state.control_mode}


POLICY_METRICS = (   # source: PolicyControl
    Metric("vcap_policy_generation", "gauge", "Generation of the policy in force.", lambda c: c.state().generation),
    Metric("vcap_policy", "info", "The policy in force: mode, who set it, control mode.", lambda c: _policy_info(c.state())),
    Metric("vcap_policy_changes", "counter", "Accepted policy changes.", lambda c: dict(c.changes_by_source),
           label="source"),
    Metric("vcap_policy_rejections", "counter",
           "Policies refused whole, by source: invalid SetPolicy or Rollback (manual), rejected policy file (file); "
           "the policy in force stays.", lambda c: dict(c.rejections_by_source), label="source"),
    Metric("vcap_policy_last_rejection_timestamp_seconds", "gauge",
           "Unix time of the last policy refused (absent: none since the sidecar started).",
           lambda c: c.last_rejected.time_unix if c.last_rejected is not None else None),
)
SERVER_METRICS = (   # source: ControllerServicer
    Metric("vcap_watch_updates_dropped", "counter", "WatchStats updates skipped because a client read too slowly.",
           lambda s: s.watch_updates_dropped),
    Metric("vcap_watch_streams", "gauge", "WatchStats streams open now.", lambda s: s.watch_streams),
    Metric("vcap_watch_streams_refused", "counter",
           "WatchStats streams refused because the global or per-client limit was reached.",
           lambda s: s.watch_streams_refused),
)


def _by_rank(read: Callable[[Any], Any]) -> Callable[[Any], dict]:
    """``{dp_rank: read(rank)}`` over a node's ranks (NodeStatus or ``{dp_rank: Totals}``),
    without the ranks ``read`` gives None for."""
    def values(node) -> dict:
        ranks = node.items() if isinstance(node, dict) else ((rank.dp_rank, rank) for rank in node.ranks)
        return {dp_rank: value for dp_rank, rank in ranks if (value := read(rank)) is not None}
    return values


def _ring_counts(read: Callable[[Any], tuple[int, ...]]) -> Callable[[Any], dict]:
    return lambda node: {(rank.dp_rank, ring): count for rank in node.ranks for ring, count in enumerate(read(rank))}


ENGINE_METRICS = (   # source: NodeStatus, one EngineStatus per DP rank
    Metric("vcap_engine_attaches", "counter", "Times the sidecar attached to the DP rank's engine segment.",
           _by_rank(lambda e: e.attaches), label="dp_rank"),
    Metric("vcap_engine_attached", "gauge", "1 while attached to the DP rank's engine segment.",
           _by_rank(lambda e: int(e.attached)), label="dp_rank"),
    Metric("vcap_engine_alive", "gauge", "1 while the DP rank's attached engine process exists.",
           _by_rank(lambda e: int(e.alive)), label="dp_rank"),
    Metric("vcap_engine_fallback_active", "gauge", "1 while the DP rank's engine runs its fallback policy (lease expired).",
           _by_rank(lambda e: int(e.fallback_active)), label="dp_rank"),
    Metric("vcap_lease_renewal_age_seconds", "gauge", "Seconds since the sidecar last renewed the DP rank's lease.",
           _by_rank(lambda e: _age(e.last_renewal)), label="dp_rank"),
    Metric("vcap_telemetry_dropped", "counter", "Telemetry records overwritten before they were read.",
           _ring_counts(lambda e: e.dropped_by_ring), label=("dp_rank", "ring")),
    Metric("vcap_telemetry_records", "counter", "Telemetry records read.",
           _ring_counts(lambda e: e.records_by_ring), label=("dp_rank", "ring")),
    Metric("vcap_telemetry_records_rejected", "counter",
           "Telemetry records that failed validation against the segment's geometry (kept out of every total).",
           _by_rank(lambda e: e.records_rejected), label="dp_rank"),
    Metric("vcap_engine_heartbeat_age_seconds", "gauge",
           "Seconds since the DP rank's engine step heartbeat last moved (grows while the engine is idle or frozen).",
           _by_rank(lambda e: _age(e.engine_heartbeat_changed) if e.attached else None), label="dp_rank"),
    Metric("vcap_expert_size_bytes", "gauge", "Bytes of one routed expert, as the engine reports it.",
           _by_rank(lambda e: e.config.expert_bytes if e.config else None), label="dp_rank"),
    Metric("vcap_dispatch_row_bytes", "gauge",
           "Bytes one verify row sends in the MoE's all-to-all dispatch (--dispatch-row-bytes, else the engine's "
           "segment; 0: no dispatch counted).",
           _by_rank(lambda e: e.dispatch_row_bytes if e.config else None), label="dp_rank"),
    Metric("vcap_engine", "info", "The attached engine's geometry, per DP rank.", _by_rank(lambda e: {
        "segment": e.segment, "stride": str(e.config.stride), "max_bs": str(e.config.max_bs),
        "layers": str(e.config.num_moe_layers)} if e.config else None), label="dp_rank"),
)


def _counter(name: str, documentation: str, read: Callable[[Totals], Any]) -> Metric:
    """A counter per DP rank, from its Totals."""
    return Metric(name, "counter", documentation, _by_rank(read), "dp_rank")


def _dispatch(read: Callable[[Totals], int]) -> Callable[[Totals], int | None]:
    # counted once the row size is known; never withdrawn after (a counter does not vanish)
    return lambda t: read(t) if t.last_dispatch_row_bytes or t.dispatch_rows_saved else None


TELEMETRY_METRICS = (   # source: {dp_rank: Totals}
    Metric("vcap_telemetry_last_record_age_seconds", "gauge", "Seconds since the DP rank's last telemetry record arrived.",
           _by_rank(lambda t: _age(t.last_record_monotonic)), label="dp_rank"),
    Metric("vcap_engine_batch_size", "gauge", "Real batch size of the DP rank's newest verify step.",
           _by_rank(lambda t: t.last_bs), label="dp_rank"),
    Metric("vcap_engine_queued_requests", "gauge", "Requests waiting in the DP rank's engine (0 if unknown).",
           _by_rank(lambda t: t.last_queued), label="dp_rank"),
    _counter("vcap_verify_steps", "Verify steps seen in telemetry.", lambda t: t.steps),
    _counter("vcap_drafts_accepted", "Drafted tokens accepted (without the bonus token).", lambda t: t.drafts_accepted),
    _counter("vcap_committed_tokens", "Tokens committed: accepted drafts plus one per request.",
             lambda t: t.committed_tokens),
    _counter("vcap_accepts_at_cap", "Capped requests that accepted every live draft (the cap may have cost tokens).",
             lambda t: t.accepts_at_cap),
    _counter("vcap_experts_streamed", "Distinct experts streamed, summed over layers, on sampled steps.",
             lambda t: int(t.layer_streamed.sum())),
    _counter("vcap_experts_saved", "Distinct experts that dead rows would have added, summed over layers, on sampled steps.",
             lambda t: int(t.layer_saved.sum())),
    _counter("vcap_expert_sampled_steps", "Steps whose expert counts were sampled.", lambda t: t.sampled_steps),
    _counter("vcap_explore_steps", "Steps that verified every row to explore.", lambda t: t.explore_steps),
    _counter("vcap_fallback_steps", "Steps the engine ran on its fallback policy.", lambda t: t.fallback_steps),
    _counter("vcap_guard_violations", "Steps where a request accepted more than L-1 drafts (exactness guard).",
             lambda t: t.guard_violations),
    _counter("vcap_dispatch_rows_saved",
             "Rows not dispatched by the MoE's all-to-all: dead verify rows times MoE layers, every step (absent while "
             "the row size is unknown: no all-to-all).", _dispatch(lambda t: t.dispatch_rows_saved)),
    _counter("vcap_dispatch_bytes_saved",
             "Bytes the MoE's all-to-all did not dispatch: rows saved times vcap_dispatch_row_bytes.",
             _dispatch(lambda t: t.dispatch_bytes_saved)),
    Metric("vcap_verify_rows", "counter", "Verify rows by state.",
           lambda ranks: {(r, state): rows for r, t in ranks.items()
                          for state, rows in (("live", t.rows_live), ("dead", t.rows_dead))},
           label=("dp_rank", "state")),
)
NODE_TELEMETRY_METRICS = (   # source: Totals of every DP rank added up
    Metric("vcap_position_drafts_verified", "counter",
           "Drafts verified at each position (live, and every earlier draft accepted).",
           lambda t: {i: int(v) for i, v in enumerate(t.position_verified, start=1)}, label="position"),
    Metric("vcap_position_drafts_accepted", "counter", "Drafts accepted at each position.",
           lambda t: {i: int(a) for i, a in enumerate(t.position_accepted, start=1)}, label="position"),
    Metric("vcap_layer_experts_streamed", "counter", "Distinct experts streamed per MoE layer, on sampled steps.",
           lambda t: {i: int(s) for i, s in enumerate(t.layer_streamed)}, label="layer"),
    Metric("vcap_layer_experts_saved", "counter", "Distinct experts saved per MoE layer, on sampled steps.",
           lambda t: {i: int(s) for i, s in enumerate(t.layer_saved)}, label="layer"),
    Metric("vcap_request_live_rows", "histogram", "Live verify rows per request (L = 1 + drafts verified).",
           lambda t: (t.live_counts[1:], range(1, t.stride + 1), float((t.live_counts * range(t.stride + 1)).sum()))),
    Metric("vcap_request_accepted_drafts", "histogram", "Accepted drafts per request.",
           lambda t: (t.accepted_counts, range(t.stride), float((t.accepted_counts * range(t.stride)).sum()))),
    Metric("vcap_step_duration_seconds", "histogram", "Duration of a verify step, as the engine measured it.",
           lambda t: (t.step_seconds_counts, STEP_SECONDS_BUCKETS, t.step_seconds_sum)),
)


def calibration_report(controller) -> dict | None:
    """Predicted against observed acceptance per draft position on the controller's window.

    The rows are the controller's estimation window (its newest request rows). A draft counts
    where it was *observed*: verified with every earlier draft accepted (drafts past the live
    length are censored, as the calibration treats them). Per position ``i``: ``observed`` is
    the share of observed drafts accepted, ``predicted`` the mean of the controller's calibrated
    acceptance for them (learned with a longer memory than the window, so a drifting head shows).
    ``head`` the mean of the draft head's own confidence for them (above ``observed``: the head is
    over-confident there, which a rule that reads the confidence as the acceptance pays for).
    ``error`` is the expected calibration error: over the cells (position, running-product bin of the
    calibration) the draft-weighted mean of |mean predicted - observed rate|; ``head_error`` the
    usual one of the draft head, its own confidence as the prediction over the cells (position,
    bin of that confidence, as many bins). Both are biased up by noise in sparse cells (about
    sqrt(p(1-p)/n) per cell). None before the controller has rows.
    """
    model = controller.model
    if model is None:
        return None
    calibration, window = model.calibration, model.window
    rows = window.count
    confidence, live, accepted = (buffer[:rows].copy() for buffer in window.buffers[:3])
    if rows == 0:
        return None
    num_drafts, num_bins = calibration.num_drafts, calibration.num_bins
    confidence = np.nan_to_num(confidence[:, :num_drafts].astype(np.float64))
    observed, success = observed_drafts(live, accepted, num_drafts)
    predicted = calibration.predict(confidence)
    counts = observed.sum(axis=0)
    report = {"drafts": {}, "predicted": {}, "observed": {}, "head": {}}
    head = np.clip(confidence, 0.0, 1.0)
    cells = num_drafts * num_bins
    errors = []
    for prediction, bins in ((predicted, calibration.bin_of(confidence)), (head, uniform_bins(confidence, num_bins))):
        cell = (np.arange(num_drafts)[None, :] * num_bins + bins)[observed]
        weight = np.bincount(cell, minlength=cells)
        rate = np.bincount(cell, success[observed], minlength=cells)
        mean = np.bincount(cell, prediction[observed], minlength=cells)
        seen = weight > 0
        errors.append(float(np.abs(mean[seen] - rate[seen]).sum() / max(weight.sum(), 1)) if seen.any() else None)
    for position in range(num_drafts):
        n = int(counts[position])
        report["drafts"][position + 1] = n
        if n:
            report["predicted"][position + 1] = float(predicted[observed[:, position], position].mean())
            report["observed"][position + 1] = float(success[:, position].sum() / n)
            report["head"][position + 1] = float(head[observed[:, position], position].mean())
    report["error"], report["head_error"] = errors
    return report


CALIBRATION_METRICS = (   # source: calibration_report(controller)
    Metric("vcap_controller_acceptance_predicted", "gauge",
           "Controller's calibrated acceptance of draft i given every earlier one accepted, mean over the drafts "
           "observed in its window (compare vcap_controller_acceptance_observed).",
           lambda r: r["predicted"], label="position"),
    Metric("vcap_controller_acceptance_observed", "gauge",
           "Share of the drafts observed in the controller's window (verified, every earlier draft accepted) "
           "that were accepted, per position.", lambda r: r["observed"], label="position"),
    Metric("vcap_controller_confidence_mean", "gauge",
           "Mean of the draft head's own confidence for draft i over the drafts observed in the controller's "
           "window (compare vcap_controller_acceptance_observed: above it, the head is over-confident).",
           lambda r: r["head"], label="position"),
    Metric("vcap_controller_calibration_observed_drafts", "gauge",
           "Drafts observed per position in the controller's window: the sample behind predicted and observed.",
           lambda r: r["drafts"], label="position"),
    Metric("vcap_controller_calibration_error", "gauge",
           "Expected calibration error of the controller's acceptance model on its window: over (position, "
           "running-product-of-survival bin), the draft-weighted mean of |mean predicted - observed acceptance|.",
           lambda r: r["error"]),
    Metric("vcap_controller_confidence_calibration_error", "gauge",
           "Expected calibration error of the draft head on the controller's window: over (position, bin of "
           "the head's own confidence), the draft-weighted mean of |mean confidence - observed acceptance| "
           "(how far the raw confidence is from acceptance).", lambda r: r["head_error"]),
)


def _calibration_source(controller) -> Callable[[], dict | None]:
    def read():
        try:
            return calibration_report(controller)
        except (TypeError, ValueError, IndexError):   # the controller's tick replaced what was read
            return None
    return read


CONTROLLER_METRICS = tuple(   # source: ControllerReadings
    Metric(f"vcap_controller_{item.name}".removesuffix("_total"), item.metadata["kind"], item.metadata["help"],
           lambda r, name=item.name: getattr(r, name))
    for item in fields(ControllerReadings))

METRIC_NAMES = tuple(metric.exposed_name for metric in
                     POLICY_METRICS + SERVER_METRICS + ENGINE_METRICS + TELEMETRY_METRICS + NODE_TELEMETRY_METRICS
                     + CONTROLLER_METRICS
                     + CALIBRATION_METRICS)


def build_registry(control, servicer, link, controller) -> CollectorRegistry:
    """A registry with the sidecar's metrics and the standard process/platform/GC ones."""
    registry = CollectorRegistry(auto_describe=False)
    for metrics, source in ((POLICY_METRICS, lambda: control), (SERVER_METRICS, lambda: servicer),
                            (ENGINE_METRICS, link.status), (TELEMETRY_METRICS, lambda: link.totals_by_rank() or None),
                            (NODE_TELEMETRY_METRICS, link.totals_snapshot),
                            (CONTROLLER_METRICS, controller.readings),
                            (CALIBRATION_METRICS, _calibration_source(controller))):
        registry.register(SourceCollector(metrics, source))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
