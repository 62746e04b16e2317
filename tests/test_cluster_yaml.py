"""cluster.yaml passes Ray's own cluster-launcher validation, offline, and keeps what relay needs.

Validation is the path `ray up` takes before it touches a cloud: `prepare_config` (merge with the
provider's defaults.yaml, fill per-type worker bounds) then `validate_config` (ray-schema.json
plus Ray's cross-field checks). Nothing here starts Ray or opens a network connection.
"""

from __future__ import annotations

import copy
import re
import socket
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any attempt to reach a cloud API: validation must work without credentials."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during cluster.yaml validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def ray_validate(config: dict) -> dict:
    """What `ray up` does before contacting the provider; returns the prepared config."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def all_commands(config: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands")
    keys += ("worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    commands = [cmd for key in keys for cmd in config.get(key) or []]
    for node_type in config["available_node_types"].values():
        commands += node_type.get("worker_setup_commands", [])
    return commands


def test_validates_with_ray_schema(raw):
    validate_config(raw)  # as written, before defaults are merged in
    prepared = ray_validate(raw)
    assert prepared["cluster_name"] == "relay"
    assert prepared["provider"]["type"] == "aws"
    assert prepared["auth"]["ssh_user"]
    assert prepared["head_node_type"] in prepared["available_node_types"]
    # prepare_config fills per-type bounds; the head is never a scaling target.
    assert prepared["available_node_types"][prepared["head_node_type"]]["max_workers"] == 0


def test_node_types(raw):
    types = raw["available_node_types"]
    head = raw["head_node_type"]
    assert types[head]["resources"].get("CPU", 0) <= 1, "training belongs on workers"
    workers = {name: spec for name, spec in types.items() if name != head}
    gpu = [name for name, spec in workers.items() if spec["resources"].get("GPU", 0) >= 1]
    cpu = [name for name, spec in workers.items() if not spec["resources"].get("GPU", 0)]
    assert gpu and cpu, f"want a CPU and a GPU worker type, got {sorted(workers)}"
    for spec in workers.values():
        assert 0 <= spec["min_workers"] <= spec["max_workers"] <= raw["max_workers"]


def test_setup_installs_pinned_project(raw):
    setup = raw["setup_commands"]
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for pin in ("ray[train,tune,serve]==2.60.0", "torch==2.13.0"):
        assert pin in pins, f"pyproject.toml no longer pins {pin}; update cluster.yaml too"
        assert any(f'"{pin}"' in cmd for cmd in setup), pin
    assert any(re.search(r"pip install -e\s+(\S+)", cmd) for cmd in setup)
    installed = re.search(r"pip install -e\s+(\S+)", " ".join(setup)).group(1)
    assert installed in raw["file_mounts"], "pip install -e must use the mounted repo"
    assert raw["file_mounts"][installed] == "."


def test_relay_home_reaches_every_node(raw):
    exports = [m for cmd in all_commands(raw) for m in re.findall(r"RELAY_HOME=([^\s'\"]+)", cmd)]
    assert exports, "RELAY_HOME is not set on the nodes"
    # relay resolves it as a local path: it must be an absolute (shared, mounted) path, no URL.
    assert all(path.startswith("/") for path in exports), exports
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = [cmd for cmd in raw[key] if "ray start" in cmd]
        assert start and all(". ~/.relay_env" in cmd for cmd in start), key


def test_dashboard_stays_on_loopback(raw):
    head_start = " ".join(raw["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in head_start
    assert "--address=$RAY_HEAD_IP:6379" in " ".join(raw["worker_start_ray_commands"])


def node_env(config: dict, home: Path) -> dict[str, str]:
    """The environment a node's `ray start` gets: the setup commands that write ~/.relay_env run
    for real (in `home`), then a shell sources it as the start commands do."""
    writers = [cmd for cmd in config["setup_commands"] if "> ~/.relay_env" in cmd]
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    for cmd in writers:
        subprocess.run(["bash", "-c", cmd], env=env, check=True, timeout=30)
    sourced = subprocess.run(
        ["bash", "-c", ". ~/.relay_env && env -0"],
        env=env, capture_output=True, check=True, timeout=30,
    )  # fmt: skip
    pairs = [item.split(b"=", 1) for item in sourced.stdout.split(b"\0") if b"=" in item]
    return {key.decode(): value.decode() for key, value in pairs}


TOKEN_PATH = "~/.ray/auth_token"  # Ray's default token path (RAY-NOTES: token authentication)


def auth_problems(config: dict, home: Path) -> list[str]:
    """Why a node of this cluster could start without token authentication, one line each."""
    problems = []
    env = node_env(config, home)
    if env.get("RAY_AUTH_MODE") != "token":
        problems.append(f"~/.relay_env sets RAY_AUTH_MODE={env.get('RAY_AUTH_MODE')!r}")
    if env.get("RAY_USAGE_STATS_ENABLED") != "0":
        problems.append("~/.relay_env leaves Ray's usage stats on")
    if config["file_mounts"].get(TOKEN_PATH) != TOKEN_PATH:
        problems.append(f"file_mounts does not copy {TOKEN_PATH} to the nodes")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in config[key]:
            if "ray start" in cmd and cmd.find(". ~/.relay_env") > cmd.find("ray start"):
                problems.append(f"{key}: ray start runs before ~/.relay_env is sourced")
    return problems


def test_every_node_starts_with_token_auth(raw, tmp_path):
    assert auth_problems(raw, tmp_path) == []


def _relay_env_without(name: str):
    def mutate(config: dict) -> None:
        config["setup_commands"] = [
            re.sub(rf"\s{name}=\S+", "", cmd) for cmd in config["setup_commands"]
        ]

    return mutate


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(_relay_env_without("RAY_AUTH_MODE"), "RAY_AUTH_MODE=None", id="no-mode"),
        pytest.param(_relay_env_without("RAY_USAGE_STATS_ENABLED"), "usage", id="usage-stats"),
        pytest.param(lambda c: c["file_mounts"].pop(TOKEN_PATH), "does not copy", id="no-token"),
        pytest.param(
            lambda c: c.update(head_start_ray_commands=["ray start --head; . ~/.relay_env"]),
            "before ~/.relay_env",
            id="env-after-start",
        ),
    ],
)
def test_auth_check_bites(raw, tmp_path, mutate, expected):
    broken = copy.deepcopy(raw)
    mutate(broken)
    problems = auth_problems(broken, tmp_path)
    assert any(expected in line for line in problems), problems


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda c: c.update(max_worker=6), id="unknown-top-level-key"),
        pytest.param(lambda c: c.update(max_workers="six"), id="wrong-type"),
        pytest.param(
            lambda c: c["available_node_types"]["gpu_worker"].update(min_worker=1),
            id="typo-in-node-type",
        ),
        pytest.param(
            lambda c: c["available_node_types"]["gpu_worker"].pop("resources"),
            id="node-type-without-resources",
        ),
    ],
)
def test_validation_bites(raw, mutate):
    broken = copy.deepcopy(raw)
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        ray_validate(broken)


def test_head_type_must_exist(raw):
    broken = copy.deepcopy(raw)
    broken["head_node_type"] = "no_such_type"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(broken)
