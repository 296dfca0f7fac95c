"""constraints.txt, the versions CI tests: it pins every package pyproject.toml names, within the range
pyproject.toml allows, and the environment these tests run in was installed through it (make install)."""

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="the lock applies on CPython 3.11 and later")

ROOT = Path(__file__).resolve().parent.parent


def pins() -> dict[str, Version]:
    """constraints.txt as {canonical name: version}; every line one exact pin for CPython 3.11+."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and str(req.marker) == 'python_version >= "3.11"', line
        out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def named_in_pyproject() -> list[Requirement]:
    """What pyproject.toml asks for, the GPU extra aside (its faiss-gpu is not installed here)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [reqs for name, reqs in project["optional-dependencies"].items() if name != "gpu"]
    lines = project["dependencies"] + [line for reqs in extras for line in reqs]
    return [Requirement(line) for line in lines if not line.startswith(project["name"])]


def test_every_dependency_is_pinned_within_its_range():
    locked = pins()
    for req in named_in_pyproject():
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not in constraints.txt: run make lock"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"constraints.txt pins {req.name} {locked[name]}, outside pyproject.toml's {req}: run make lock"
        )


def test_the_environment_is_the_lock():
    for name, version in pins().items():
        installed = Version(metadata.version(name))
        assert installed.public == str(version), (
            f"{name} is {installed} here, constraints.txt pins {version}: "
            "run make install (make lock re-resolves)"
        )
