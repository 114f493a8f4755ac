"""deploy/compose/compose.yaml, the local dashboard recipe: valid against the Compose
Specification's JSON schema, every file it mounts exists, and the real Prometheus, started with the
compose service's own arguments over the files it mounts, scrapes a real simulated sidecar and
evaluates every rule group."""

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.deploy_files import DEPLOY, RULE_FILES
from tests.utils import free_ports, wait_until

COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
# The Compose Specification's schema as docker-compose 1.29.2 ships it (compose/config/compose_spec.json);
# .ci/run downloads the wheel here (pip download --no-deps docker-compose==1.29.2).
SPEC_WHEELS = sorted((Path(__file__).parent / ".cache").glob("docker_compose-1.29.2-*.whl"))


def _compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of each bind mount, as compose resolves them."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = (COMPOSE_FILE.parent / source).resolve()
    return mounts


@pytest.mark.skipif(not SPEC_WHEELS, reason="the docker-compose 1.29.2 wheel (Compose schema) is not "
                    "in tests/deploy/.cache: pip download --no-deps docker-compose==1.29.2 -d tests/deploy/.cache")
def test_compose_file_matches_the_compose_specification():
    with zipfile.ZipFile(SPEC_WHEELS[0]) as wheel:
        schema = json.loads(wheel.read("compose/config/compose_spec.json"))
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(_compose())]
    assert not errors, errors


def test_every_mounted_path_exists_and_is_what_the_service_expects():
    services = _compose()["services"]
    for name, service in services.items():
        for target, source in _mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
            assert source.is_relative_to(DEPLOY), f"{name}: {source} lies outside deploy/"
    prometheus = _mounts(services["prometheus"])
    config = yaml.safe_load(prometheus["/etc/prometheus/prometheus.yml"].read_text())
    for rule_file in config["rule_files"]:  # relative to the config file, inside the container
        container_path = f"/etc/prometheus/{rule_file}"
        assert any(container_path.startswith(t + "/") and (s / container_path[len(t) + 1:]).is_file()
                   for t, s in prometheus.items()), f"{rule_file} is not mounted"
    grafana = _mounts(services["grafana"])
    providers = yaml.safe_load(next(grafana["/etc/grafana/provisioning/dashboards"].glob("*.yaml")).read_text())
    (provider,) = providers["providers"]
    assert provider["options"]["path"] in grafana, "the dashboard provider reads a folder nothing is mounted at"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    folder, _, file = home.rpartition("/")
    assert (grafana[folder] / file).is_file()


def _get(url):
    return json.load(urllib.request.urlopen(url, timeout=5))["data"]


@pytest.mark.prometheus
def test_compose_prometheus_scrapes_the_simulated_sidecar_and_evaluates_every_rule(segment_name, tmp_path):
    service = _compose()["services"]["prometheus"]
    # The container's file system, rebuilt from the mounts; only the scrape target's port differs,
    # because the test cannot take the sidecar's default port.
    grpc_port, metrics_port, prometheus_port = free_ports(3)
    root = tmp_path / "container"
    for target, source in _mounts(service).items():
        destination = root / target.lstrip("/")
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, destination)
        else:
            shutil.copy(source, destination)
    config_path = root / "etc/prometheus/prometheus.yml"
    config = yaml.safe_load(config_path.read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9461"]
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config_path.write_text(yaml.safe_dump(config))
    arguments = [a.replace("/etc/prometheus", str(root / "etc/prometheus")) for a in service["command"]
                 if not a.startswith(("--storage.tsdb.path", "--web.listen-address"))]
    arguments += [f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prometheus_port}"]

    sidecar_log = tmp_path / "sidecar.log"
    with open(sidecar_log, "w") as log:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "vcap.sidecar.cli", "--simulate", "--segment", segment_name,
             "--grpc", f"127.0.0.1:{grpc_port}", "--metrics", f"127.0.0.1:{metrics_port}",
             "--", "--time-scale", "0.05", "--mean-bs", "8", "--log-every", "0"],
            stdout=log, stderr=subprocess.STDOUT)
    prometheus = subprocess.Popen([shutil.which("prometheus"), *arguments],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prometheus_port}/api/v1"
    try:
        def target_up():
            targets = _get(f"{api}/targets")["activeTargets"]
            return targets and all(t["health"] == "up" for t in targets)
        wait_until(target_up, 60, "the sidecar target up")
        expected_groups = {group["name"] for path in RULE_FILES
                           for group in yaml.safe_load(path.read_text())["groups"]}
        groups = _get(f"{api}/rules")["groups"]
        assert {g["name"] for g in groups} == expected_groups

        def every_rule_evaluated_cleanly():
            rules = [r for g in _get(f"{api}/rules")["groups"] for r in g["rules"]]
            assert all(r["health"] != "err" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            return all(r["health"] == "ok" for r in rules)
        wait_until(every_rule_evaluated_cleanly, 60, "every rule evaluated")
        # a recording rule the dashboard reads has a value from the sidecar's metrics
        query = urllib.parse.urlencode({"query": "instance:vcap_verify_steps:rate1m > 0"})
        try:
            wait_until(lambda: _get(f"{api}/query?{query}")["result"], 60, "instance:vcap_verify_steps:rate1m > 0")
        except AssertionError as e:   # say whether the sidecar was still there, and what it said
            state = "running" if sidecar.poll() is None else f"exited with {sidecar.returncode}"
            raise AssertionError(f"{e}; the sidecar {state}; its log ends: {sidecar_log.read_text()[-2000:]!r}") from e
    finally:
        prometheus.terminate()
        sidecar.terminate()
        prometheus.wait(timeout=20)
        sidecar.wait(timeout=20)
