"""What the storage root's records may name: run ids and model names are whole names, model
versions and aliases point inside the storage root, a copied storage root serves its own
checkpoints (never the original's), and what relay creates there is the user's alone unless
the storage is a group's (setgid). No Ray: these are files. Deletion (`runs rm`, `runs gc`) is
tested in test_run_admin.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from test_run_admin import relay, write_run

from relay.records import registry

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def storage(tmp_path):
    storage = tmp_path / "storage"
    record = write_run(storage, "a-run", "finished", [], {"val_accuracy": 0.8})
    registry.register_version(
        storage, "digits", {"checkpoint": record["checkpoint"], "run_id": "a-run"}
    )
    return storage


def outside(storage: Path) -> Path:
    """A directory beside the storage root, with a run record and a checkpoint of its own."""
    victim = storage.parent / "victim"
    (victim / "epoch_0001").mkdir(parents=True)
    (victim / "epoch_0001" / "meta.json").write_text(json.dumps({"epoch": 1}))
    (victim / registry.RECORD).write_text(json.dumps({"run_id": "victim", "status": "finished"}))
    return victim


@pytest.mark.parametrize("name", ["digits\n", "../digits", "/tmp/digits", "", ".", "a/b", "-x"])
def test_a_name_is_one_whole_directory_name(storage, name):
    with pytest.raises(ValueError, match="invalid model name"):
        registry.register_version(storage, name, {"run_id": "a-run"})
    with pytest.raises(KeyError, match="invalid run id"):
        registry.get_run(storage, name)
    assert sorted(p.name for p in (storage / "models").iterdir()) == ["digits"]
    assert not registry.is_name(name)


def test_run_ids_and_model_names_never_reach_outside_the_storage_root(storage, capsys):
    victim = outside(storage)
    for ref in ("../../victim", str(victim)):
        with pytest.raises(KeyError, match="invalid run id"):
            registry.get_run(storage, ref)
    # A model "name" that walks out: listing it, aliasing it and showing it are all refused.
    (victim / "1.json").write_text(json.dumps({"model": "victim", "version": 1}))
    for argv in (["models", "../../victim"], ["models", "alias", "../../victim:1", "champ"]):
        code, out, err = relay(capsys, *argv, "--storage", str(storage))
        assert (code, out) == (2, "") and "invalid model name" in err, err
    assert not (victim / registry.ALIASES).exists()
    code, out, err = relay(capsys, "runs", "show", "a-run\n", "--storage", str(storage))
    assert (code, out) == (2, "") and "invalid run id" in err
    # A valid prefix still finds its run.
    assert registry.get_run(storage, "a-")["run_id"] == "a-run"


def version_file(storage: Path, name: str = "digits", number: int = 1) -> Path:
    return registry.models_root(storage) / name / f"{number}.json"


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_a_version_whose_checkpoint_lies_outside_storage_is_refused(storage, where):
    victim = outside(storage)
    recorded = str(victim / "epoch_0001") if where == "absolute" else "runs/../../victim/epoch_0001"
    record = json.loads(version_file(storage).read_text())
    version_file(storage, number=2).write_text(
        json.dumps({**record, "version": 2, "checkpoint": recorded})
    )
    with pytest.raises(KeyError, match=r"digits:2: its checkpoint .* lies outside the storage"):
        registry.resolve_model(storage, "digits:2")
    with pytest.raises(ValueError, match="lies outside the storage root"):
        registry.register_version(storage, "digits", {"checkpoint": str(victim / "epoch_0001")})


def test_a_version_records_its_checkpoint_relative_to_the_storage_root(storage, capsys):
    assert json.loads(version_file(storage).read_text())["checkpoint"] == "runs/a-run/epoch_0001"
    # Users see an absolute path, as before.
    code, out, _ = relay(capsys, "models", "--json", "--storage", str(storage))
    shown = json.loads(out)["digits"]["versions"][0]["checkpoint"]
    assert code == 0 and shown == str(storage / "runs/a-run/epoch_0001")


def test_a_copied_storage_serves_its_own_checkpoints(storage, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(storage, copy)
    for ref in ("digits:1", "a-run"):  # a model version, and a run (its record is absolute)
        found = registry._resolve_model(copy, ref)
        assert found.checkpoint == copy / "runs/a-run/epoch_0001", ref
    assert registry.get_run(copy, "a-run")["run_dir"] == str(copy / "runs/a-run")
    # A version written before checkpoints were relative names the original: refused there.
    record = json.loads(version_file(copy).read_text())
    version_file(copy).write_text(
        json.dumps({**record, "checkpoint": str(storage / record["checkpoint"])})
    )
    with pytest.raises(KeyError, match="outside the storage root"):
        registry._resolve_model(copy, "digits:1")
    # ...while in the original itself such a record still reads.
    version_file(storage).write_text(
        json.dumps({**record, "checkpoint": str(storage / record["checkpoint"])})
    )
    assert registry._resolve_model(storage, "digits:1").checkpoint.is_relative_to(storage)


@pytest.mark.parametrize(
    "aliases, message",
    [
        ({"champion": "../../victim"}, "names a version by its number"),
        ({"champion": "1"}, "names a version by its number"),
        ({"champion": True}, "names a version by its number"),
        ({"../x": 1}, "names a version by its number"),
        (["champion"], "not a map of aliases"),
        ({"champion": 7}, "names version 7, which model 'digits' does not have"),
    ],
)
def test_an_alias_names_an_existing_version(storage, capsys, aliases, message):
    (registry.models_root(storage) / "digits" / registry.ALIASES).write_text(json.dumps(aliases))
    with pytest.raises(KeyError, match=message):
        registry._resolve_model(storage, "digits:champion")
    code, out, err = relay(capsys, "models", "show", "digits:champion", "--storage", str(storage))
    assert (code, out) == (2, "") and message.split(",")[0] in err, err


# --- modes -------------------------------------------------------------------------------------


@pytest.fixture
def umask():
    """Set the process's umask for one test (restored after)."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def make_everything(storage: Path) -> dict[str, Path]:
    """What relay makes under a new storage root: as `fit` and `register_model` make them."""
    registry.check_writable(registry.runs_root(storage))
    run_dir = registry.runs_root(storage) / "a-run"
    registry.make_dir(run_dir, exist_ok=False)
    registry.reserve(run_dir)
    registry.write(run_dir, {"run_id": "a-run"})
    registry.register_version(storage, "digits", {"checkpoint": str(run_dir), "run_id": "a-run"})
    registry.set_alias(storage, "digits", 1, "champion")
    models = registry.models_root(storage)
    return {
        "dirs": [storage, registry.runs_root(storage), run_dir, models, models / "digits"],
        "files": [
            run_dir / registry.RECORD,
            run_dir / registry.RESERVE,
            models / "digits" / "1.json",
            models / "digits" / registry.ALIASES,
            models / "digits" / f".{registry.ALIASES}.lock",
        ],
    }


