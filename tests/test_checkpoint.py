"""Checkpoint round trip: weights, optimizer and scheduler state and meta restore exactly."""

from __future__ import annotations

import json

import pytest
import torch

from relay.checkpoints import checkpoint
from relay.config import ScheduleConfig
from relay.tasks import build_task
from relay.training.epochs import build_scheduler

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


def _sharded(directory, name: str = "charlm"):
    """A sharded checkpoint as one rank writes it (DCP without a process group), with the
    trained model it holds."""
    from relay.config import OptimConfig, ParallelConfig
    from relay.parallel import Engine
    from relay.training.epochs import optimizer_spec

    task, model, optimizer, scheduler = _trained(name)
    engine = Engine(model, ParallelConfig(), *optimizer_spec(OptimConfig()))
    engine.optimizer.load_state_dict(optimizer.state_dict())
    engine.save_sharded(directory / checkpoint.SHARDS)
    checkpoint.save_state(
        directory,
        weights=None,
        scheduler=scheduler.state_dict(),
        meta={"epoch": 3, "metrics": {}, "config": {"task": name, "size": "debug"}},
    )
    return task, model


def test_whole_weights_stream_from_shards_as_the_model_holds_them(tmp_path):
    from safetensors.torch import load_file

    task, model = _sharded(tmp_path)
    assert checkpoint.read_meta(tmp_path)["format"] == "sharded"
    assert not (tmp_path / checkpoint.WEIGHTS).exists()
    checkpoint.validate(tmp_path)  # whole without the weights file

    loaded = checkpoint.load_weights(tmp_path, task.build_model())  # makes the file first
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied
    made = load_file(tmp_path / checkpoint.WEIGHTS)  # safetensors' own reader
    assert sorted(made) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(made[key], value), key
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.head.weight is loaded.tok_emb.weight  # the tie survives
    assert not list(tmp_path.glob(".*partial"))  # no temporary file left behind


def test_a_damaged_shard_is_named(tmp_path):
    _sharded(tmp_path)
    shard = tmp_path / checkpoint.SHARDS / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"__0_0\.distcp: cut short"):
        checkpoint.validate(tmp_path)
    shard.unlink()
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"__0_0\.distcp: missing"):
        checkpoint.validate(tmp_path)


def test_a_shard_index_that_names_code_is_refused_without_running_it(tmp_path):
    import os
    import pickle

    _sharded(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / checkpoint.SHARDS / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"names posix\.system"):
        checkpoint.validate(tmp_path)
    with pytest.raises(ValueError, match=r"names posix\.system"):
        checkpoint.load_weights(tmp_path, build_task("charlm", "debug").build_model())
    assert not marker.exists()
