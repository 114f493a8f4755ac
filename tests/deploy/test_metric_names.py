"""Dashboards and rules name only metrics the sidecar exports (sidecar/metrics.py METRIC_NAMES),
and exported metrics that no panel shows are reported."""

import warnings

import pytest
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from vcap.sidecar.metrics import METRIC_NAMES

from tests.deploy.deploy_files import (DASHBOARDS, annotation_queries, load_rules, metric_names, panel_queries,
                          recording_rule_names, variable_queries)

# Series Prometheus makes itself.
PROMETHEUS_SERIES = {"up"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _standard_collector_names() -> set[str]:
    """Sample names of prometheus_client's process, platform and GC collectors (on this OS)."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    # ProcessCollector is empty where /proc is missing; these are its names on Linux.
    names = {"process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
             "process_cpu_seconds_total", "process_open_fds", "process_max_fds"}
    for family in registry.collect():
        names.update(sample.name for sample in family.samples)
    return names


def _exported() -> set[str]:
    names = set(METRIC_NAMES) | _standard_collector_names()
    names |= {name + suffix for name in METRIC_NAMES for suffix in _HISTOGRAM_SUFFIXES}
    return names


def _family(name: str) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in METRIC_NAMES:
            return name[: -len(suffix)]
    return name


def _dashboard_uses() -> dict[str, set[str]]:
    """Name -> where a dashboard uses it (panel targets, annotations, variables)."""
    uses: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        for query in panel_queries(path) + annotation_queries(path):
            for name in metric_names(query.expr):
                uses.setdefault(name, set()).add(f"{path.name}: {query.panel_title}")
        for variable, expr in variable_queries(path):
            for name in metric_names(expr):
                uses.setdefault(name, set()).add(f"{path.name}: variable {variable['name']}")
    return uses


def _rule_uses() -> dict[str, set[str]]:
    uses: dict[str, set[str]] = {}
    for rule in load_rules():
        for name in metric_names(rule["expr"]):
            uses.setdefault(name, set()).add(rule.get("record") or rule.get("alert"))
    return uses


def _check(uses: dict[str, set[str]]) -> list[str]:
    allowed = _exported() | PROMETHEUS_SERIES | recording_rule_names()
    return [f"{name} (in {', '.join(sorted(where))})" for name, where in sorted(uses.items())
            if name not in allowed]


def test_dashboards_name_only_exported_metrics():
    unknown = _check(_dashboard_uses())
    assert not unknown, "metrics the sidecar does not export:\n  " + "\n  ".join(unknown)


def test_rules_name_only_exported_metrics():
    unknown = _check(_rule_uses())
    assert not unknown, "metrics the sidecar does not export:\n  " + "\n  ".join(unknown)


def test_recording_rules_are_defined_once():
    names = [rule["record"] for rule in load_rules() if "record" in rule]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)


def test_report_exported_metrics_no_panel_shows(capsys):
    """Not a failure: prints (and warns about) what the dashboards leave out."""
    shown = set()
    records = {rule["record"]: rule["expr"] for rule in load_rules() if "record" in rule}
    pending = list(_dashboard_uses())
    while pending:
        name = pending.pop()
        if name in shown:
            continue
        shown.add(name)
        if name in records:
            pending.extend(metric_names(records[name]))
    families = {_family(name) for name in shown}
    missing = sorted(name for name in METRIC_NAMES if name not in families)
    if missing:
        with capsys.disabled():
            print("\nexported metrics no dashboard panel shows: " + ", ".join(missing))
        warnings.warn(f"exported metrics no dashboard panel shows: {', '.join(missing)}")


@pytest.mark.parametrize("expr, expected", [
    ('sum by (le) (rate(a_bucket{job=~"$job"}[$__rate_interval]))', {"a_bucket"}),
    ("x / on () group_left () (y > 0)", {"x", "y"}),
    ("histogram_quantile(0.99, sum by (le) (r:x:rate1m))", {"r:x:rate1m"}),
    ("increase(a_total[5m] offset 1h) > 1e3 and on (job) b == 1", {"a_total", "b"}),
    ('label_replace(up, "x", "$1", "instance", "(.*)")', {"up"}),
])
def test_metric_names_parser(expr, expected):
    assert metric_names(expr) == expected
