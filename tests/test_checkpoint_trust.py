"""A checkpoint from elsewhere is data: it cannot make relay import code, nor read or allocate
beyond what it holds.

Each attack ships a checkpoint whose meta.json names `evilmod:Evil`, with an `evilmod.py` in the
working directory that leaves a marker file when imported. Every command that loads a
checkpoint must refuse it (exit 2, naming the flag that would allow it) without importing it;
the user may still allow it by name (`--allow-task`), and then it is their choice.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import BIN, subprocess_env

from relay import config
from relay.checkpoints import checkpoint
from relay.records import registry
from relay.tasks import build_task

pytestmark = pytest.mark.timeout(120)

EVIL = "evilmod:Evil"
MARKER = "evilmod-ran"
# A module that announces its import, with a proper Task: what a user might allow knowingly.
EVILMOD = textwrap.dedent(
    f"""
    from pathlib import Path

    Path(__file__).with_name({MARKER!r}).write_text("imported")

    from relay.tasks.regression import RegressionTask


    class Evil(RegressionTask):
        pass
    """
)


def _checkpoint(directory: Path, task_name: str) -> Path:
    """A real (full) checkpoint of a debug regression model whose meta.json names `task_name`."""
    torch.manual_seed(0)
    model = build_task("regression", "debug").build_model()
    meta = {"epoch": 1, "metrics": {}, "config": {"task": task_name, "size": "debug"}}
    return checkpoint.save(directory, model, meta=meta)


@pytest.fixture
def attack(tmp_path) -> dict[str, Path]:
    """A working directory holding evilmod.py, and beside it a checkpoint that names it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "evilmod.py").write_text(EVILMOD)
    return {
        "cwd": cwd,
        "marker": cwd / MARKER,
        "checkpoint": _checkpoint(tmp_path / "downloaded", EVIL),
        "storage": tmp_path / "storage",
    }


