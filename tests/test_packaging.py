"""What a clean checkout installs: the constraints file against pyproject's ranges, and
the one name we share with another distribution (`kernels`)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        assert version, f"not a pin: {line!r}"
        pins[canonicalize_name(name)] = version
    return pins


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("test", "ucx"):  # what make install asks for
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def test_every_pin_satisfies_the_projects_range():
    pins = _constraints()
    checked = 0
    for req in _project_requirements():
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned by the Makefile, not the constraints
            continue
        assert name in pins, f"{req.name} is not pinned in deploy/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{req.name}=={pins[name]} is outside {req.specifier}"
        )
        checked += 1
    assert checked >= 20


def test_nothing_installs_a_second_top_level_kernels_package():
    # Hugging Face's `kernels` distribution is imported as `kernels`, like our package;
    # transformers >= 5.25 requires it and then imports its hub kernels from ours.
    pins = _constraints()
    assert "kernels" not in pins
    transformers_needs = [
        Requirement(r) for r in importlib.metadata.requires("transformers") or []
    ]
    unconditional = {canonicalize_name(r.name) for r in transformers_needs if r.marker is None}
    assert "kernels" not in unconditional
    assert importlib.metadata.version("transformers") == pins["transformers"]

    from transformers.utils.import_utils import is_kernels_available

    assert not is_kernels_available()
    import kernels

    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"
