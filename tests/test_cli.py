"""The `relay` command end to end, in a subprocess with an embedded Ray cluster of its own."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from support import BIN, REPO, subprocess_env, tensorboard_scalars

from relay import history

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
        "--set", "tracking.tensorboard=true", storage=tmp_path,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    # Quiet by default: a header, one line per epoch, the efficiency report, where the model
    # is, the JSON line.
    assert lines[0].startswith("run sine-")
    assert [line.split()[1] for line in lines[1:4]] == ["1/3", "2/3", "3/3"]
    assert lines[4].startswith("efficiency: 2 workers, ddp")
    report = lines[5:-2]
    assert [line.split()[0] for line in report] == [
        "start-up", "throughput", "step", "flops", "rank", "rank", "scaling"
    ], out.stdout  # fmt: skip
    assert lines[-2].startswith("model: sinetask:1 at ")
    result = json.loads(lines[-1])
    assert {"run_id", "checkpoint", "metrics", "best_metrics", "efficiency"} <= set(result)
    assert result["efficiency"]["workers"] == 2
    assert result["checkpoint"].startswith(str(tmp_path))
    assert result["metrics"]["epoch"] == 3 and "val_loss" in result["metrics"]
    assert result["replicas_in_sync"] is True

    listed = relay("runs", storage=tmp_path).stdout
    assert result["run_id"] in listed and "finished" in listed

    # TensorBoard has every epoch of the run, as TensorBoard's own reader reads them back.
    history_epochs = history.read(tmp_path / "runs" / result["run_id"])
    scalars = tensorboard_scalars(tmp_path / "runs" / result["run_id"] / "tensorboard")
    assert {"train/loss", "val/loss", "run/samples_per_s", "run/lr"} <= set(scalars)
    assert scalars["val/loss"] == [
        (e["epoch"], pytest.approx(e["val_loss"], rel=1e-6)) for e in history_epochs
    ]

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

    shown_text = relay("runs", "show", result["run_id"], storage=tmp_path).stdout
    assert "efficiency: 2 workers, ddp" in shown_text
    assert "of measured matmul peak" in shown_text

    missing = relay("runs", "show", "nope", storage=tmp_path, check=False)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


def test_config_prints_the_resolved_config(tmp_path):
    out = relay("config", "jobs/configs/charlm.yaml", "--set", "size=debug", storage=tmp_path)
    resolved = yaml.safe_load(out.stdout)
    assert resolved["size"] == "debug"
    assert resolved["checkpoint"]["metric"] == "val_loss"


def test_resume_a_run_on_another_worker_count_and_strategy(tmp_path):
    first = relay(
        "train", "jobs/configs/charlm.yaml", "--set", "size=debug", "--set", "epochs=2",
        "--set", "tracking.tensorboard=true", "--json", storage=tmp_path,
    )  # fmt: skip
    run = json.loads(first.stdout.strip().splitlines()[-1])
    resumed = relay(
        "train", "jobs/configs/charlm.yaml", "--set", "size=debug", "--set", "epochs=4",
        "--set", "scaling.num_workers=1", "--set", "parallel.strategy=fsdp",
        "--set", "tracking.tensorboard=true", "--resume", run["run_id"], "--json",
        storage=tmp_path,
    )  # fmt: skip
    result = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert result["run_id"] == run["run_id"]
    epochs = json.loads(relay("runs", "show", run["run_id"], "--json", storage=tmp_path).stdout)
    history = epochs["history"]
    # Epochs 1-2 on 2 workers, then 3-4 on 1, continuing from the epoch-2 checkpoint: the loss
    # goes on falling from where it was instead of starting over.
    assert [(e["epoch"], e["workers"]) for e in history] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    assert history[2]["train_loss"] < history[1]["train_loss"] < history[0]["train_loss"]
    assert epochs["resumes"] == 1 and epochs["config"]["parallel"]["strategy"] == "fsdp"
    # TensorBoard's curves go on where the first run's ended, in the same run directory.
    scalars = tensorboard_scalars(tmp_path / "runs" / run["run_id"] / "tensorboard")
    assert [step for step, _ in scalars["run/workers"]] == [1, 2, 3, 4]
    assert [value for _, value in scalars["run/workers"]] == [2, 2, 1, 1]

    changed_model = relay(
        "train", "jobs/configs/charlm.yaml", "--set", "size=debug", "--set", "model.d_model=64",
        "--resume", run["run_id"], storage=tmp_path, check=False,
    )  # fmt: skip
    assert changed_model.returncode == 2 and "model:" in changed_model.stderr
