"""Tasks and models in plain torch (no Ray): shapes, losses, deterministic splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay.tasks import BUILTIN, build_task, resolve_task_class
from relay.tasks.charlm import read_corpus

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_debug_task_learns_in_one_process(name):
    task = build_task(name, "debug")
    split = task.load_data(val_fraction=0.2, seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = task.first_rows(split.train, 64)
    losses = []
    for _ in range(30):
        loss, stats = task.loss_and_stats(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    summary = task.summarize({k: float(v) for k, v in stats.items()})
    assert summary["loss"] == pytest.approx(losses[-1], rel=1e-5)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_split_is_seeded_and_disjoint(name):
    task = build_task(name, "debug")
    a, b, c = (task.load_data(0.2, seed) for seed in (0, 0, 1))
    key = next(iter(a.train))
    np.testing.assert_array_equal(a.train[key], b.train[key])
    assert not np.array_equal(a.val[key], c.val[key])
    total = len(a.train[key]) + len(a.val[key])
    assert len(a.val[key]) == round(total * 0.2)


def test_digits_metric_and_pixels():
    task = build_task("digits", "debug")
    split = task.load_data(0.2, 0)
    assert split.train["x"].min() >= 0 and split.train["x"].max() <= 16
    assert resolve_task_class("digits").metric == "val_accuracy"


def test_charlm_reads_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.txt").write_text("second file\n" * 50)
    corpus = read_corpus(tmp_path, limit=10_000)
    assert corpus.startswith(b"hello world") and b"second file" in corpus
    task = build_task("charlm", "debug", data_path=str(tmp_path))
    split = task.load_data(0.2, 0)
    assert split.train["tokens"].shape[1] == task.hp.block_size + 1


def test_charlm_generates_from_a_prompt():
    task = build_task("charlm", "debug")
    model = task.build_model().eval()
    prompt = torch.tensor([list(b"def ")])
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    assert out.shape == (1, 9) and out[0, :4].tolist() == list(b"def ")


def test_user_task_by_import_path():
    cls = resolve_task_class("examples.sine:SineTask")
    assert "debug" in cls.sizes
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_task_class("relay.models:MLP")
