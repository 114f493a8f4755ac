"""Prometheus configuration and rules: promtool accepts them and their unit tests pass."""

import subprocess

import pytest
import yaml

from tests.deploy.deploy_files import PROMETHEUS_CONFIG, RULE_FILES, RULE_TESTS, load_rules


def _promtool(*args):
    result = subprocess.run(["promtool", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.prometheus
def test_check_config():
    _promtool("check", "config", PROMETHEUS_CONFIG)


@pytest.mark.prometheus
def test_check_rules():
    _promtool("check", "rules", *RULE_FILES)


@pytest.mark.prometheus
def test_rule_unit_tests():
    _promtool("test", "rules", *RULE_TESTS)


def test_scrape_config():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "vcap"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9461"]
    assert sorted(config["rule_files"]) == sorted(f"rules/{path.name}" for path in RULE_FILES)


def test_alerts_are_labelled_and_explained():
    alerts = [rule for rule in load_rules() if "alert" in rule]
    assert alerts
    for alert in alerts:
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], alert["alert"]


def test_every_alert_has_a_unit_test():
    tested = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            tested.update(check["alertname"] for check in case.get("alert_rule_test", [])
                          if check["exp_alerts"])
    alerts = {rule["alert"] for rule in load_rules() if "alert" in rule}
    assert not alerts - tested, f"alerts never seen firing in a test: {sorted(alerts - tested)}"


@pytest.mark.parametrize("alert", [
    "VcapSidecarDown", "VcapSidecarAbsent", "VcapEngineOnFallback", "VcapTelemetryDropping",
    "VcapExpertsSavedCollapsed", "VcapExactnessGuardTripped", "VcapControllerGuardrailHit",
    "VcapEngineAttachedNotAlive", "VcapControllerNotReady", "VcapEngineTelemetryStale",
])
def test_alert_exists(alert):
    assert alert in {rule.get("alert") for rule in load_rules()}
