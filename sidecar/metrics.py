"""Prometheus metrics of the sidecar, all under the ``vcap_`` namespace.

Metrics are produced at scrape time from the bulk totals (``TelemetryTotals``) by one custom
collector, so aggregation costs one numpy pass per batch of records, not one call per request.
Expert counts come from sampled steps only (``vcap_expert_sampled_steps_total`` counts them).
"""

import time

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily)
from prometheus_client.registry import Collector

from .controller import CONTROLLER_METRICS
from .telemetry import STEP_SECONDS_BUCKETS

__all__ = ["METRIC_NAMES", "SidecarCollector", "build_registry"]

# Every family this module exports (without _total/_bucket/... suffixes, with _total on counters
# as Prometheus shows them). deploy/ tests check dashboards and rules against this list.
METRIC_NAMES = (
    "vcap_verify_steps_total", "vcap_verify_rows_total", "vcap_drafts_accepted_total",
    "vcap_committed_tokens_total", "vcap_accepts_at_cap_total",
    "vcap_position_drafts_verified_total", "vcap_position_drafts_accepted_total",
    "vcap_experts_streamed_total", "vcap_experts_saved_total",
    "vcap_layer_experts_streamed_total", "vcap_layer_experts_saved_total",
    "vcap_expert_sampled_steps_total", "vcap_telemetry_dropped_total",
    "vcap_telemetry_records_total", "vcap_explore_steps_total", "vcap_fallback_steps_total",
    "vcap_guard_violations_total", "vcap_policy_changes_total", "vcap_watch_updates_dropped_total",
    "vcap_request_live_rows", "vcap_request_accepted_drafts", "vcap_step_duration_seconds",
    "vcap_policy_generation", "vcap_policy_info", "vcap_engine_attached", "vcap_engine_alive",
    "vcap_engine_fallback_active", "vcap_lease_renewal_age_seconds", "vcap_engine_batch_size",
    "vcap_engine_queued_requests", "vcap_expert_size_bytes", "vcap_engine_info",
    "vcap_telemetry_last_record_age_seconds", "vcap_engine_attaches_total",
) + tuple(name for name, _, _ in CONTROLLER_METRICS)


def _histogram(name, documentation, counts, bounds, total_sum, unit_labels=None):
    """A histogram family from per-bucket counts (last entry: above the last bound)."""
    cumulative, running = [], 0
    for bound, count in zip(bounds, counts):
        running += int(count)
        cumulative.append((_format_bound(bound), running))
    running += int(sum(counts[len(bounds):]))
    cumulative.append(("+Inf", running))
    family = HistogramMetricFamily(name, documentation, labels=unit_labels)
    family.add_metric([], cumulative, sum_value=total_sum)
    return family


def _format_bound(bound) -> str:
    return str(float(bound)) if isinstance(bound, float) else f"{bound}.0"


