"""Checkpoint round trip: weights, optimizer and scheduler state and meta restore exactly."""

from __future__ import annotations

import json

import pytest
import torch

from relay import checkpoint
from relay.config import ScheduleConfig
from relay.epochs import build_scheduler
from relay.tasks import build_task

pytestmark = pytest.mark.timeout(120)


def _trained(name: str):
    task = build_task(name, "debug")
    split = task.load_data(0.2, 0)
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = build_scheduler(ScheduleConfig(name="cosine"), optimizer, 10, 3)
    batch = task.first_rows(split.train, 32)
    for _ in range(3):
        loss, _ = task.loss_and_stats(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return task, model, optimizer, scheduler


@pytest.mark.parametrize("name", ["digits", "charlm"])  # charlm: tied embedding weights
def test_round_trip(tmp_path, name):
    task, model, optimizer, scheduler = _trained(name)
    meta = {"epoch": 3, "metrics": {"val_loss": 1.25}, "config": {"task": name}}
    checkpoint.save(tmp_path, model, optimizer=optimizer, scheduler=scheduler, meta=meta)

    torch.manual_seed(1)
    fresh = task.build_model()
    checkpoint.load_weights(tmp_path, fresh)
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    if name == "charlm":
        assert fresh.head.weight.data_ptr() == fresh.tok_emb.weight.data_ptr()

    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, weight_decay=0.1)
    fresh_sched = build_scheduler(ScheduleConfig(name="cosine"), fresh_opt, 10, 3)
    state = checkpoint.load_train_state(tmp_path)
    # Saved keyed by parameter name (portable across strategies), loaded by position.
    names = [name for name, _ in fresh.named_parameters()]
    assert set(state.optimizer["state"]) == set(names)
    fresh_opt.load_state_dict(checkpoint.optimizer_state_by_index(state.optimizer, names))
    fresh_sched.load_state_dict(state.scheduler)
    saved, restored = optimizer.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for index, per_param in saved["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value, restored["state"][index][key]), (index, key)
    assert fresh_sched.state_dict() == scheduler.state_dict()
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()

    read = checkpoint.read_meta(tmp_path)
    assert {k: read[k] for k in meta} == meta
    assert set(read["versions"]) == {"relay", "ray", "torch"}
    json.loads((tmp_path / checkpoint.META).read_text())


def test_weights_file_is_safetensors_not_pickle(tmp_path):
    _, model, _, _ = _trained("digits")
    checkpoint.save(tmp_path, model, meta={"epoch": 1})
    header_len = int.from_bytes((tmp_path / checkpoint.WEIGHTS).read_bytes()[:8], "little")
    header = json.loads((tmp_path / checkpoint.WEIGHTS).read_bytes()[8 : 8 + header_len])
    assert "net.0.weight" in header


def test_mismatched_model_is_refused(tmp_path):
    _, model, _, _ = _trained("digits")
    checkpoint.save(tmp_path, model, meta={"epoch": 1})
    other = build_task("regression", "debug").build_model()
    with pytest.raises((ValueError, RuntimeError)):
        checkpoint.load_weights(tmp_path, other)