def test_what_relay_creates_under_storage_is_the_users_alone(tmp_path, umask):
    made = make_everything(tmp_path / "new" / "storage")
    assert {str(p): oct(mode(p)) for p in made["dirs"]} == {str(p): "0o700" for p in made["dirs"]}
    assert {str(p): oct(mode(p)) for p in made["files"]} == {str(p): "0o600" for p in made["files"]}


def test_a_groups_shared_storage_takes_the_users_umask(tmp_path, umask):
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o2770)  # setgid: how a group's shared directory is set up
    umask(0o007)  # the group reads and writes, others nothing
    made = make_everything(team / "storage")
    # Linux passes setgid on to every directory made in a setgid one.
    assert {str(p): oct(mode(p)) for p in made["dirs"]} == {str(p): "0o2770" for p in made["dirs"]}
    assert {str(p): oct(mode(p)) for p in made["files"]} == {str(p): "0o660" for p in made["files"]}
    # A world-writable /tmp is not a group's storage: no setgid, so private there.
    assert registry.dir_mode(Path("/tmp")) == 0o700


@pytest.mark.parametrize("ref", ["../../victim", "/tmp/victim", "a-sweep\n", ""])
def test_a_sweep_id_never_names_a_path_outside_the_sweeps(tmp_path, capsys, ref):
    """`relay sweeps show` and `relay tune --resume` read a sweep's spec from the directory its
    id names: an id that walks out of `<storage>/sweeps/` is refused before it is joined."""
    storage = tmp_path / "storage"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "sweep.json").write_text("{}")
    (storage / "sweeps").mkdir(parents=True)
    for argv in (["sweeps", "show", ref], ["tune", "--resume", ref]):
        code, out, err = relay(capsys, *argv, "--storage", str(storage))
        assert (code, out) == (2, ""), (argv, out, err)
        assert "invalid sweep id" in err or (ref == "" and "needs a" in err), (argv, err)
