"""`relay sweeps`: a sweep read back from its files alone, no Ray. The sweeps here are laid out
by relay's own writers (the spec as `sweep.run` writes it, trial runs through `registry.write`
and `history.append`); tests/test_sweep.py reads back sweeps that really ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import cli_in_fresh_interpreter

from relay.cli import main
from relay.config import SweepConfig
from relay.records import history, registry

pytestmark = pytest.mark.timeout(120)

SWEEP_ID = "lr-sweep-20261130-120000-ab12"


def write_spec(storage: Path, sweep_id: str) -> Path:
    """A sweep's directory as `sweep.run` starts it: the validated spec, nothing else yet."""
    cfg = SweepConfig.model_validate(
        {
            "name": "lr-sweep",
            "train": {"task": "digits", "size": "debug", "epochs": 4, "storage": str(storage)},
            "search": {"optim.lr": {"grid": [0.1, 0.01, 0.001]}},
            "num_samples": 1,
            "asha": {"grace_period": 1, "reduction_factor": 2},
        }
    )
    sweep_dir = storage / "sweeps" / sweep_id
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.json").write_text(cfg.model_dump_json(indent=2))
    return sweep_dir


def write_run(
    storage: Path, run_id: str, status: str, accuracies: list[float], labels: dict | None = None
) -> Path:
    """A Train run's record (as `driver.fit` writes it) and its per-epoch history."""
    run_dir = registry.runs_root(storage) / run_id
    run_dir.mkdir(parents=True)
    record = {
        "run_id": run_id,
        "task": "digits",
        "size": "debug",
        "status": status,
        "started_at": "2026-11-30T12:00:05+00:00",
        "run_dir": str(run_dir),
        "resumes": 0,
        **(labels or {}),
        "config": {},
    }
    registry.write(run_dir, record)
    for epoch, accuracy in enumerate(accuracies, start=1):
        history.append(
            run_dir,
            {"epoch": epoch, "train_loss": 1 - accuracy, "val_loss": 1.1 - accuracy,
             "val_accuracy": accuracy, "samples_per_s": 1000.0, "epoch_s": 0.1},
        )  # fmt: skip
    return run_dir


def write_trial(storage: Path, trial_id: str, lr: float, status: str, accuracies: list[float]):
    labels = {"sweep": SWEEP_ID, "trial_id": trial_id, "params": {"optim.lr": lr}}
    return write_run(storage, f"{SWEEP_ID}-{trial_id}", status, accuracies, labels)


def relay(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_interrupted_sweep_is_shown_from_its_trial_runs(tmp_path, capsys):
    storage = tmp_path / "storage"
    write_spec(storage, SWEEP_ID)
    # The driver was killed: no result.json. One trial trained all 4 epochs (its record still
    # says "running": Tune ends a trial at max_t from outside), one was mid-run, one failed.
    write_trial(storage, "t_00000", 0.1, "running", [0.5, 0.7, 0.8, 0.9])
    write_trial(storage, "t_00001", 0.01, "running", [0.4, 0.6])
    write_trial(storage, "t_00002", 0.001, "failed", [0.1])
    # A run that is not one of the sweep's trials, though its id starts with the sweep's.
    write_run(storage, f"{SWEEP_ID}-by-hand", "finished", [0.99])

    code, out, err = relay(capsys, "sweeps", "show", SWEEP_ID, "--storage", str(storage), "--json")
    assert (code, err) == (0, "")
    view = json.loads(out)
    assert view["status"] == "incomplete"
    assert view["resume"] == f"relay tune --resume {SWEEP_ID} --storage {storage}"
    trials = {t["trial_id"]: t for t in view["trials"]}
    assert set(trials) == {"t_00000", "t_00001", "t_00002"}
    assert {t: trials[t]["config"]["optim.lr"] for t in trials} == {
        "t_00000": 0.1, "t_00001": 0.01, "t_00002": 0.001,
    }  # fmt: skip
    assert {t: trials[t]["status"] for t in trials} == {
        "t_00000": "completed", "t_00001": "incomplete", "t_00002": "error",
    }  # fmt: skip
    assert [trials[t]["epochs_run"] for t in sorted(trials)] == [4, 2, 1]
    # ASHA (grace 1, factor 2, 4 epochs) compares trials after epochs 1, 2 and 4.
    assert view["asha_rungs"] == [1, 2, 4]
    assert trials["t_00001"]["rungs_reached"] == [1, 2]
    assert trials["t_00000"]["metrics"]["val_accuracy"] == 0.9  # its last epoch's
    assert trials["t_00001"]["best_score"] == 0.6
    assert view["best"]["trial_id"] == "t_00000"  # the best so far, by val_accuracy (max)

    code, text, _ = relay(capsys, "sweeps", "show", SWEEP_ID[:8], "--storage", str(storage))
    assert code == 0
    assert "still running, or interrupted" in text and view["resume"] in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("t_0")}
    assert "completed" in rows["t_00000"] and "optim.lr=0.1" in rows["t_00000"]
    assert "incomplete" in rows["t_00001"] and "error" in rows["t_00002"]
    assert "best so far: t_00000" in text

    code, out, _ = relay(capsys, "sweeps", "--storage", str(storage), "--json")
    (listed,) = json.loads(out)
    assert listed["sweep"] == SWEEP_ID and listed["status"] == "incomplete"
    assert listed["counts"] == {"completed": 1, "incomplete": 1, "error": 1}
    code, out, _ = relay(capsys, "sweeps", "--storage", str(storage))
    assert code == 0 and out.startswith(SWEEP_ID) and "incomplete" in out


def test_unreadable_sweeps_fail_in_one_line_naming_the_file_without_ray(tmp_path):
    storage = tmp_path / "storage"
    good = write_spec(storage, "good-20261130-120000-0001")
    spec = write_spec(storage, "bad-spec-20261130-120000-0002") / "sweep.json"
    spec.write_text(spec.read_text()[:80])  # cut short
    result = write_spec(storage, "bad-result-20261130-120000-0003") / "result.json"
    result.write_text('{"sweep": "bad-result-20261130-120000-0003", "trials": [')  # a killed write
    s = str(storage)
    results = cli_in_fresh_interpreter(
        {
            "unknown": ["sweeps", "show", "nope", "--storage", s],
            "bad_spec": ["sweeps", "show", spec.parent.name, "--storage", s],
            "bad_result": ["sweeps", "show", result.parent.name, "--storage", s],
            "list": ["sweeps", "--storage", s, "--json"],
            "good": ["sweeps", "show", good.name, "--storage", s],
        }
    )
    assert results["unknown"]["code"] == 2
    assert results["unknown"]["stderr"] == f"relay: no sweep 'nope' under {storage / 'sweeps'}\n"
    for case, path in (("bad_spec", spec), ("bad_result", result)):
        stderr = results[case]["stderr"]
        assert results[case]["code"] == 1, results[case]
        assert stderr.count("\n") == 1 and str(path) in stderr, stderr
    # The list shows every sweep it can read and names each file it cannot.
    listed = results["list"]
    lines = listed["stderr"].splitlines()
    assert listed["code"] == 1 and len(lines) == 2, listed
    assert any(str(spec) in line for line in lines) and any(str(result) in line for line in lines)
    assert results["good"] == {"code": 0, "stderr": ""}
    assert results["ray_imported"] is False  # reading sweeps never even imports Ray
