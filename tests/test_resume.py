"""Resume after failure: a real worker process is SIGKILLed from outside, mid-epoch; Ray Train
restarts the worker group and the loop continues from the last registered checkpoint.

What comes back from the checkpoint: weights and optimizer state (AdamW moments). What does
not: the LR scheduler's own state — the loop recomputes the schedule's position from the epoch
it resumes at (`(epoch - 1) * steps_per_epoch` steps), so a run resumed on another worker count
gets the schedule right too. The test shows both give the uninterrupted run's numbers.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from support import process_gone, train_worker_pids

import relay
from relay import checkpoint, history
from relay.config import from_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

EPOCHS, KILL_AFTER = 5, 2


def config(storage: Path):
    return from_dict(
        {
            "name": "resume",
            "task": "digits",
            "size": "default",
            # Epochs of ~0.5 s, so the kill lands mid-epoch; no dropout, whose random masks a
            # checkpoint does not keep (a resumed run would draw others).
            "model": {"hidden": [512, 512], "dropout": 0.0},
            "epochs": EPOCHS,
            "batch_size": 16,
            "optim": {"lr": 0.001},
            "schedule": {"name": "cosine"},  # step-dependent: a wrong schedule position shows
            "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            "checkpoint": {"every": 1, "keep": 2},
            "failure": {"max_failures": 1},
            "storage": str(storage),
        }
    )


def kill_after_checkpoint(storage: Path, epoch: int, seen: dict) -> None:
    """Once Ray Train has registered the checkpoint of `epoch`, wait a random 0-0.3 s (the next
    epoch is training), SIGKILL a random worker, then wait for a new worker group."""
    rng = random.Random(7)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run_dirs = list((storage / "runs").glob("*"))
        latest = checkpoint.latest_registered(run_dirs[0]) if run_dirs else None
        if latest and latest[1] is not None and latest[1] >= epoch:
            break
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.3))
    old = train_worker_pids()
    pid = rng.choice(old)
    lines = history.read_raw(run_dirs[0])
    seen.update(
        pid=pid,
        registered=checkpoint.latest_registered(run_dirs[0])[1],
        lines=len(lines),
        epoch=max(e["epoch"] for e in lines),
    )
    os.kill(pid, signal.SIGKILL)
    seen["landed"] = process_gone(pid)
    while time.monotonic() < deadline:
        pids = train_worker_pids()
        if pids and not set(pids) & set(old):
            seen["restarted"] = pids
            return
        time.sleep(0.1)


def test_killed_worker_resumes_with_optimizer_state_and_recomputed_schedule(ray_cluster, tmp_path):
    baseline = relay.train(config(tmp_path / "baseline"), out=None)
    storage, seen = tmp_path / "killed", {}
    killer = threading.Thread(
        target=kill_after_checkpoint, args=(storage, KILL_AFTER, seen), daemon=True
    )
    killer.start()
    killed = relay.train(config(storage), out=None)
    killer.join(timeout=60)

    # The worker really died, and a new worker group took over.
    assert seen.get("landed") and seen.get("restarted"), seen
    # Every epoch completed, none skipped.
    assert [e["epoch"] for e in killed.history] == list(range(1, EPOCHS + 1))
    raw = [e["epoch"] for e in history.read_raw(killed.run_dir)]
    # Only the work since the last registered checkpoint is redone: after the kill, training
    # went on from the epoch after that checkpoint's, not from epoch 1.
    assert raw[: seen["lines"]] == list(range(1, seen["epoch"] + 1)), (raw, seen)
    assert raw[seen["lines"]] == seen["registered"] + 1, (raw, seen)
    assert raw[seen["lines"] :] == list(range(seen["registered"] + 1, EPOCHS + 1)), (raw, seen)

    # The loss curve continues from the checkpoint: the seeded, deterministic run matches the
    # uninterrupted one epoch for epoch — which it would not had the resumed epochs started
    # without the checkpoint's optimizer state (AdamW moments) or at the wrong point of the
    # cosine schedule (the lr is recomputed from the epoch, and matches).
    for ours, theirs in zip(killed.history, baseline.history, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5), ours["epoch"]
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5), ours["epoch"]
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
    assert killed.replicas_in_sync is True
