"""The systemd unit: systemd accepts it and the sidecar knows every flag it passes."""

import configparser
import shlex
import shutil
import subprocess

import pytest

from tests.deploy.deploy_files import SYSTEMD_UNIT


def _exec_start() -> list[str]:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(SYSTEMD_UNIT.read_text().replace("\\\n", " "))
    return shlex.split(unit["Service"]["ExecStart"])


def test_loopback_only_without_token():
    flags = dict(arg.split("=", 1) for arg in _exec_start()[1:])
    assert flags["--grpc"].startswith("127.0.0.1:") and flags["--metrics"] == "127.0.0.1:9461"
    assert "--auth-token-file" not in flags


@pytest.mark.skipif(shutil.which("vcap-sidecar") is None, reason="needs vcap-sidecar on PATH")
def test_sidecar_knows_every_flag():
    usage = subprocess.run(["vcap-sidecar", "--help"], capture_output=True, text=True, timeout=60).stdout
    for arg in _exec_start()[1:]:
        assert arg.split("=", 1)[0] in usage, arg


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify(tmp_path):
    # verify insists that ExecStart exists: point it at an executable that does.
    binary = shutil.which("vcap-sidecar") or shutil.which("true")
    unit = tmp_path / SYSTEMD_UNIT.name
    unit.write_text(SYSTEMD_UNIT.read_text().replace("/opt/vcap/bin/vcap-sidecar", binary))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_descriptors_are_bounded():
    # A flood of connections must hit the unit's own limit, not the host's (RELIABILITY.md).
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(SYSTEMD_UNIT.read_text().replace("\\\n", " "))
    assert 1024 <= int(unit["Service"]["LimitNOFILE"]) <= 65536
