"""What a person sees while a run trains: one line per epoch, and one per step report of a
run on a step clock, in the order they were written (relay/observe/console.py)."""

from __future__ import annotations

import io
import time

import pytest

from relay.observe import console
from relay.records import history

pytestmark = pytest.mark.timeout(60)


def test_epoch_and_step_lines_follow_the_run_in_order(tmp_path):
    out = io.StringIO()
    with console.follow(tmp_path, epochs=10, out=out, max_steps=40):
        history.append_step(tmp_path, {"epoch": 1, "step": 10, "train_loss": 2.5, "lr": 0.1})
        history.append(tmp_path, {"epoch": 1, "step": 20, "train_loss": 2.0, "val_loss": 2.1})
        history.append_step(tmp_path, {"epoch": 2, "step": 30, "train_loss": 1.5, "val_loss": 1.7})
        time.sleep(0.5)  # follow() reads the files every 0.2 s
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("  epoch 1 step 10/40") and "train_loss 2.5000" in lines[0]
    # A run with a step budget counts steps, not epochs of `epochs`.
    assert lines[1].startswith("epoch 1  step 20/40") and "val_loss 2.1000" in lines[1]
    assert lines[2].startswith("  epoch 2 step 30/40") and "val_loss 1.7000" in lines[2]
    assert "/10" not in lines[1]
