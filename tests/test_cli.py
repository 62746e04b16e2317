"""The `relay` command end to end, in a subprocess with an embedded Ray cluster of its own."""

from __future__ import annotations

import html
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml
from support import (
    BIN,
    REPO,
    files_holding,
    mlflow_client,
    mlflow_server,
    pixels_of,
    render_page,
    stop_session,
    subprocess_env,
    tensorboard_scalars,
)

from relay.records import history, registry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def relay(*args: str, storage, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "relay"), *args],
        cwd=REPO,
        env=subprocess_env(RELAY_HOME=str(storage), **env),
        capture_output=True,
        text=True,
        timeout=240,
        check=check,
    )


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> Path:
    """Where the module's MLflow server keeps everything (its database, artifacts, log)."""
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def mlflow(mlflow_store):
    """A real MLflow server for this module's runs: (URI, its process). The last test of the
    module stops it."""
    with mlflow_server(mlflow_store) as server:
        yield server


# A password the tracked run below is given the way relay's refusal of a URI holding one says
# (test_secrets.py): in MLflow's environment variables. This server asks for none; the run's
# files, the server's store and every line printed must still not hold it.
SECRET = "s3cr3t-XYZ-77"


def test_train_json_runs_and_show(tmp_path, mlflow, mlflow_store):
    uri, _ = mlflow
    out = relay(
        "train", "examples/sine.yaml", "--set", "size=debug", "--set", "epochs=3", "--json",
        "--set", "tracking.tensorboard=true", "--set", f"tracking.mlflow.uri={uri}",
        "--set", "tracking.mlflow.experiment=cli-train", storage=tmp_path,
        MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=SECRET,
    )  # fmt: skip
    assert SECRET not in out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    # Quiet by default: a header, one line per epoch, the efficiency report, where the model
    # is, where MLflow shows the run, the JSON line.
    assert lines[0].startswith("run sine-")
    assert [line.split()[1] for line in lines[1:4]] == ["1/3", "2/3", "3/3"]
    assert lines[4].startswith("efficiency: 2 workers, ddp")
    report = lines[5:-4]
    assert [line.split()[0] for line in report] == [
        "start-up", "throughput", "step", "flops", "rank", "rank", "scaling"
    ], out.stdout  # fmt: skip
    assert lines[-4].startswith("model: sinetask:1 at ")
    assert lines[-3].startswith(f"mlflow: {uri}/#/experiments/")
    assert lines[-2].startswith("report: ")
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

    _check_mlflow_run(uri, result, history_epochs, tmp_path)

    # Each worker's own output, kept with the run: one attempt of each of the 2 ranks.
    logs = relay("runs", "logs", result["run_id"], storage=tmp_path).stdout.splitlines()
    assert [line.split(" on ")[0] for line in logs if "--- relay: rank" in line] == [
        "[rank 0] --- relay: rank 0 of 2",
        "[rank 1] --- relay: rank 1 of 2",
    ], logs

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
    _check_model_aliases(tmp_path, result, uri)

    shown_text = relay("runs", "show", result["run_id"], storage=tmp_path).stdout
    assert "efficiency: 2 workers, ddp" in shown_text
    assert "of measured matmul peak" in shown_text

    missing = relay("runs", "show", "nope", storage=tmp_path, check=False)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr

    # The password is in none of the files the run, the commands above and the MLflow server
    # wrote (the report page is written by now: `report:` above).
    assert files_holding(SECRET, tmp_path, mlflow_store) == []

    # Last, so that a machine without a browser (a skip outside CI) still ran every check above.
    _check_report_page(Path(lines[-2].removeprefix("report: ")), result, tmp_path)


def _check_report_page(page: Path, result: dict, tmp_path) -> None:
    """The page `relay train` wrote, in a real browser: it loads without console errors, every
    series is in the DOM, and the charts are drawn (the loss curves' colour is on screen)."""
    assert page == tmp_path / "runs" / result["run_id"] / "report.html"
    screenshot, dom, console = render_page(page, tmp_path)
    assert console == []
    record = registry.get_run(tmp_path, result["run_id"])
    metric = record["config"]["checkpoint"]["metric"]
    expected = {"train_loss", "val_loss", metric, "samples_per_s", "lr"}
    expected |= {"start-up", "compute", "communication", "input wait"}
    expected |= {"validation, checkpoint", "end"}
    assert set(re.findall(r'id="trace-([^"]+)"', dom)) == expected
    # loss; the task's metric unless it is a loss; throughput and lr; the time breakdown
    assert dom.count('<figure class="chart">') == 3 + (metric not in ("train_loss", "val_loss"))
    assert pixels_of(screenshot, (31, 119, 180)) > 300  # matplotlib's first colour: train_loss
    assert html.escape(f"epochs: {record['config']['epochs']}") in dom  # the config section

    # `relay report` writes it again, anywhere; a reference to nothing exits 2 with one line.
    again = relay("report", result["model"], "-o", str(tmp_path / "again.html"), storage=tmp_path)
    assert again.stdout.strip() == str(tmp_path / "again.html")
    assert "trace-train_loss" in (tmp_path / "again.html").read_text()
    missing = relay("report", "nope", storage=tmp_path, check=False)
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1


