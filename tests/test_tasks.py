"""Tasks and models in plain torch (no Ray): shapes, losses, deterministic splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay.tasks import BUILTIN, build_task, resolve_task_class, split_rows
from relay.tasks.charlm import read_corpus

pytestmark = pytest.mark.timeout(120)


# The Hugging Face tasks' other families too (their presets are gpt2 and bert).
OTHER_FAMILIES = [
    ("hf-causal-lm", {"family": "llama"}),
    ("hf-sequence-classification", {"family": "gpt2"}),
]


@pytest.mark.parametrize(("name", "model"), [(n, {}) for n in sorted(BUILTIN)] + OTHER_FAMILIES)
def test_debug_task_learns_in_one_process(name, model):
    task = build_task(name, "debug", model)
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


def _rows(columns) -> set[bytes]:
    return {row.tobytes() for row in columns["x"]}


def test_digits_test_split_is_fixed_and_never_trained_or_validated_on():
    from sklearn.datasets import load_digits

    # The source itself, to check that no image is lost, duplicated or relabelled.
    images, labels = load_digits(return_X_y=True)
    label_of = {
        row.astype(np.float32).tobytes(): int(y) for row, y in zip(images, labels, strict=True)
    }
    assert len(label_of) == len(images)  # every image distinct: rows compare by content
    task = build_task("digits", "debug")
    test = task.load_test()
    assert len(test["x"]) == round(0.15 * len(images))
    for val_fraction, seed in [(0.2, 0), (0.2, 1), (0.5, 7), (0.05, 3)]:
        split = task.load_data(val_fraction, seed)
        for column in ("x", "y"):  # the same images, in the same order, for every run
            np.testing.assert_array_equal(split.test[column], test[column])
        train, val, held = _rows(split.train), _rows(split.val), _rows(split.test)
        assert not held & train and not held & val and not train & val
        assert held | train | val == set(label_of)
        assert [label_of[row.tobytes()] for row in split.test["x"]] == split.test["y"].tolist()
    assert build_task("regression", "debug").load_test() is None  # a task may keep none


@pytest.mark.parametrize(("val_fraction", "seed"), [(0.2, 0), (0.3, 1), (0.1, 5)])
def test_split_rows_draws_the_test_rows_apart_from_seed_and_val_fraction(val_fraction, seed):
    ids = {"id": np.arange(1000)}
    split = split_rows(ids, val_fraction, seed, test_fraction=0.1)
    fixed = split_rows(ids, 0.2, 0, test_fraction=0.1).test["id"]
    np.testing.assert_array_equal(split.test["id"], fixed)
    parts = [set(split.train["id"]), set(split.val["id"]), set(split.test["id"])]
    assert sum(map(len, parts)) == 1000 and set().union(*parts) == set(range(1000))
    assert len(parts[1]) == round(900 * val_fraction)
    assert split_rows(ids, val_fraction, seed).test is None  # none unless asked for


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
