"""Kubernetes manifests: valid against the Kubernetes API schemas (kubernetes-validate, offline),
the ServiceMonitor against the Prometheus Operator's CRD schema, and consistent with each other
and with the sidecar's flags."""

import json
import shutil
import subprocess

import pytest
import yaml

from vcap.policy import validate
from vcap.sidecar.policy_file import parse_policy

from tests.deploy.deploy_files import KUSTOMIZATION_DIR, REPO

NODE_VALIDATORS = REPO / "tests" / "deploy" / "node_validators"
# Native sidecars (restartable init containers) are on by default from Kubernetes 1.29.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
NUM_DRAFTS = 5


def _render() -> list[dict]:
    """The kustomization's objects: `kubectl kustomize` or `kustomize build`, else the files
    of its resources list plus its ConfigMaps (enough for these checks)."""
    for command in (["kubectl", "kustomize"], ["kustomize", "build"]):
        if shutil.which(command[0]):
            result = subprocess.run([*command, str(KUSTOMIZATION_DIR)], capture_output=True,
                                    text=True, timeout=120)
            assert result.returncode == 0, result.stderr
            return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kustomization = yaml.safe_load((KUSTOMIZATION_DIR / "kustomization.yaml").read_text())
    objects = []
    for resource in kustomization["resources"]:
        objects.extend(doc for doc in yaml.safe_load_all((KUSTOMIZATION_DIR / resource).read_text()) if doc)
    for generator in kustomization.get("configMapGenerator", []):
        data = {name: (KUSTOMIZATION_DIR / name).read_text() for name in generator["files"]}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"]}, "data": data})
    return objects


@pytest.fixture(scope="module")
def objects():
    return _render()


