"""Every private Ray name relay touches is in relay/runtime/ray_private.py, listed there, and
present in the installed Ray, which is the version that file was written for. A Ray upgrade
fails here first, naming what to re-read; a private import anywhere else fails here too."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import ray
from support import REPO

from relay.runtime import ray_private

pytestmark = pytest.mark.timeout(120)

PACKAGE = REPO / "platform" / "relay"
HOME = PACKAGE / "runtime" / "ray_private.py"


def is_private(module: str) -> bool:
    """A Ray module path with a private part (`ray._private.state`, `ray.train.v2._internal`),
    or Ray's generated protobuf modules (internal, though named without an underscore)."""
    parts = module.split(".")
    return parts[0] == "ray" and (any(p.startswith("_") for p in parts[1:]) or "generated" in parts)


def private_imports(path: Path) -> set[tuple[str, str]]:
    """(module, name) of each private Ray import in `path` (`import m` gives (m, ""))."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and is_private(node.module):
            found.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names if is_private(alias.name))
    return found


def test_the_installed_ray_is_the_one_ray_private_was_written_for():
    assert ray.__version__ == ray_private.RAY_VERSION, (
        f"Ray {ray.__version__} installed, relay/runtime/ray_private.py was written for "
        f"{ray_private.RAY_VERSION}: re-read each private name it uses, then update RAY_VERSION"
    )


@pytest.mark.parametrize(
    ("module", "name"),
    sorted((m, n) for m, names in ray_private.PRIVATE_NAMES.items() for n in names),
)
def test_each_private_name_is_in_the_installed_ray(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"


@pytest.mark.parametrize(
    ("owner", "member"),
    sorted((o, m) for o, members in ray_private.PRIVATE_MEMBERS.items() for m in members),
)
def test_each_private_member_relay_overrides_is_in_the_installed_ray(owner, member):
    module, _, cls = owner.partition(":")
    assert callable(getattr(getattr(importlib.import_module(module), cls), member, None))


def test_the_parquet_planner_logger_names_a_ray_module():
    assert importlib.util.find_spec(ray_private.PARQUET_PLANNER_LOGGER) is not None


def test_ray_private_lists_every_private_name_it_imports():
    listed = {(m, n) for m, names in ray_private.PRIVATE_NAMES.items() for n in names}
    assert private_imports(HOME) == listed


def test_no_other_module_of_relay_imports_a_private_ray_name():
    elsewhere = {
        str(path.relative_to(PACKAGE)): sorted(private_imports(path))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME and private_imports(path)
    }
    assert elsewhere == {}


def test_the_check_sees_a_private_import(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text("def f():\n    from ray._private.state import state\n    return state\n")
    assert private_imports(stray) == {("ray._private.state", "state")}
