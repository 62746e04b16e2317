"""`relay runs rm`, `runs gc` and `runs compare` on a storage path written by relay's own
record functions (no Ray: these verbs only read and delete files). `models alias` and `models show`
on a trained model are tested in test_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import REPO

from relay import config
from relay.cli import main
from relay.records import registry

pytestmark = pytest.mark.timeout(60)


def write_run(storage: Path, run_id: str, status: str, overrides: list[str], metrics: dict):
    cfg = config.load(None, ["task=digits", *overrides])
    run_dir = registry.runs_root(storage) / run_id
    (run_dir / "epoch_0001").mkdir(parents=True)
    (run_dir / "epoch_0001" / "meta.json").write_text(json.dumps({"epoch": 1}))
    (run_dir / "epoch_0001" / "model.safetensors").write_bytes(b"w" * 1000)
    record = {
        "run_id": run_id,
        "task": "digits",
        "status": status,
        "started_at": f"2026-12-01T00:00:0{len(list(registry.runs_root(storage).iterdir()))}",
        "run_dir": str(run_dir),
        "config": cfg.model_dump(mode="json"),
        "metrics": metrics,
        "best_metrics": metrics,
        "checkpoint": str(run_dir / "epoch_0001"),
    }
    registry.write(run_dir, record)
    return record


def relay(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def storage(tmp_path):
    write_run(tmp_path, "a-run", "finished", ["optim.lr=0.01"], {"epoch": 3, "val_accuracy": 0.8})
    write_run(tmp_path, "b-run", "finished", ["optim.lr=0.1", "epochs=5"], {"val_accuracy": 0.9})
    served = write_run(tmp_path, "served", "finished", [], {"val_accuracy": 0.7})
    write_run(tmp_path, "live", "running", [], {})
    registry.register_version(
        tmp_path, "digits", {"checkpoint": served["checkpoint"], "run_id": "served"}
    )
    return tmp_path


def test_rm_deletes_runs_and_refuses_what_a_model_or_a_live_run_needs(storage, capsys):
    def present() -> set[str]:
        return {p.name for p in registry.runs_root(storage).iterdir()}

    everything = present()
    # One bad name among good ones: nothing at all is deleted.
    for names, message in [
        (["a-run", "nope"], "no run 'nope'"),
        (["a-run", "served"], "holds the checkpoint of model version digits:1; --force"),
        (["a-run", "live"], "is recorded as running"),
    ]:
        code, out, err = relay(capsys, "runs", "rm", *names, "--storage", str(storage))
        assert (code, out) == (2, "") and message in err and len(err.splitlines()) == 1, err
        assert present() == everything
    code, out, _ = relay(capsys, "runs", "rm", "a-run", "b-", "--storage", str(storage))
    assert code == 0 and out == "removed a-run, b-run\n"
    assert present() == everything - {"a-run", "b-run"}
    code, out, _ = relay(
        capsys, "runs", "rm", "live", "--force", "--json", "--storage", str(storage)
    )
    assert code == 0 and json.loads(out) == {"removed": ["live"]}
    assert present() == {"served"}
    code, _, err = relay(capsys, "runs", "rm", "--storage", str(storage))
    assert code == 2 and "name the runs" in err


def test_compare_puts_two_runs_side_by_side(storage, capsys):
    # Flags may come before the run ids, as in `relay runs logs -f RUN`.
    code, out, err = relay(capsys, "runs", "compare", "--json", "a-run", "b-run",
                           "--storage", str(storage))  # fmt: skip
    assert (code, err) == (0, "")
    comparison = json.loads(out)
    assert comparison["runs"] == ["a-run", "b-run"]
    # Only the fields that differ, by the names --set takes.
    assert comparison["config"] == {"epochs": [10, 5], "optim.lr": [0.01, 0.1]}
    assert comparison["metrics"] == {"epoch": [3, None], "val_accuracy": [0.8, 0.9]}

    code, out, _ = relay(capsys, "runs", "compare", "a-run", "b-run", "--storage", str(storage))
    lines = out.splitlines()
    assert lines[0].split() == ["run", "a-run", "b-run"]
    assert ["optim.lr", "0.01", "0.1"] in [line.split() for line in lines]
    assert ["epoch", "3", "-"] in [line.split() for line in lines]

    for argv, message in [
        (["a-run"], "takes 2 run ids, got 1"),
        (["a-run", "nope"], "no run 'nope'"),
    ]:
        code, out, err = relay(capsys, "runs", "compare", *argv, "--storage", str(storage))
        assert (code, out) == (2, "") and message in err


def test_gc_frees_the_checkpoints_of_runs_nobody_needs_and_keeps_their_records(
    storage, capsys, monkeypatch
):
    def checkpoints() -> set[str]:
        return {p.parent.parent.name for p in storage.glob("runs/*/epoch_*/model.safetensors")}

    before = checkpoints()
    for argv, message in [([], "--keep-best N"), (["--keep-best", "-1"], "not a count")]:
        code, _, err = relay(capsys, "runs", "gc", *argv, "--storage", str(storage))
        assert code == 2 and message in err
    # digits' metric is val_accuracy (max): b-run is the best; "served" is a model version's;
    # "live" is running. Only a-run's checkpoints go.
    code, out, _ = relay(capsys, "runs", "gc", "--keep-best", "1", "--dry-run", "--json",
                         "--storage", str(storage))  # fmt: skip
    planned = json.loads(out)
    assert code == 0 and [r["run_id"] for r in planned["runs"]] == ["a-run"]
    assert planned["bytes"] == 1000 + len(json.dumps({"epoch": 1}))
    assert checkpoints() == before  # a dry run deletes nothing
    code, out, _ = relay(capsys, "runs", "gc", "--keep-best", "1", "--storage", str(storage))
    assert code == 0 and out.splitlines()[0] == "deleted 1 checkpoints of a-run"
    assert checkpoints() == before - {"a-run"}
    record = registry.get_run(storage, "a-run")
    assert record["collected"]["checkpoints"] == ["epoch_0001"] and record["status"] == "finished"
    # Its record still shows (no "damaged checkpoint"), and it cannot be resumed.
    code, out, err = relay(capsys, "runs", "show", "a-run", "--storage", str(storage))
    assert (code, err) == (0, "") and "collected:" in out
    monkeypatch.setenv("RELAY_HOME", str(storage))
    code, _, err = relay(
        capsys, "train", str(REPO / "jobs/configs/digits.yaml"), "--resume", "a-run"
    )
    assert code == 2 and "deleted by `relay runs gc`" in err and "cannot resume" in err
    # keep-best 0: the best run goes too; the served one never does.
    relay(capsys, "runs", "gc", "--keep-best", "0", "--storage", str(storage))
    assert checkpoints() == {"served", "live"}


# --- deletion stays inside the storage it was asked about ---------------------------------------


def runs_and_checkpoints(storage: Path) -> set[str]:
    """Every file under runs/, relative to the storage root (what a deletion would lose)."""
    return {str(p.relative_to(storage)) for p in storage.glob("runs/**/*") if p.is_file()}


def copy_of(storage: Path, copy: Path) -> Path:
    """A copy of a storage root: every run.json in it still names the original's run_dir and
    checkpoint, as a `cp -r` or a restored backup leaves them."""
    import shutil

    shutil.copytree(storage, copy)
    assert registry.read(registry.runs_root(copy) / "a-run")["run_dir"].startswith(str(storage))
    return copy


def test_rm_in_a_copied_storage_deletes_only_the_copys_runs(storage, tmp_path, capsys):
    copy = copy_of(storage, tmp_path.parent / f"{tmp_path.name}-copy")
    original = runs_and_checkpoints(storage)
    code, _, err = relay(capsys, "runs", "rm", "a-run", "b-run", "--storage", str(copy))
    assert (code, err) == (0, ""), err
    assert runs_and_checkpoints(storage) == original  # the original lost nothing
    assert not (copy / "runs/a-run").exists() and not (copy / "runs/b-run").exists()
    # The copy's served run is still protected: its version names it by run id.
    code, _, err = relay(capsys, "runs", "rm", "served", "--storage", str(copy))
    assert code == 2 and "digits:1" in err


def test_gc_in_a_copied_storage_deletes_only_the_copys_checkpoints(storage, tmp_path, capsys):
    copy = copy_of(storage, tmp_path.parent / f"{tmp_path.name}-copy")
    original = runs_and_checkpoints(storage)
    code, out, err = relay(capsys, "runs", "gc", "--keep-best", "0", "--json",
                           "--storage", str(copy))  # fmt: skip
    assert (code, err) == (0, ""), err
    assert runs_and_checkpoints(storage) == original  # the original lost nothing
    planned = json.loads(out)["runs"]
    assert {r["run_id"] for r in planned} == {"a-run", "b-run"}
    assert all(r["run_dir"].startswith(str(copy)) for r in planned)  # where they lie now
    assert not list(copy.glob("runs/[ab]-run/epoch_0001"))
    assert (copy / "runs/served/epoch_0001").is_dir()


@pytest.mark.parametrize(
    "ref", ["../../{name}", "{path}", "", "a-run\n", "a-run/..", "runs/../a-run", "."]
)
def test_rm_refuses_a_run_id_that_is_not_one_directory_name(storage, tmp_path, capsys, ref):
    # A directory beside the storage that a joined "../../victim" (or its absolute path) reaches.
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.mkdir()
    (victim / RECORD_NAME).write_text(json.dumps({"run_id": "victim", "run_dir": str(victim)}))
    ref = ref.format(name=victim.name, path=victim)
    before = runs_and_checkpoints(storage)
    code, out, err = relay(capsys, "runs", "rm", ref, "--force", "--storage", str(storage))
    assert (code, out) == (2, "") and "invalid run id" in err, err
    assert (victim / RECORD_NAME).exists() and runs_and_checkpoints(storage) == before


RECORD_NAME = registry.RECORD


def test_a_record_that_names_another_run_is_not_deleted_as_that_run(storage, capsys):
    # runs/a-run/run.json claims to be b-run: neither rm nor gc takes it at its word.
    record = registry.read(storage / "runs/a-run")
    registry.write(storage / "runs/a-run", {**record, "run_id": "b-run"})
    code, _, err = relay(capsys, "runs", "rm", "a-run", "--storage", str(storage))
    assert code == 2 and "names run 'b-run'" in err, err
    assert (storage / "runs/a-run/epoch_0001").is_dir()
    relay(capsys, "runs", "gc", "--keep-best", "0", "--storage", str(storage))
    assert (storage / "runs/a-run/epoch_0001").is_dir()
    assert not (storage / "runs/b-run/epoch_0001").exists()  # b-run's own record: collected


def test_deletion_never_follows_a_symlink_out_of_runs(storage, tmp_path, capsys):
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    (outside / "epoch_0001").mkdir(parents=True)
    (outside / "epoch_0001" / "meta.json").write_text("{}")
    # A run directory that is a link to elsewhere, and a checkpoint that is one.
    record = registry.read(storage / "runs/a-run")
    (storage / "runs/linked").symlink_to(outside, target_is_directory=True)
    registry.write(outside, {**record, "run_id": "linked", "run_dir": str(outside)})
    (storage / "runs/b-run/epoch_0002").symlink_to(outside / "epoch_0001")
    code, _, err = relay(capsys, "runs", "rm", "linked", "--force", "--storage", str(storage))
    assert code == 2 and "outside" in err, err
    relay(capsys, "runs", "gc", "--keep-best", "0", "--storage", str(storage))
    assert (outside / "epoch_0001" / "meta.json").exists() and (outside / "run.json").exists()
    assert not (storage / "runs/b-run/epoch_0001").exists()  # b-run's real checkpoint went