def _one(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def pod(objects):
    return _one(objects, "Deployment")["spec"]["template"]


def _container(pod, name):
    spec = pod["spec"]
    (container,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return container


def _flags(args) -> dict[str, str]:
    flags = {}
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            flags[key] = value
    return flags


def test_kustomization_resources_exist():
    kustomization = yaml.safe_load((KUSTOMIZATION_DIR / "kustomization.yaml").read_text())
    for name in kustomization["resources"] + [f for g in kustomization["configMapGenerator"] for f in g["files"]]:
        assert (KUSTOMIZATION_DIR / name).is_file(), name


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_schemas(objects, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_servicemonitor_schema
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 4


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_servicemonitor_schema(objects):
    if not (NODE_VALIDATORS / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir():
        pytest.skip("run: npm ci --prefix tests/deploy/node_validators")
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    result = subprocess.run(["node", str(NODE_VALIDATORS / "check_servicemonitor.mjs")],
                            input=json.dumps(monitors), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sidecar_is_native_and_configured(pod):
    sidecar = _container(pod, "vcap-sidecar")
    assert sidecar in pod["spec"]["initContainers"] and sidecar["restartPolicy"] == "Always"
    flags = _flags(sidecar["command"])
    assert flags["--grpc"] == "0.0.0.0:50061"
    assert flags["--metrics"] == "0.0.0.0:9461"
    assert flags["--auth-token-file"] == "/etc/vcap/token"
    assert flags["--policy-file"] == "/etc/vcap/policy/policy.yaml"
    # issue 16: the token beyond loopback travels over TLS; probes reach a plaintext health port
    assert flags["--tls-cert"] == "/etc/vcap/tls/tls.crt" and flags["--tls-key"] == "/etc/vcap/tls/tls.key"
    assert "--allow-cleartext-token" not in flags
    assert flags["--health"] == "0.0.0.0:50062"
    assert sidecar["livenessProbe"]["grpc"]["port"] == 50062
    # a native sidecar's readiness is the pod's: a sidecar down must not take the engine out of
    # its Service (found by an outside review)
    assert "readinessProbe" not in sidecar
    # the controller's ticks take 15-20% of a core (twenty-eighth round): the request covers them
    assert sidecar["resources"]["requests"] == {"cpu": "250m", "memory": "128Mi"}


def test_sidecar_runs_non_root_in_the_engines_segment_group(pod):
    """Issue 16: the sidecar is not root; the engine creates the segment 0660 in its group."""
    sidecar = _container(pod, "vcap-sidecar")
    context = sidecar["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    env = {item["name"]: item.get("value") for item in _container(pod, "sglang")["env"]}
    assert env["VCAP_SEGMENT_GROUP"] == str(context["runAsGroup"])
    assert pod["spec"]["securityContext"]["fsGroup"] == context["runAsGroup"]
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    for secret in ("vcap-token", "vcap-tls"):
        mode = volumes[secret]["secret"]["defaultMode"]
        assert mode & 0o004 == 0, f"{secret}: world-readable ({mode:o}); the sidecar refuses it"


def test_mounts_match_flags(pod, objects):
    sidecar = _container(pod, "vcap-sidecar")
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in sidecar["volumeMounts"]}
    token = mounts["/etc/vcap/token"]
    assert volumes[token["name"]]["secret"]["secretName"] == "vcap-token" and token["subPath"] == "token"
    assert volumes[mounts["/etc/vcap/tls"]["name"]]["secret"]["secretName"] == "vcap-tls"
    policy = mounts["/etc/vcap/policy"]
    assert "subPath" not in policy, "subPath mounts never see ConfigMap updates"
    config_map = _one(objects, "ConfigMap", volumes[policy["name"]]["configMap"]["name"])
    assert "policy.yaml" in config_map["data"]


def test_every_mount_has_a_volume(pod):
    volumes = {volume["name"] for volume in pod["spec"]["volumes"]}
    for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{container['name']}: {mount['name']}"


def test_dev_shm_shared_in_memory(pod):
    (dshm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    for name in ("vcap-sidecar", "sglang"):
        mounts = {m["mountPath"]: m["name"] for m in _container(pod, name)["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm", name


def test_engine_launches_through_the_hook_on_the_same_segment(pod):
    sglang = _container(pod, "sglang")
    assert sglang["image"].startswith("lmsysorg/sglang")
    command = sglang["command"]
    assert command[:5] == ["python", "-m", "vcap.engine_hook.launch", "--segment", "vcap-0"]
    assert "--" in command
    sidecar_segment = _flags(_container(pod, "vcap-sidecar")["command"])["--segment"]
    assert sidecar_segment == command[4]
    env = {item["name"]: item.get("value") for item in sglang["env"]}
    assert "SGLANG_PLUGINS" in env


def test_services_and_monitor_line_up(pod, objects):
    pod_labels = pod["metadata"]["labels"]
    ports = {port["name"]: port["containerPort"]
             for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] for port in c.get("ports", [])}
    for service in (o for o in objects if o["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= pod_labels.items(), service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: {port['targetPort']}"
    vcap = _one(objects, "Service", "vcap")  # the job label the alerts expect
    assert {p["name"]: p["port"] for p in vcap["spec"]["ports"]} == {"grpc": 50061, "metrics": 9461}
    monitor = _one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= vcap["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]


def test_policy_file_is_valid():
    policy = parse_policy((KUSTOMIZATION_DIR / "policy.yaml").read_text())
    validate(policy, NUM_DRAFTS)
    assert policy.mode == "conf" and policy.buckets[0].min_bs == 1


@pytest.mark.skipif(shutil.which("vcap-sidecar") is None, reason="needs vcap-sidecar on PATH")
def test_sidecar_knows_every_flag(pod):
    usage = subprocess.run(["vcap-sidecar", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in _flags(_container(pod, "vcap-sidecar")["command"]):
        assert flag in usage, flag


# -- the two-node shape (deploy/kubernetes/multinode) ------------------------------------------

MULTINODE_DIR = KUSTOMIZATION_DIR / "multinode"


@pytest.fixture(scope="module")
def multinode_objects():
    return _render_dir(MULTINODE_DIR)


def _render_dir(directory) -> list[dict]:
    for command in (["kubectl", "kustomize"], ["kustomize", "build"]):
        if shutil.which(command[0]):
            result = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr
            return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = []
    for resource in kustomization["resources"]:
        objects.extend(doc for doc in yaml.safe_load_all((directory / resource).read_text()) if doc)
    for generator in kustomization.get("configMapGenerator", []):
        data = {name: (directory / name).read_text() for name in generator["files"]}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                        "data": data})
    return objects


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_multinode_kubernetes_schemas(multinode_objects, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for obj in multinode_objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 5


def test_multinode_is_two_pods_on_two_nodes_with_one_fleet_policy(multinode_objects):
    statefulset = _one(multinode_objects, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 2
    pod = statefulset["spec"]["template"]
    (rule,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert (MULTINODE_DIR / "policy.yaml").read_text() == (KUSTOMIZATION_DIR / "policy.yaml").read_text()
    (config_map,) = [o for o in multinode_objects if o["kind"] == "ConfigMap"]
    mounted = {v["name"]: v for v in pod["spec"]["volumes"]}["vcap-policy"]["configMap"]["name"]
    assert mounted == config_map["metadata"]["name"] == "vcap-policy"
    headless = _one(multinode_objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


def test_multinode_sidecar_attaches_the_segment_its_node_creates(multinode_objects):
    """Node rank k hosts attention-DP ranks 8k..8k+7; its sidecar serves exactly their segments,
    named as the engine hook names them (both use vcap.layout.dp_segment_name)."""
    from vcap.layout import dp_segment_name
    pod = _one(multinode_objects, "StatefulSet")["spec"]["template"]
    sglang = _container(pod, "sglang")
    args = sglang["command"]
    base = args[args.index("--segment") + 1]
    flags = _flags(args)
    assert flags["--node-rank"] == "$(POD_INDEX)" and flags["--nnodes"] == "2"
    dp_size, tp_size = int(flags["--attn-dp-size"]), int(flags["--tp-size"])
    assert dp_size == tp_size and flags["--moe-a2a-backend"] != "none"  # what vcap supports
    per_node = dp_size // 2
    sidecar = _container(pod, "vcap-sidecar")
    script = sidecar["command"][2]
    for pod_index in (0, 1):
        result = subprocess.run(["sh", "-c", script.replace("exec vcap-sidecar", "echo"), "x"],
                                env={"POD_INDEX": str(pod_index), "PATH": "/usr/bin:/bin"},
                                capture_output=True, text=True, timeout=10)
        options = _flags(result.stdout.split())
        first, count = int(options["--dp-first-rank"]), int(options["--dp-size"])
        served = [dp_segment_name(options["--segment"], rank) for rank in range(first, first + count)]
        assert served == [dp_segment_name(base, rank) for rank in range(pod_index * per_node, (pod_index + 1) * per_node)]
    for container in (sglang, sidecar):
        env = {item["name"]: item for item in container["env"]}
        assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
    base_sidecar = _flags(_container(_one(_render(), "Deployment")["spec"]["template"], "vcap-sidecar")["command"])
    base_sidecar.pop("--segment")
    assert _flags(sidecar["command"][4:]) == base_sidecar  # otherwise the single-node sidecar


def _scrape_job(objects) -> str:
    """The job label the Prometheus Operator gives the ServiceMonitor's targets: the value of the
    Service label named by jobLabel, else the Service's name."""
    monitor = _one(objects, "ServiceMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [o for o in objects if o["kind"] == "Service"
                  and wanted.items() <= o["metadata"].get("labels", {}).items()]
    label = monitor["spec"].get("jobLabel")
    return service["metadata"]["labels"][label] if label else service["metadata"]["name"]


def test_alerts_find_the_sidecars_of_both_layouts(objects, multinode_objects):
    """The alerts look for job="vcap": with the two-node layout the job was its Service's name,
    vcap-multinode, and VcapSidecarAbsent fired for good (found by an outside review). Nor does
    its Service carry gRPC, which would reach one node at random."""
    alerts = (REPO / "deploy" / "prometheus" / "rules" / "vcap-alerts.yml").read_text()
    assert 'up{job="vcap"}' in alerts
    assert _scrape_job(objects) == _scrape_job(multinode_objects) == "vcap"
    service = _one(multinode_objects, "Service", "vcap-multinode")
    assert [port["name"] for port in service["spec"]["ports"]] == ["metrics"]
    assert service["spec"]["publishNotReadyAddresses"] is True