def _check_mlflow_run(uri: str, result: dict, epochs: list[dict], tmp_path) -> None:
    """The run as MLflow's own client reads it from the server: one MLflow run with the
    config as params, every epoch, the run's identity, its artifacts, and its model version
    in the Model Registry."""
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name("cli-train")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == result["run_id"] and run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "3" and run.data.params["parallel.strategy"] == "ddp"
    assert run.data.params["scaling.num_workers"] == "2"
    # The commit of the directory the run started in (the tests start relay in REPO), when
    # that is a git checkout.
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    commit = {"mlflow.source.git.commit": git.stdout.strip()} if git.returncode == 0 else {}
    expected_tags = {
        "relay.run_id": result["run_id"],
        "relay.task": "examples.sine:SineTask",
        "relay.strategy": "ddp",
        "relay.workers": "2 workers",
        "ray.version": ray.__version__,
        "torch.version": torch.__version__,
        **commit,
    }
    assert run.data.tags | expected_tags == run.data.tags
    assert commit or "mlflow.source.git.commit" not in run.data.tags
    logged = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in logged] == [
        (e["epoch"], pytest.approx(e["val_loss"], rel=1e-6)) for e in epochs
    ]

    def artifact(path: str) -> dict:
        return json.loads(Path(client.download_artifacts(run_id, path, str(tmp_path))).read_text())

    run_id = run.info.run_id
    assert artifact("relay/efficiency.json") == result["efficiency"]
    checkpoint_meta = Path(result["checkpoint"]) / "meta.json"
    assert artifact("relay-checkpoint/meta.json") == json.loads(checkpoint_meta.read_text())
    assert artifact("relay/meta.json") == json.loads(checkpoint_meta.read_text())
    version = client.get_model_version_by_alias("sinetask", "best")
    assert version.run_id == run.info.run_id and version.tags["relay.version"] == "1"
    assert version.tags["relay.checkpoints.checkpoint"] == result["checkpoint"]
    assert version.source == f"runs:/{run.info.run_id}/relay-checkpoint"


def _check_model_aliases(storage, result: dict, uri: str) -> None:
    """A user alias beside `best` and `latest`, resolved as any reference is (`relay serve`
    resolves the same way), and mirrored in MLflow's registry (the run was tracked there); bad
    input exits 2 with one line and changes nothing."""
    aliased = relay("models", "alias", "sinetask:1", "champion", storage=storage)
    assert aliased.stdout == "sinetask:champion -> sinetask:1\n"
    assert "mlflow: sinetask@champion set" in aliased.stderr
    client = mlflow_client(uri)
    assert client.get_model_version_by_alias("sinetask", "champion").tags["relay.version"] == "1"
    shown = json.loads(
        relay("models", "show", "sinetask:champion", "--json", storage=storage).stdout
    )
    assert shown["reference"] == "sinetask:1" and shown["checkpoint"] == result["checkpoint"]
    assert sorted(shown["aliases"]) == ["best", "champion", "latest"]
    assert shown["checkpoint_epoch"] == result["best_metrics"]["epoch"]
    assert "champion" in relay("models", storage=storage).stdout
    for argv, message in [
        (["alias", "sinetask:7", "x"], "model 'sinetask' has no version 7"),
        (["alias", "sinetask:1", "best"], "invalid alias 'best'"),
        (["alias", "--rm", "sinetask", "nope"], "has no alias 'nope'"),
        (["show", "sinetask:nope"], "no version or alias 'nope'"),
        (["alias", "sinetask", "x"], "NAME:VERSION ALIAS"),
    ]:
        bad = relay("models", *argv, storage=storage, check=False)
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
        assert message in bad.stderr, bad.stderr
    relay("models", "alias", "--rm", "sinetask", "champion", storage=storage)
    listed = json.loads(relay("models", "--json", storage=storage).stdout)
    assert listed["sinetask"]["aliases"] == {"best": 1, "latest": 1}
    assert set(client.get_registered_model("sinetask").aliases) == {"best"}
    # The run holds the model's checkpoint: `runs rm` refuses, and deletes nothing.
    refused = relay("runs", "rm", result["run_id"], storage=storage, check=False)
    assert refused.returncode == 2 and "sinetask:1" in refused.stderr
    assert Path(result["checkpoint"]).is_dir()


