"""Resume after failure: a real worker process is SIGKILLed mid-run; Ray Train restarts the
worker group and the loop continues from the last checkpoint with model and optimizer state."""

from __future__ import annotations

from pathlib import Path

import pytest

import relay
from relay import history
from relay.config import from_dict

pytestmark = pytest.mark.timeout(400)

EPOCHS, KILL_AT = 5, 3


def config(**fields):
    return from_dict(
        {
            "name": "resume",
            "task": "regression",
            "size": "debug",
            "epochs": EPOCHS,
            "batch_size": 32,
            "optim": {"lr": 0.01},
            "schedule": {"name": "cosine"},  # step-dependent: a lost scheduler state would show
            "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            "checkpoint": {"every": 1, "keep": 2},
            "failure": {"max_failures": 1},
            **fields,
        }
    )


def test_killed_worker_resumes_from_checkpoint(ray_cluster, relay_home):
    baseline = relay.train(config(), out=None)
    killed = relay.train(
        config(fault_injection={"kill_rank": 1, "kill_at_epoch": KILL_AT}), out=None
    )

    # The worker really died: the rank-1 process SIGKILLed itself at the start of epoch 3.
    assert (Path(killed.run_dir) / ".fault-injected-rank1").exists()
    # Every epoch completed once the group restarted, none skipped.
    assert [e["epoch"] for e in killed.history] == list(range(1, EPOCHS + 1))
    raw_epochs = [e["epoch"] for e in history.read_raw(killed.run_dir)]
    assert raw_epochs[: KILL_AT - 1] == list(range(1, KILL_AT))
    # Only the work since the last registered checkpoint is redone: the restarted group went on
    # at epoch KILL_AT from the epoch KILL_AT - 1 checkpoint, not from epoch 1.
    assert raw_epochs == [*range(1, KILL_AT), *range(KILL_AT, EPOCHS + 1)], raw_epochs

    # The loss curve continues from the checkpoint: the seeded, deterministic run matches the
    # uninterrupted one epoch for epoch — which it would not had the resumed epochs started
    # without the checkpoint's optimizer (AdamW moments) and cosine-scheduler state.
    for ours, theirs in zip(killed.history, baseline.history, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4), ours["epoch"]
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-4), ours["epoch"]
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
    assert killed.replicas_in_sync is True