def relay(attack: dict[str, Path], *argv: str, timeout: int = 90) -> subprocess.CompletedProcess:
    # `relay train` takes its storage root from the config; every other command from --storage.
    storage = [] if argv[0] == "train" else ["--storage", str(attack["storage"])]
    return subprocess.run(
        [str(BIN / "relay"), *argv, *storage],
        cwd=attack["cwd"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_refused(result: subprocess.CompletedProcess, attack: dict[str, Path]) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert f"--allow-task {EVIL}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not attack["marker"].exists(), "the checkpoint's task module was imported"


@contextlib.contextmanager
def busy_port() -> Iterator[str]:
    """A port something listens on: `relay serve` that passes every check stops there, before
    it starts a cluster."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield str(busy.getsockname()[1])


def test_serve_refuses_a_checkpoint_naming_a_module_of_the_working_directory(attack):
    with busy_port() as port:
        result = relay(attack, "serve", str(attack["checkpoint"]), "--port", port)
    assert_refused(result, attack)
    assert str(attack["checkpoint"]) in result.stderr  # which checkpoint


def test_export_refuses_a_checkpoint_naming_a_task_nobody_allowed(attack, tmp_path):
    result = relay(attack, "export", str(attack["checkpoint"]), "--out", str(tmp_path / "out"))
    assert_refused(result, attack)
    assert not (tmp_path / "out").exists()


def _run_record(storage: Path, run_id: str, task_name: str, checkpoint_task: str) -> Path:
    """A run of `task_name` in the storage root whose checkpoint's meta.json names
    `checkpoint_task`; also Ray Train's record of it as the checkpoint a resume starts from."""
    cfg = config.load(None, ["task=regression", "size=debug", f"storage={storage}"])
    record_config = {**cfg.model_dump(mode="json"), "task": task_name}  # as the run recorded it
    run_dir = registry.runs_root(storage) / run_id
    directory = _checkpoint(run_dir / "epoch_0001", checkpoint_task)
    registry.write(
        run_dir,
        {
            "run_id": run_id,
            "task": task_name,
            "status": "finished",
            "started_at": "2026-12-01T00:00:00",
            "run_dir": str(run_dir),
            "config": record_config,
            "metrics": {"epoch": 1},
            "best_metrics": {"epoch": 1},
            "checkpoint": str(directory),
            "last_checkpoint": str(directory),
        },
    )
    latest = {"checkpoint_dir_name": directory.name, "metrics": {"epoch": 1}}
    (run_dir / checkpoint.RAY_SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": latest}))
    return directory


def test_runs_show_refuses_a_run_whose_checkpoint_names_another_task(attack):
    _run_record(attack["storage"], "tampered", "regression", EVIL)
    assert_refused(relay(attack, "runs", "show", "tampered"), attack)


@pytest.mark.timeout(300)
def test_a_resumed_run_refuses_a_checkpoint_naming_another_task(attack):
    _run_record(attack["storage"], "tampered", "regression", EVIL)
    run = f"task: regression\nsize: debug\nepochs: 2\nstorage: {attack['storage']}\n"
    (attack["cwd"] / "run.yaml").write_text(run)
    # (Before the fix this trained: hence the time allowed.)
    result = relay(attack, "train", "run.yaml", "--resume", "tampered", timeout=240)
    assert_refused(result, attack)
    assert "tampered" in result.stderr


def test_a_run_of_the_users_own_task_is_shown_without_allowing_it(attack):
    """The storage root is trusted: its record of a run names the task the user trained."""
    _run_record(attack["storage"], "mine", EVIL, EVIL)
    result = relay(attack, "runs", "show", "mine", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["task"] == EVIL
    assert not attack["marker"].exists()  # showing a run imports nothing


def test_a_task_the_user_allows_by_name_is_their_choice(attack, tmp_path):
    ckpt = str(attack["checkpoint"])
    other = relay(attack, "export", ckpt, "--allow-task", "evilmod:Other", "--out", str(tmp_path))
    assert_refused(other, attack)  # allowing one name allows no other
    with busy_port() as port:
        served = relay(attack, "serve", ckpt, "--allow-task", EVIL, "--port", port)
    assert served.returncode == 2 and "cannot listen on 127.0.0.1:" in served.stderr, served.stderr
    assert attack["marker"].exists()  # imported, as the user asked
    exported = relay(attack, "export", ckpt, "--allow-task", EVIL, "--out", str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / checkpoint.WEIGHTS).is_file()


def test_allow_task_must_name_a_module_and_class(attack):
    result = relay(attack, "export", str(attack["checkpoint"]), "--allow-task", "evilmod")
    assert result.returncode == 2
    assert "--allow-task" in result.stderr and "package.module:Class" in result.stderr


# Python, in the attack's working directory: what the API and a Serve replica do.
_IN_PROCESS = textwrap.dedent(
    """
    import json, sys
    from relay.checkpoints import checkpoint
    from relay.serving import model_table

    path = sys.argv[1]
    outcome = {}
    info = model_table.ModelInfo(
        name="m", reference=path, version=path, task="regression", checkpoint=path
    )
    for case, load in {
        "replica": lambda: model_table.load(info),
        "api": lambda: checkpoint.load_model(path),
        "api_allowed": lambda: checkpoint.load_model(path, allow_task=["evilmod:Evil"]),
    }.items():
        try:
            task, *_ = load() if case != "replica" else (load().task,)
            outcome[case] = type(task).__name__
        except Exception as exc:
            outcome[case] = f"{type(exc).__name__}: {exc}"
        from pathlib import Path
        outcome[case + "_imported"] = Path("evilmod-ran").exists()
    print(json.dumps(outcome))
    """
)


def test_a_replica_and_the_python_api_import_only_what_was_allowed(attack):
    out = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS, str(attack["checkpoint"])],
        cwd=attack["cwd"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    outcome = json.loads(out.stdout.strip().splitlines()[-1])
    # A replica loads only the task its driver checked (the model table's), whatever the file
    # says by the time the replica reads it.
    assert outcome["replica"].startswith("UntrustedTask:"), outcome
    assert EVIL in outcome["replica"] and not outcome["replica_imported"], outcome
    assert outcome["api"].startswith("UntrustedTask:") and "allow_task" in outcome["api"]
    assert not outcome["api_imported"], outcome
    assert outcome["api_allowed"] == "Evil" and outcome["api_allowed_imported"], outcome


# --- sharded checkpoints: the index may only point at what the checkpoint holds ----------------


def _sharded(directory: Path) -> Path:
    """A sharded checkpoint as one rank writes it (DCP without a process group)."""
    from relay.config import OptimConfig, ParallelConfig
    from relay.parallel import Engine
    from relay.training.epochs import optimizer_spec

    torch.manual_seed(0)
    model = build_task("regression", "debug").build_model()
    engine = Engine(model, ParallelConfig(), *optimizer_spec(OptimConfig()))
    engine.save_sharded(directory / checkpoint.SHARDS)
    meta = {"epoch": 1, "metrics": {}, "config": {"task": "regression", "size": "debug"}}
    checkpoint.save_state(directory, weights=None, meta=meta)
    return directory


def _rewrite_index(directory: Path, change) -> None:
    path = directory / checkpoint.SHARDS / ".metadata"
    index = pickle.loads(path.read_bytes())  # written by this test a moment ago
    change(index)
    path.write_bytes(pickle.dumps(index))


def _point_storage_at(path_of) -> callable:
    def change(index) -> None:
        for key, stored in index.storage_data.items():
            index.storage_data[key] = type(stored)(
                path_of(stored.relative_path), stored.offset, stored.length
            )

    return change


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_shard_index_pointing_outside_shards_is_refused(tmp_path, where):
    from relay.checkpoints.consolidate import consolidate

    directory = _sharded(tmp_path / "ckpt")
    shards = directory / checkpoint.SHARDS
    # The rank file, copied outside shards/: readable, so only the path gives it away.
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((shards / "__0_0.distcp").read_bytes())
    path_of = {"parent": lambda _: "../../outside.distcp", "absolute": lambda _: str(outside)}
    _rewrite_index(directory, _point_storage_at(path_of[where]))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="outside shards/"):
        checkpoint.validate(directory)
    with pytest.raises(ValueError, match="outside shards/"):
        consolidate(directory)
    assert not (directory / checkpoint.WEIGHTS).exists()


@pytest.mark.parametrize("claim", ["tensor", "tensor_and_chunk"])
def test_a_shard_index_claiming_a_huge_tensor_is_refused_before_allocation(tmp_path, claim):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    from relay.checkpoints.consolidate import export

    directory = _sharded(tmp_path / "ckpt")

    def change(index) -> None:
        key = next(k for k in index.state_dict_metadata if k.startswith("model."))
        stored = index.state_dict_metadata[key]
        ndim = len(stored.size)
        huge = torch.Size([10**12, *stored.size[1:]])  # 10^12 rows: terabytes
        chunks = stored.chunks
        if claim == "tensor_and_chunk":  # its one chunk claims to be the whole huge tensor
            chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * ndim), sizes=huge)]
        index.state_dict_metadata[key] = TensorStorageMetadata(stored.properties, huge, chunks)

    _rewrite_index(directory, change)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="bytes"):
        checkpoint.validate(directory)
    with pytest.raises(ValueError, match="bytes"):
        export(directory, tmp_path / "out")
    # Refused before the weights file was begun, let alone a tensor allocated.
    assert not (tmp_path / "out" / checkpoint.WEIGHTS).exists()


def test_an_untampered_sharded_checkpoint_still_loads(tmp_path):
    directory = _sharded(tmp_path / "ckpt")
    checkpoint.validate(directory)
    _, model = checkpoint.load_model(directory)
    assert (directory / checkpoint.WEIGHTS).is_file() and not model.training