def test_config_prints_the_resolved_config(tmp_path):
    out = relay("config", "jobs/configs/charlm.yaml", "--set", "size=debug", storage=tmp_path)
    resolved = yaml.safe_load(out.stdout)
    assert resolved["size"] == "debug"
    assert resolved["checkpoint"]["metric"] == "val_loss"


def test_resume_a_run_on_another_worker_count_and_strategy(tmp_path, mlflow):
    uri, _ = mlflow
    tracked = (
        "--set", "tracking.tensorboard=true", "--set", f"tracking.mlflow.uri={uri}",
        "--set", "tracking.mlflow.experiment=cli-resume",
    )  # fmt: skip
    first = relay(
        "train", "jobs/configs/charlm.yaml", "--set", "size=debug", "--set", "epochs=2",
        *tracked, "--json", storage=tmp_path,
    )  # fmt: skip
    run = json.loads(first.stdout.strip().splitlines()[-1])
    resumed = relay(
        "train", "jobs/configs/charlm.yaml", "--set", "size=debug", "--set", "epochs=4",
        "--set", "scaling.num_workers=1", "--set", "parallel.strategy=fsdp",
        *tracked, "--resume", run["run_id"], "--json", storage=tmp_path,
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
    # ... and so does its MLflow run: one run, reopened, every epoch in it; the config's
    # first values stay its params, what the resume changed is tagged.
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name("cli-resume")
    (tracked_run,) = client.search_runs([experiment.experiment_id])
    assert tracked_run.info.run_name == run["run_id"] and tracked_run.info.status == "FINISHED"
    workers = client.get_metric_history(tracked_run.info.run_id, "workers")
    assert [(m.step, m.value) for m in workers] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    assert tracked_run.data.params["scaling.num_workers"] == "2"
    assert tracked_run.data.tags["relay.resumed.scaling.num_workers"] == "1"
    assert tracked_run.data.tags["relay.resumed.parallel.strategy"] == "fsdp"
    # Both calls registered a version; MLflow's `best` is relay's best.
    models = json.loads(relay("models", "--json", storage=tmp_path).stdout)
    best = client.get_model_version_by_alias("charlm", "best")
    assert best.tags["relay.version"] == str(models["charlm"]["best"])
    assert len(client.search_model_versions("name='charlm'")) == 2

    changed_model = relay(
        "train", "jobs/configs/charlm.yaml", "--set", "size=debug", "--set", "model.d_model=64",
        "--resume", run["run_id"], storage=tmp_path, check=False,
    )  # fmt: skip
    assert changed_model.returncode == 2 and "model:" in changed_model.stderr


def test_a_run_goes_on_when_its_mlflow_server_stops(tmp_path, mlflow):
    """The server stops after the run opened its MLflow run, before its first epoch: one
    warning, the run trains every epoch, and relay's own records have all of it. (Last in
    this module: it stops the module's server.)"""
    uri, server = mlflow
    run = subprocess.Popen(
        [
            str(BIN / "relay"), "train", "examples/sine.yaml", "--set", "size=debug",
            "--set", "epochs=3", "--set", f"tracking.mlflow.uri={uri}", "--json",
        ],
        cwd=REPO, env=subprocess_env(RELAY_HOME=str(tmp_path)), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not any("tracking" in json.loads(p.read_text()) for p in _records(tmp_path)):
        assert run.poll() is None and time.monotonic() < deadline, "the run never opened"
        time.sleep(0.2)
    stop_session(server)
    # Following the run's worker logs while it trains: it ends by itself when the run does.
    follow = subprocess.Popen(
        [str(BIN / "relay"), "runs", "logs", "-f", _records(tmp_path)[0].parent.name],
        cwd=REPO, env=subprocess_env(RELAY_HOME=str(tmp_path)), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = run.communicate(timeout=240)
    followed, _ = follow.communicate(timeout=60)
    assert follow.returncode == 0
    assert "[rank 0] --- relay: rank 0 of 2" in followed
    assert "[rank 1] --- relay: rank 1 of 2" in followed
    assert run.returncode == 0, err
    warnings = [line for line in err.splitlines() if f"MLflow at {uri} failed" in line]
    assert len(warnings) == 1 and "training goes on" in warnings[0], err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["metrics"]["epoch"] == 3 and result["model"] == "sinetask:1"
    record = registry.get_run(tmp_path, result["run_id"])
    assert record["status"] == "finished"
    assert [e["epoch"] for e in history.read(record["run_dir"])] == [1, 2, 3]


def _records(storage):
    try:
        return [p for p in (storage / "runs").glob("*/run.json") if p.stat().st_size]
    except FileNotFoundError:
        return []
