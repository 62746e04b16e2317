"""relay's Python API (relay/__init__.py): `relay.train` and `relay.tune` validate what they are
given before anything of Ray is imported, naming the field, as the CLI does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SWEEP = {
    "name": "api",
    "train": {"name": "api", "task": "digits"},
    "num_samples": 2,
    "search": {"optim.lr": {"loguniform": [1e-3, 1e-1]}},
}

# In a fresh interpreter: what the call raised, and whether Ray was imported by then.
PROBE = """
import json, sys
import relay
try:
    getattr(relay, sys.argv[1])(*json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
    raised = None
except Exception as exc:
    raised = f"{type(exc).__name__}: {exc}"
print(json.dumps({"raised": raised, "ray": "ray" in sys.modules}))
"""


def call(function: str, *args, **kwargs) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, function, json.dumps(args), json.dumps(kwargs)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("function", "argument", "field"),
    [
        ("tune", {**SWEEP, "num_samples": 0}, "num_samples"),
        ("tune", {**SWEEP, "colour": "blue"}, "colour"),
        ("train", {**SWEEP["train"], "epochs": -1}, "epochs"),
    ],
)
def test_a_bad_config_is_refused_naming_its_field_before_ray(function, argument, field):
    result = call(function, argument)
    assert result["raised"] and result["raised"].startswith(f"ConfigError: {field}"), result
    assert result["ray"] is False, result


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (["digits:best"], {"replicas": 0}, "replicas"),
        (["digits:best"], {"colour": "blue"}, "colour"),
        ("digits:best", {}, "refs"),
        ([], {}, "refs"),
    ],
)
def test_serve_refuses_a_bad_option_naming_it_before_ray(args, kwargs, field):
    result = call("serve", args, **kwargs)
    assert result["raised"] and result["raised"].startswith(f"ConfigError: {field}:"), result
    assert result["ray"] is False, result


def test_the_api_names_its_functions():
    import relay

    assert {"train", "tune", "serve", "load_config", "load_sweep_config"} <= set(relay.__all__)
    assert all(callable(getattr(relay, name)) for name in relay.__all__ if name != "__version__")
