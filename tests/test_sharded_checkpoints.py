"""Sharded checkpoints through real runs on the shared Ray cluster: every fsdp rank writes its
own shards, Ray Train merges them into one checkpoint (also while training goes on: async
upload), and the run resumes from them on another worker count and under another strategy.

Four Train runs in all (each costs ~10-15 CPU-s of Ray start-up, far more than its epochs): one
fsdp run that both tests share, an async copy of it, and the two resumes.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from support import BIN, REPO, first_epoch_start, subprocess_env

import relay
from relay.checkpoints import checkpoint
from relay.config import from_dict
from relay.records import registry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _config(epochs: int, workers: int, strategy: str):
    return from_dict(
        {
            "name": "sharded",
            "task": "charlm",
            "size": "debug",
            "epochs": epochs,
            "batch_size": 32,
            "optim": {"lr": 0.003},
            "parallel": {"strategy": strategy},
            "scaling": {"num_workers": workers, "resources_per_worker": {"CPU": 1}},
            "checkpoint": {"keep": None},
        }
    )


def _with_upload(cfg, upload: str):
    return cfg.model_copy(
        update={"checkpoint": cfg.checkpoint.model_copy(update={"upload": upload})}
    )


@pytest.fixture(scope="module")
def fsdp_run(ray_cluster, relay_home):
    """One 3-epoch fsdp run on 2 workers, uploading its checkpoints synchronously, shared by
    the module's tests: the async-upload test compares its checkpoints with an async run's,
    then the resume test continues it on other worker counts and strategies (in that order,
    the file's: the resume adds epochs)."""
    cfg = _with_upload(_config(epochs=3, workers=2, strategy="fsdp"), "sync")
    result = relay.train(cfg, out=None)
    return result, Path(registry.get_run(relay_home, result.run_id)["run_dir"])


def _shard_files(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / checkpoint.SHARDS).iterdir())


def _check_uploaded(run_dir: Path, epochs: list[str]) -> None:
    """Every epoch's checkpoint reached storage whole and counts (keep: all), the last one is
    the latest registered, and no rank left its local staging copy behind."""
    names = sorted(p.name for p in run_dir.glob("epoch_*"))
    assert names == epochs, (run_dir.name, names)
    for name in names:
        checkpoint.validate(run_dir / name)
    latest = checkpoint.latest_registered(run_dir)
    assert latest is not None and latest[0].name == epochs[-1], (run_dir.name, latest)
    leftovers = list(Path(tempfile.gettempdir()).glob(f"relay-ckpt-{run_dir.name}-*"))
    assert leftovers == [], leftovers


def _weights_of(directory: Path, tmp_path: Path):
    """A checkpoint's whole weights, from whichever format it was written in."""
    from safetensors.torch import load_file

    from relay.checkpoints import consolidate

    out = tmp_path / f"{directory.parent.name}-{directory.name}"
    return load_file(consolidate.export(directory, out) / checkpoint.WEIGHTS)


def test_async_upload_registers_the_same_checkpoints_as_sync(fsdp_run, relay_home, tmp_path):
    """Sharded (fsdp): every rank copies its own shards while training goes on, and Ray Train
    merges them. (Async upload of a whole checkpoint, which rank 0 alone writes, is checked by
    the resume test's ddp epochs.)"""
    cfg = _with_upload(_config(epochs=3, workers=2, strategy="fsdp"), "async")
    result = relay.train(cfg, out=None)
    runs = {
        "sync": fsdp_run[1],
        "async": Path(registry.get_run(relay_home, result.run_id)["run_dir"]),
    }
    for run_dir in runs.values():
        _check_uploaded(run_dir, ["epoch_0001", "epoch_0002", "epoch_0003"])
    # The same seed and data: the copies made while training went on hold the same weights
    # as those training waited for.
    for name in ("epoch_0001", "epoch_0002"):
        synced = _weights_of(runs["sync"] / name, tmp_path)
        overlapped = _weights_of(runs["async"] / name, tmp_path)
        assert sorted(synced) == sorted(overlapped)
        assert all(torch.equal(v, overlapped[k]) for k, v in synced.items()), name


