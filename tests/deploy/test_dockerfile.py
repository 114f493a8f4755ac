"""deploy/Dockerfile builds the image the manifests name `vcap` (no Docker here: its inputs are
checked against the package definition, so a package directory added later is not left out)."""

import os

import pytest

tomllib = pytest.importorskip("tomllib")   # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copied() -> set[str]:
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as file:
        lines = [line.split() for line in file if line.startswith("COPY ")]
    return {source.rstrip("/") for words in lines for source in words[1:-1]}


def test_the_image_copies_every_package_directory_and_the_files_the_build_reads():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
        project = tomllib.load(file)
    needed = {path.split("/")[0] for path in project["tool"]["setuptools"]["package-dir"].values()}
    needed |= {"pyproject.toml", project["project"]["readme"]}
    copied = _copied()
    assert needed <= copied, f"deploy/Dockerfile does not copy {sorted(needed - copied)}"
    for source in copied:
        assert os.path.exists(os.path.join(ROOT, source)), source


def test_no_deploy_file_says_to_install_vcap_from_pypi():
    # a `vcap` on PyPI is another project
    for folder, _, names in os.walk(os.path.join(ROOT, "deploy")):
        for name in names:
            with open(os.path.join(folder, name), errors="replace") as file:
                assert "pip install vcap" not in file.read(), os.path.join(folder, name)