class SidecarCollector(Collector):
    """Collects everything from the sidecar's state at scrape time."""

    def __init__(self, sidecar):
        self.sidecar = sidecar

    def collect(self):
        link, control = self.sidecar.link, self.sidecar.control
        state = control.state()
        yield GaugeMetricFamily("vcap_policy_generation", "Generation of the policy in force.",
                                value=state.generation)
        info = InfoMetricFamily("vcap_policy", "The policy in force: mode, who set it, control mode.")
        info.add_metric([], {"mode": state.policy.mode, "source": state.source,
                             "control": state.control_mode})
        yield info
        changes = CounterMetricFamily("vcap_policy_changes", "Accepted policy changes.", labels=["source"])
        for source, count in control.changes_by_source.items():
            changes.add_metric([source], count)
        yield changes
        yield CounterMetricFamily("vcap_watch_updates_dropped",
                                  "WatchStats updates skipped because a client read too slowly.",
                                  value=self.sidecar.watch_updates_dropped)
        yield CounterMetricFamily("vcap_engine_attaches", "Times the sidecar attached to an engine segment.",
                                  value=link.attach_count)
        segment = link.segment
        yield GaugeMetricFamily("vcap_engine_attached", "1 while attached to an engine's segment.",
                                value=int(segment is not None))
        yield GaugeMetricFamily("vcap_engine_alive", "1 while the attached engine's process exists.",
                                value=int(link.engine_alive()))
        yield GaugeMetricFamily("vcap_engine_fallback_active",
                                "1 while the engine runs its fallback policy (lease expired).",
                                value=int(link.engine_fallback_active()))
        age = time.monotonic() - link.last_renewal if link.last_renewal else float("nan")
        yield GaugeMetricFamily("vcap_lease_renewal_age_seconds",
                                "Seconds since the sidecar last renewed the engine's lease.", value=age)
        dropped = CounterMetricFamily("vcap_telemetry_dropped", "Telemetry records overwritten before they were read.",
                                      labels=["ring"])
        records = CounterMetricFamily("vcap_telemetry_records", "Telemetry records read.", labels=["ring"])
        for ring, count in enumerate(link.dropped()):
            dropped.add_metric([str(ring)], count)
            records.add_metric([str(ring)], link.records_by_ring[ring])
        yield dropped
        yield records
        if segment is not None:
            config = segment.config
            yield GaugeMetricFamily("vcap_expert_size_bytes", "Bytes of one routed expert, as the engine reports it.",
                                    value=config.expert_bytes)
            engine = InfoMetricFamily("vcap_engine", "The attached engine's geometry.")
            engine.add_metric([], {"segment": segment.path, "stride": str(config.stride),
                                   "max_bs": str(config.max_bs), "layers": str(config.num_moe_layers)})
            yield engine
        controller_values = self.sidecar.controller.metrics()
        for name, kind, documentation in CONTROLLER_METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name.removesuffix("_total"), documentation,
                         value=controller_values.get(name, float("nan")))
        totals = link.totals
        if totals is not None:
            yield from self._collect_totals(totals)

    def _collect_totals(self, totals):
        with totals.lock:
            age = (time.monotonic() - totals.last_record_monotonic
                   if totals.last_record_monotonic else float("nan"))
            yield GaugeMetricFamily("vcap_telemetry_last_record_age_seconds",
                                    "Seconds since the last telemetry record arrived.", value=age)
            yield GaugeMetricFamily("vcap_engine_batch_size", "Real batch size of the newest verify step.",
                                    value=totals.last_bs)
            yield GaugeMetricFamily("vcap_engine_queued_requests", "Requests waiting in the engine (0 if unknown).",
                                    value=totals.last_queued)
            counters = (
                ("vcap_verify_steps", "Verify steps seen in telemetry.", totals.steps),
                ("vcap_drafts_accepted", "Drafted tokens accepted (without the bonus token).", totals.drafts_accepted),
                ("vcap_committed_tokens", "Tokens committed: accepted drafts plus one per request.", totals.committed_tokens),
                ("vcap_accepts_at_cap", "Capped requests that accepted every live draft (the cap may have cost tokens).", totals.accepts_at_cap),
                ("vcap_experts_streamed", "Distinct experts streamed, summed over layers, on sampled steps.", int(totals.layer_streamed.sum())),
                ("vcap_experts_saved", "Distinct experts that dead rows would have added, summed over layers, on sampled steps.", int(totals.layer_saved.sum())),
                ("vcap_expert_sampled_steps", "Steps whose expert counts were sampled.", totals.sampled_steps),
                ("vcap_explore_steps", "Steps that verified every row to explore.", totals.explore_steps),
                ("vcap_fallback_steps", "Steps the engine ran on its fallback policy.", totals.fallback_steps),
                ("vcap_guard_violations", "Steps where a request accepted more than L-1 drafts (exactness guard).", totals.guard_violations),
            )
            for name, documentation, value in counters:
                yield CounterMetricFamily(name, documentation, value=value)
            rows = CounterMetricFamily("vcap_verify_rows", "Verify rows by state.", labels=["state"])
            rows.add_metric(["live"], totals.rows_live)
            rows.add_metric(["dead"], totals.rows_dead)
            yield rows
            verified = CounterMetricFamily("vcap_position_drafts_verified",
                                           "Drafts verified at each position (live, and every earlier draft accepted).",
                                           labels=["position"])
            accepted = CounterMetricFamily("vcap_position_drafts_accepted", "Drafts accepted at each position.",
                                           labels=["position"])
            for i, (v, a) in enumerate(zip(totals.position_verified, totals.position_accepted), start=1):
                verified.add_metric([str(i)], int(v))
                accepted.add_metric([str(i)], int(a))
            yield verified
            yield accepted
            streamed = CounterMetricFamily("vcap_layer_experts_streamed", "Distinct experts streamed per MoE layer, on sampled steps.",
                                           labels=["layer"])
            saved = CounterMetricFamily("vcap_layer_experts_saved", "Distinct experts saved per MoE layer, on sampled steps.",
                                        labels=["layer"])
            for layer, (s, v) in enumerate(zip(totals.layer_streamed, totals.layer_saved)):
                streamed.add_metric([str(layer)], int(s))
                saved.add_metric([str(layer)], int(v))
            yield streamed
            yield saved
            stride = totals.stride
            live = totals.live_counts
            yield _histogram("vcap_request_live_rows", "Live verify rows per request (L = 1 + drafts verified).",
                             live[1:], list(range(1, stride + 1)), float((live * range(len(live))).sum()))
            accepted_counts = totals.accepted_counts
            yield _histogram("vcap_request_accepted_drafts", "Accepted drafts per request.",
                             accepted_counts, list(range(0, stride)),
                             float((accepted_counts * range(len(accepted_counts))).sum()))
            yield _histogram("vcap_step_duration_seconds", "Duration of a verify step, as the engine measured it.",
                             totals.step_seconds_counts, list(STEP_SECONDS_BUCKETS), totals.step_seconds_sum)


def build_registry(sidecar) -> CollectorRegistry:
    """A registry with the sidecar's metrics and the standard process/platform/GC ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(sidecar))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
