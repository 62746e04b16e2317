"""The Ray-free epoch code (relay.training.epochs over relay.parallel) that relay's workers and the
plain-torchrun baseline both run: pure torch, one process, no Ray."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import pytest
import torch

from relay import parallel
from relay.config import from_dict
from relay.tasks import build_task
from relay.training.epochs import (
    CachedBatches,
    Epochs,
    build_scheduler,
    optimizer_spec,
    steps_per_epoch,
    to_tensors,
)

pytestmark = pytest.mark.timeout(120)


def test_epoch_code_imports_no_ray():
    # A fresh interpreter: this test process may have imported Ray already.
    check = (
        "import relay.training.epochs, relay.parallel, sys; "
        "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules), "
        "sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_cached_batches_yield_every_row_once_per_epoch_in_a_seeded_order():
    rows = {"i": torch.arange(23)}
    shuffled = CachedBatches(rows, batch_size=5, shuffle=True, seed=3)

    def order(batches: CachedBatches, epoch: int) -> list[list[int]]:
        return [batch["i"].tolist() for batch in batches.epoch(epoch)]

    first = order(shuffled, 1)
    assert [len(b) for b in first] == [5, 5, 5, 5, 3]
    assert sorted(itertools.chain(*first)) == list(range(23))
    assert order(shuffled, 1) == first  # the same epoch again: the same order
    assert order(CachedBatches(rows, batch_size=5, shuffle=True, seed=3), 1) == first
    assert order(shuffled, 2) != first  # reshuffled each epoch
    assert order(CachedBatches(rows, batch_size=5, shuffle=True, seed=4), 1) != first
    unshuffled = order(CachedBatches(rows, batch_size=5, shuffle=False, seed=3), 1)
    assert list(itertools.chain(*unshuffled)) == list(range(23))


def _run(overrides: dict, rows: int, world: int) -> tuple[Epochs, torch.nn.Module]:
    """One epoch of `regression` debug on this process's share of `rows` training rows (as
    many as each of `world` ranks gets), with relay's optimizer and schedule builders."""
    cfg = from_dict({"task": "regression", "size": "debug", "epochs": 1, **overrides})
    task = build_task(cfg.task, cfg.size, cfg.model)
    torch.manual_seed(cfg.seed)
    engine = parallel.Engine(task.build_model(), cfg.parallel, *optimizer_spec(cfg.optim))
    steps = steps_per_epoch(rows, world, cfg.batch_size, cfg.parallel.grad_accum)
    scheduler = build_scheduler(cfg.schedule, engine.optimizer, steps, cfg.epochs)
    columns = task.load_data(0.2, cfg.seed).train
    share = {name: array[: rows // world] for name, array in columns.items()}
    tensors = to_tensors(share, task.input_columns(), parallel.device())
    batches = CachedBatches(tensors, batch_size=cfg.batch_size, shuffle=False, seed=cfg.seed)
    epochs = Epochs(task, engine, scheduler, cfg)
    epochs.epoch(1, batches.epoch(1), batches.epoch(1))
    return epochs, engine.plain


@pytest.mark.parametrize(
    ("rows", "world", "batch_size", "grad_accum"),
    [(409, 1, 64, 1), (409, 2, 64, 1), (409, 2, 32, 3), (400, 4, 50, 2), (7, 2, 64, 4)],
)
def test_the_schedule_counts_the_steps_a_pass_takes(rows, world, batch_size, grad_accum):
    overrides = {
        "batch_size": batch_size,
        "parallel": {"grad_accum": grad_accum},
        "schedule": {"name": "linear"},
    }
    epochs, _ = _run(overrides, rows, world)
    taken = epochs.passes[0]["steps"]
    assert taken == steps_per_epoch(rows, world, batch_size, grad_accum)
    assert epochs.passes[0]["samples"] == rows // world
    # A linear decay sized by that count ends at zero exactly when the pass ends.
    assert epochs.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


def test_two_micro_batches_of_b_train_like_one_batch_of_2b():
    optim = {"name": "sgd", "lr": 0.05}
    _, accumulated = _run({"batch_size": 16, "parallel": {"grad_accum": 2}, "optim": optim}, 256, 1)
    _, whole = _run({"batch_size": 32, "optim": optim}, 256, 1)
    for (name, a), (_, b) in zip(
        accumulated.state_dict().items(), whole.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_share_of_a_pass_spent_waiting_for_input_is_measured():
    cfg = from_dict({"task": "regression", "size": "debug", "epochs": 1, "batch_size": 32})
    task = build_task(cfg.task, cfg.size, cfg.model)
    engine = parallel.Engine(task.build_model(), cfg.parallel, *optimizer_spec(cfg.optim))
    scheduler = build_scheduler(cfg.schedule, engine.optimizer, 8, cfg.epochs)
    columns = task.load_data(0.2, cfg.seed).train
    tensors = to_tensors(columns, task.input_columns(), parallel.device())
    batches = CachedBatches(tensors, batch_size=32, shuffle=False, seed=0)
    epochs = Epochs(task, engine, scheduler, cfg)

    def slow(epoch: int, pause_s: float):
        for batch in itertools.islice(batches.epoch(epoch), 8):
            time.sleep(pause_s)  # an input pipeline that cannot keep up
            yield batch

    starved = epochs.epoch(1, slow(1, 0.05), batches.epoch(1))["input_wait_share"]
    fed = epochs.epoch(2, slow(2, 0.0), batches.epoch(2))["input_wait_share"]
    # 8 pauses of 50 ms against steps of a 32-wide MLP: the pass is mostly waiting.
    assert 0.5 < starved <= 1.0
    assert 0 <= fed < starved
