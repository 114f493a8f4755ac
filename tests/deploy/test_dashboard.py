"""The Grafana dashboards import as they are: structure Grafana needs, Grafana's own schema
types, template variables, and the panels the dashboard promises."""

import shutil
import subprocess

import pytest
import yaml

from vcap.sidecar.controller import CONTROLLER_METRICS

from tests.deploy.deploy_files import (DASHBOARDS, DEPLOY, GRAFANA_BUILTINS, REPO, annotation_queries,
                                       iter_panels, load_dashboard, load_rules, metric_names,
                                       panel_queries, template_variables, variable_queries)

NODE_VALIDATORS = REPO / "tests" / "deploy" / "node_validators"
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(params=DASHBOARDS, ids=lambda path: path.name)
def dashboard_path(request):
    return request.param


@pytest.fixture
def dashboard(dashboard_path):
    return load_dashboard(dashboard_path)


def test_there_is_a_dashboard():
    assert [path.name for path in DASHBOARDS] == ["vcap.json"]


def test_importable_as_is(dashboard):
    assert "__inputs" not in dashboard and "__requires" not in dashboard
    assert dashboard["id"] is None
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 39
    assert isinstance(dashboard["panels"], list) and dashboard["panels"]
    assert isinstance(dashboard["templating"]["list"], list)
    assert dashboard["time"]["from"] and dashboard["time"]["to"]


def test_panel_ids_unique_and_grid_positions_valid(dashboard):
    ids = [panel["id"] for panel, _ in iter_panels(dashboard)]
    assert all(isinstance(panel_id, int) for panel_id in ids)
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel, _ in iter_panels(dashboard):
        grid = panel["gridPos"]
        assert set(grid) >= {"h", "w", "x", "y"}, panel["title"]
        assert all(isinstance(grid[key], int) and grid[key] >= 0 for key in "hwxy"), panel["title"]
        assert grid["w"] >= 1 and grid["h"] >= 1 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_top_level_panels_do_not_overlap(dashboard):
    cells = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        for y in range(grid["y"], grid["y"] + grid["h"]):
            for x in range(grid["x"], grid["x"] + grid["w"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_rows(dashboard):
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            continue
        assert panel["gridPos"]["w"] == 24 and panel["gridPos"]["h"] == 1
        # Grafana keeps the panels of an open row after it at top level, of a closed row inside it.
        assert bool(panel["panels"]) == panel["collapsed"], panel["title"]


def test_panels_query_the_datasource_variable(dashboard):
    for panel, _ in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no query"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE_REF, panel["title"]
            assert target["expr"].strip(), panel["title"]
        assert "fieldConfig" in panel and "options" in panel, panel["title"]


def test_template_variables(dashboard):
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "engine"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DATASOURCE_REF
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    assert "vcap_engine_info" in variables["engine"]["query"]["query"]
    assert "segment" in variables["engine"]["regex"]


def test_every_variable_a_query_uses_is_defined(dashboard_path, dashboard):
    defined = {variable["name"] for variable in dashboard["templating"]["list"]} | set(GRAFANA_BUILTINS)
    queries = panel_queries(dashboard_path) + annotation_queries(dashboard_path)
    used = {(query.panel_title, name) for query in queries for name in template_variables(query.expr)}
    used |= {(f"variable {variable['name']}", name) for variable, expr in variable_queries(dashboard_path)
             for name in template_variables(expr)}
    assert not {item for item in used if item[1] not in defined}


def test_policy_generation_changes_are_annotated(dashboard_path):
    annotations = annotation_queries(dashboard_path)
    assert any(query.expr.startswith("changes(vcap_policy_generation") and "> 0" in query.expr
               for query in annotations)


def _shown(dashboard_path, collapsed_row=None) -> set[str]:
    """Names panels show, directly or through the recording rules they read."""
    records = {rule["record"]: rule["expr"] for rule in load_rules() if "record" in rule}
    names, pending = set(), []
    for query in panel_queries(dashboard_path):
        if collapsed_row is None or query.in_collapsed_row == collapsed_row:
            pending.extend(metric_names(query.expr))
    while pending:
        name = pending.pop()
        if name not in names:
            names.add(name)
            pending.extend(metric_names(records.get(name, "")))
    return names


@pytest.mark.parametrize("what, metric", [
    ("experts streamed", "vcap_experts_streamed_total"),
    ("experts saved", "vcap_experts_saved_total"),
    ("experts per layer", "vcap_layer_experts_streamed_total"),
    ("experts saved per layer", "vcap_layer_experts_saved_total"),
    ("experts in bytes", "vcap_expert_size_bytes"),
    ("dispatch saved (all-to-all MoE)", "vcap_dispatch_bytes_saved_total"),
    ("dead rows per DP rank", "vcap_verify_rows_total"),
    ("live length distribution", "vcap_request_live_rows_bucket"),
    ("accepted length distribution", "vcap_request_accepted_drafts_bucket"),
    ("acceptance by position", "vcap_position_drafts_accepted_total"),
    ("accepts at cap", "vcap_accepts_at_cap_total"),
    ("tokens per step", "vcap_committed_tokens_total"),
    ("step time", "vcap_step_duration_seconds_bucket"),
    ("policy generation", "vcap_policy_generation"),
    ("policy mode", "vcap_policy_info"),
    ("lease renewal age", "vcap_lease_renewal_age_seconds"),
    ("engine fallback", "vcap_engine_fallback_active"),
    ("ring drops", "vcap_telemetry_dropped_total"),
    ("guard violations", "vcap_guard_violations_total"),
])
def test_dashboard_shows(dashboard_path, what, metric):
    assert metric in _shown(dashboard_path), f"no panel shows {what} ({metric})"


def test_controller_row_is_collapsed_and_complete(dashboard_path, dashboard):
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row" and panel["title"] == "Controller"]
    assert len(rows) == 1 and rows[0]["collapsed"]
    shown = _shown(dashboard_path, collapsed_row="Controller")
    missing = sorted({name for name, _, _ in CONTROLLER_METRICS} - shown)
    assert not missing, f"controller metrics the Controller row does not show: {missing}"


def test_heatmaps_of_histograms_use_heatmap_format(dashboard):
    for panel, _ in iter_panels(dashboard):
        for target in panel.get("targets", []):
            if "_bucket" in target["expr"] and "histogram_quantile" not in target["expr"]:
                assert target.get("format") == "heatmap", panel["title"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_grafana_schema(dashboard_path):
    """Grafana's own dashboard types (@grafana/schema), checked by tsc."""
    if not (NODE_VALIDATORS / "node_modules" / "@grafana" / "schema").is_dir():
        pytest.skip("run: npm ci --prefix tests/deploy/node_validators")
    result = subprocess.run(["node", str(NODE_VALIDATORS / "check_dashboard.mjs"), str(dashboard_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning():
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert datasources["apiVersion"] == 1
    assert [source["type"] for source in datasources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((provisioning / "dashboards" / "vcap.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]