def test_fsdp_shards_resume_on_one_worker_then_under_ddp_on_two(fsdp_run, relay_home, tmp_path):
    """Also, on the last resume (2 epochs, async upload): a whole checkpoint, gathered and
    written by rank 0 alone, uploaded while training goes on; and the efficiency report's
    start-up of a resumed run (the 1-worker reference test in test_strategy_runs.py checks a
    fresh run's)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    first, run_dir = fsdp_run
    epoch2 = run_dir / "epoch_0002"
    meta = checkpoint.read_meta(epoch2)
    assert (meta["format"], meta["workers"]) == ("sharded", 2)
    # Each rank's file came from that rank's own upload; rank 0 added the index.
    assert _shard_files(epoch2) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # The registered version has whole weights, streamed from the shards: the same tensors as
    # torch's own (all-in-memory) conversion of the shards gives.
    best = Path(first.checkpoint)
    whole = load_file(best / checkpoint.WEIGHTS)
    dcp_to_torch_save(best / checkpoint.SHARDS, tmp_path / "all.pt")
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(whole) == sorted(everything["model"])
    for key, value in whole.items():
        assert torch.equal(value, everything["model"][key]), key
    assert "tok_emb.weight" in everything["optim"]["state"]  # optimizer moments are in the shards

    # `relay export` of a checkpoint that has no whole weights yet: a directory to load
    # elsewhere (weights streamed from the shards, meta.json), without shards or optimizer.
    epoch1 = run_dir / "epoch_0001"
    assert not (epoch1 / checkpoint.WEIGHTS).exists()
    exported = subprocess.run(
        [str(BIN / "relay"), "export", str(epoch1), "--out", str(tmp_path / "exported")],
        cwd=REPO, env=subprocess_env(RELAY_HOME=str(relay_home)), capture_output=True,
        text=True, timeout=120, check=True,
    )  # fmt: skip
    assert exported.stdout.strip() == str(tmp_path / "exported")
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == [
        checkpoint.META,
        checkpoint.WEIGHTS,
    ]
    dcp_to_torch_save(epoch1 / checkpoint.SHARDS, tmp_path / "epoch1.pt")
    epoch1_model = torch.load(tmp_path / "epoch1.pt", weights_only=True)["model"]
    exported_weights = load_file(tmp_path / "exported" / checkpoint.WEIGHTS)
    assert all(torch.equal(v, epoch1_model[k]) for k, v in exported_weights.items())
    assert not torch.equal(exported_weights["tok_emb.weight"], whole["tok_emb.weight"])

    # 2 -> 1 worker, still fsdp (one rank: its whole state in one file) ...
    relay.train(_config(epochs=4, workers=1, strategy="fsdp"), out=None, run_id=first.run_id)
    assert _shard_files(run_dir / "epoch_0004") == [".metadata", "__0_0.distcp"]
    # ... then 1 -> 2 workers under ddp, which writes whole checkpoints: epoch 5's uploaded
    # while epoch 6 trains (async; the last epoch's upload is always waited for).
    called = time.time()
    last = relay.train(
        _with_upload(_config(epochs=6, workers=2, strategy="ddp"), "async"),
        out=None,
        run_id=first.run_id,
    )
    assert [checkpoint.read_meta(run_dir / f"epoch_000{e}")["format"] for e in (5, 6)] == [
        "full",
        "full",
    ]
    _check_uploaded(run_dir, [f"epoch_000{e}" for e in range(1, 7)])

    workers = [(e["epoch"], e["workers"]) for e in last.history]
    assert workers == [(1, 2), (2, 2), (3, 2), (4, 1), (5, 2), (6, 2)]
    losses = [e["train_loss"] for e in last.history]
    # Each resume went on from where the run was (weights and optimizer moments), instead of
    # starting over: the loss keeps falling below epoch 3's.
    assert losses[5] < losses[4] < losses[3] < losses[2] < losses[1] < losses[0], losses

    # Start-up, against the test's own clock and the history: this call's, not the first
    # call's (whose first epoch began long before this call started). The run's figure ends
    # when this call's first epoch began (fit() starts within a second of the call); the
    # report's when its first step ended, a step later. (History stamps an epoch's start a few
    # ms late, and startup_s is rounded: hence the small slack.)
    epoch_started = first_epoch_start(run_dir, called)
    assert epoch_started - called - 1.0 <= last.startup_s <= epoch_started - called + 0.01
    startup = last.efficiency["startup"]
    assert -0.05 <= startup["total_s"] - last.startup_s < 2.0
    assert startup["restarts"] == 0 and startup["restarted_after_s"] is None
