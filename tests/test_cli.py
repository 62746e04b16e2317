"""The `relay` command end to end, in a subprocess with an embedded Ray cluster of its own."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from support import BIN, REPO, subprocess_env

pytestmark = pytest.mark.timeout(300)


def relay(*args: str, storage, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "relay"), *args],
        cwd=REPO,
        env=subprocess_env(RELAY_HOME=str(storage)),
        capture_output=True,
        text=True,
        timeout=240,
        check=check,
    )


def test_train_json_runs_and_show(tmp_path):
    out = relay(
        "train", "examples/sine.yaml", "--set", "size=debug", "--set", "epochs=3", "--json",
        storage=tmp_path,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    # Quiet by default: a header, one line per epoch, where the model is, the JSON line.
    assert lines[0].startswith("run sine-")
    assert [line.split()[1] for line in lines[1:4]] == ["1/3", "2/3", "3/3"]
    assert lines[4].startswith("model: sinetask:1 at ")
    assert len(lines) == 6, out.stdout
    result = json.loads(lines[-1])
    assert {"run_id", "checkpoint", "metrics", "best_metrics"} <= set(result)
    assert result["checkpoint"].startswith(str(tmp_path))
    assert result["metrics"]["epoch"] == 3 and "val_loss" in result["metrics"]
    assert result["replicas_in_sync"] is True

    listed = relay("runs", storage=tmp_path).stdout
    assert result["run_id"] in listed and "finished" in listed

    shown = json.loads(
        relay("runs", "show", result["run_id"][:12], "--json", storage=tmp_path).stdout
    )
    assert shown["run_id"] == result["run_id"]
    assert [e["epoch"] for e in shown["history"]] == [1, 2, 3]
    assert shown["config"]["task"] == "examples.sine:SineTask"

    # The run became version 1 of the model named after its task, with both aliases.
    assert result["model"] == "sinetask:1"
    models = json.loads(relay("models", "--json", storage=tmp_path).stdout)
    assert models["sinetask"]["best"] == models["sinetask"]["latest"] == 1
    assert models["sinetask"]["versions"][0]["checkpoint"] == result["checkpoint"]
    assert "sinetask:1" in relay("models", storage=tmp_path).stdout

    missing = relay("runs", "show", "nope", storage=tmp_path, check=False)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


def test_config_prints_the_resolved_config(tmp_path):
    out = relay("config", "jobs/configs/charlm.yaml", "--set", "size=debug", storage=tmp_path)
    resolved = yaml.safe_load(out.stdout)
    assert resolved["size"] == "debug"
    assert resolved["checkpoint"]["metric"] == "val_loss"
