"""Secrets stay out of what relay writes and prints, and relay's processes report to no third
party: a tracking URI that carries credentials is refused (they belong in the environment,
which relay never records), and Ray's usage stats and MLflow's telemetry are off in the
clusters and clients relay starts. A run tracked with the credentials where the refusal points
(MLflow's environment variables) is test_cli.py's: it greps every file and line for them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import BIN, REPO, files_holding, subprocess_env

from relay import config

SECRET = "s3cr3t-XYZ-77"
SWEEP = REPO / "jobs" / "configs" / "digits-sweep.yaml"


def relay(*args: str, storage: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "relay"), *args],
        cwd=REPO,
        env=subprocess_env(RELAY_HOME=str(storage), **env),
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    ("uri", "instead"),
    [
        (f"https://admin:{SECRET}@mlflow.example:5000", "MLFLOW_TRACKING_PASSWORD"),
        (f"http://{SECRET}@127.0.0.1:5000", "MLFLOW_TRACKING_TOKEN"),  # a token as the user
        (f"postgresql://relay:{SECRET}@db.example/mlflow", "PGPASSWORD"),
        (f"postgresql+psycopg2://relay:pa%40{SECRET}@db:5432/mlflow", "PGPASSWORD"),
        (f"postgresql://db.example/mlflow?sslmode=require&password={SECRET}", "PGPASSWORD"),
        (f"mysql+pymysql://relay:{SECRET}@db.example/mlflow", "read_default_file"),
        (f"mssql+pyodbc:///?odbc_connect=DSN%3Dmlflow%3BPWD%3D{SECRET}", "DSN"),
    ],
)
def test_a_tracking_uri_with_a_credential_is_refused_without_echoing_it(uri, instead):
    with pytest.raises(config.ConfigError) as info:
        config.load(None, ["task=digits", f"tracking.mlflow.uri={uri}"])
    message = str(info.value)
    assert message.startswith("tracking.mlflow.uri:") and instead in message, message
    assert SECRET not in message and "***" in message, message


def test_a_bad_scheme_is_named_without_its_password():
    with pytest.raises(config.ConfigError) as info:
        config.load(None, ["task=digits", f"tracking.mlflow.uri=ftp://u:{SECRET}@host/x"])
    assert "not an MLflow tracking URI" in str(info.value) and SECRET not in str(info.value)


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:5000",
        "https://mlflow.example/prefix",
        "postgresql://relay@db.example:5432/mlflow?sslmode=require",  # a user, no password
        "sqlite:////data/with@sign/mlflow.db",
    ],
)
def test_a_tracking_uri_without_credentials_is_taken_as_it_is(uri):
    cfg = config.load(None, ["task=digits", f"tracking.mlflow.uri={uri}"])
    assert cfg.tracking.mlflow.uri == uri


def test_a_run_recorded_with_a_password_in_its_uri_shows_it_in_no_page_line_or_mark(tmp_path):
    """A run recorded before relay refused such URIs: its report page, where-line and a
    failure to reach MLflow (the mark file and its line) show the URI without the password."""
    from relay.observe.tracking import failures, mlflow_runs
    from relay.records import report

    uri = f"http://admin:{SECRET}@127.0.0.1:9"  # nothing listens there: each call fails
    record = {
        "run_id": "old-1", "run_dir": str(tmp_path), "task": "digits", "size": "debug",
        "status": "finished",
        "config": {"checkpoint": {"metric": "val_loss"},
                   "tracking": {"mlflow": {"uri": uri, "experiment": "relay"}}},
    }  # fmt: skip
    page = report.run_page(record)
    assert SECRET not in page and "http://***@127.0.0.1:9" in page
    where = mlflow_runs.where({"uri": uri, "run_id": "r1", "experiment_id": "1"})
    assert where.startswith("mlflow: http://***@127.0.0.1:9/#/") and SECRET not in where
    mlflow_runs.close_run(tmp_path, uri, "r1", "FINISHED")
    assert failures.failed(tmp_path, mlflow_runs.TRACKER)
    assert files_holding(SECRET, tmp_path) == []


@pytest.mark.timeout(120)
def test_a_uri_with_the_password_is_refused_by_every_command_that_takes_a_config(tmp_path):
    """Refused before anything is written: no cluster, no file, the password in no line. The
    way the refusal points to (the URI bare, the credentials in MLflow's environment
    variables) is taken by test_cli.py's tracked run, which then greps every file the run and
    the MLflow server wrote, and its output, for the password."""
    storage = tmp_path / "storage"
    storage.mkdir()
    with_password = f"http://admin:{SECRET}@127.0.0.1:9"
    train = ["train", "examples/sine.yaml", "--set", "size=debug"]
    refused = {
        "train": relay(*train, "--set", f"tracking.mlflow.uri={with_password}", "--json",
                       storage=storage),
        "config": relay("config", "examples/sine.yaml", "--set",
                        f"tracking.mlflow.uri={with_password}", storage=storage),
        "tune": relay("tune", str(SWEEP), "--set",
                      f"train.tracking.mlflow.uri={with_password}", storage=storage),
    }  # fmt: skip
    for command, out in refused.items():
        output = out.stdout + out.stderr
        assert SECRET not in output, (command, output)
        assert out.returncode == 2, (command, output[-2000:])
        assert "tracking.mlflow.uri:" in output and "MLFLOW_TRACKING_PASSWORD" in output
    assert files_holding(SECRET, storage) == []
    assert not (storage / "runs").exists()


TELEMETRY_PROBE = textwrap.dedent(
    """
    import json, os, sys, time, urllib.request
    import ray
    from relay.runtime import cluster
    from relay.observe.tracking import mlflow_runs

    cluster.connect(num_cpus=1, dashboard=True)  # the process that would send the report
    names = ("RAY_USAGE_STATS_ENABLED", "MLFLOW_DISABLE_TELEMETRY")
    worker = ray.get(ray.remote(num_cpus=0)(lambda: {n: os.environ.get(n) for n in names}).remote())
    # What the head's dashboard (the process that would send Ray's usage report) decided; asked
    # with the cluster's token (Ray 2.60's own helper: no public one).
    from ray._private.authentication.http_token_authentication import (
        get_auth_headers_if_auth_enabled,
    )
    url = "http://" + ray._private.worker.get_dashboard_url() + "/usage_stats_enabled"
    request = urllib.request.Request(url, headers=get_auth_headers_if_auth_enabled({}))
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                dashboard = json.load(answer)["data"]["usageStatsEnabled"]
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    mlflow_runs._client("sqlite:///" + sys.argv[1])  # how relay's processes reach MLflow
    from mlflow.telemetry.client import get_telemetry_client

    print(json.dumps({"worker": worker, "dashboard": dashboard,
                      "mlflow_client": get_telemetry_client() is not None}))
    """
)
# Each of these would decide for Ray or MLflow (MLflow stays quiet in CI or under pytest):
# the probe runs without them, as a user's shell would.
DECIDING = ("RAY_USAGE_STATS_ENABLED", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "CI",
            "PYTEST_CURRENT_TEST", "GITHUB_ACTIONS")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cluster_relay_starts_sends_no_usage_stats_and_mlflow_no_telemetry(tmp_path):
    env = {k: v for k, v in subprocess_env().items() if k not in DECIDING}
    env["RAY_USAGE_STATS_CONFIG_PATH"] = str(tmp_path / "absent.json")  # no ~/.ray choice
    out = subprocess.run(
        [sys.executable, "-c", TELEMETRY_PROBE, str(tmp_path / "m.db")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "worker": {"RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"},
        "dashboard": False,
        "mlflow_client": False,
    }, seen
