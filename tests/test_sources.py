"""Data from files, the parts that run inside Ray Data's tasks (relay/training/data/sources.py),
without a cluster: the hash split, the column mapping and the tasks' `preprocess`."""

from __future__ import annotations

import numpy as np
import pytest

from relay.config import ConfigError, from_dict
from relay.tasks import build_task
from relay.training.data import sources

pytestmark = pytest.mark.timeout(60)


def test_the_hash_split_is_stable_disjoint_and_independent_of_blocks():
    ids = np.arange(20_000)
    whole = sources.in_val(sources.row_hashes({"id": ids}, "id"), 0.2)
    # The same rows, read in other blocks and another order, land on the same side.
    order = np.random.default_rng(0).permutation(len(ids))
    blocks = np.array_split(order, 7)
    for block in blocks:
        assert (
            sources.in_val(sources.row_hashes({"id": ids[block]}, "id"), 0.2) == whole[block]
        ).all()
    assert 0.19 < whole.mean() < 0.21
    # A larger fraction only adds rows to validation.
    assert (sources.in_val(sources.row_hashes({"id": ids}, "id"), 0.3) >= whole).all()
    # The hash is pandas' (its fixed key): these values hold in every process and release.
    assert sources.row_hashes({"id": np.array([0, 1])}, "id").tolist() == [
        0,
        6238072747940578789,
    ]
    assert sources.row_hashes({"s": np.array(["a", "b"])}, "s").tolist() == [
        13950350942979735504,
        12688059582079114975,
    ]


def test_without_a_key_the_whole_row_is_hashed_tensors_included():
    batch = {"id": np.array([1, 1, 2]), "image": np.array([[[0, 1]], [[0, 2]], [[0, 1]]])}
    hashes = sources.row_hashes(batch, None)
    assert len(set(hashes.tolist())) == 3  # rows that differ in any column differ
    again = sources.row_hashes({name: batch[name][::-1] for name in batch}, None)
    assert again.tolist() == hashes.tolist()[::-1]
    with pytest.raises(sources.MissingColumn, match=r"data.split_key: .* no column 'key'"):
        sources.row_hashes(batch, "key")


def test_transform_splits_maps_columns_and_stacks_features():
    n = 1_000
    batch = {
        "id": np.arange(n),
        "a": np.arange(n, dtype=np.float64),
        "b": -np.arange(n, dtype=np.float64),
        "label": np.arange(n) % 3,
    }
    cfg = from_dict(
        {
            "task": "regression",
            "size": "debug",
            "data": {
                "format": "parquet",
                "path": "/data",
                "split_key": "id",
                "columns": {"x": ["a", "b"], "y": "label"},
            },
        }
    )
    task = build_task("regression", "debug")
    train = sources._transform(batch, data=cfg.data, task=task, part="train")
    val = sources._transform(batch, data=cfg.data, task=task, part="val")
    assert sorted(train) == ["x", "y"] and train["x"].shape == (len(train["y"]), 2)
    rows = np.concatenate([train["x"][:, 0], val["x"][:, 0]])
    assert sorted(rows.tolist()) == list(range(n))  # every row on exactly one side
    assert (train["x"][:, 1] == -train["x"][:, 0]).all()
    assert (train["y"] == train["x"][:, 0].astype(int) % 3).all()
    with pytest.raises(sources.MissingColumn, match=r"no column 'c' \(they have: a, b, id"):
        sources.select_columns(batch, {"x": ["a", "c"]})


def test_lists_read_from_files_become_matrices():
    ragged_free = np.empty(2, dtype=object)
    ragged_free[:] = [np.array([1.0, 2.0]), np.array([3.0, 4.0])]
    prepared = sources.prepare_batch({"x": ragged_free, "y": np.array([0, 1])})
    assert prepared["x"].shape == (2, 2) and prepared["x"].dtype == np.float64


def test_charlm_packs_lines_and_digits_decodes_images():
    charlm = build_task("charlm", "debug", {"block_size": 3})
    lines = {"text": np.array(["abc", "de", "fghij"], dtype=object)}
    tokens = charlm.preprocess(lines)["tokens"]
    assert bytes(tokens.reshape(-1)) == b"abc\nde\nfghij"[:12]
    assert tokens.shape == (3, 4)

    digits = build_task("digits", "debug")
    images = np.stack([np.full((8, 8), 255, np.uint8), np.zeros((8, 8), np.uint8)])
    decoded = digits.preprocess({"image": images, "label": np.array([3, 0])})
    assert decoded["x"].shape == (2, 64)
    assert decoded["x"][0].max() == 16.0 and decoded["x"][1].max() == 0.0  # the set's 0–16 scale
    assert decoded["y"].tolist() == [3, 0]
    with pytest.raises(ValueError, match=r"8×8 grayscale"):
        digits.preprocess({"image": np.zeros((1, 9, 9), np.uint8), "label": np.array([0])})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "parquet"}, "data.path: format 'parquet' needs a path"),
        ({"path": "/x", "columns": {"x": "a"}}, "data.columns: only for files"),
        ({"path": "/x", "split_key": "id"}, "data.split_key: only for files"),
        (
            {"format": "csv", "path": "/x", "val": "/y", "split_key": "id"},
            "data.split_key: the split comes from data.val",
        ),
        ({"format": "tsv", "path": "/x"}, "data.format: "),
        ({"path": "/x"}, "data.path: task 'digits' has built-in data"),
    ],
)
def test_bad_data_sections_fail_at_load_naming_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"task": "digits", "data": data})


def test_files_stream_unless_cached_and_task_data_caches_unless_told():
    files = from_dict({"task": "digits", "data": {"format": "images", "path": "/x"}})
    assert files.data.from_files and files.data.caches is False
    cached_files = from_dict(
        {"task": "digits", "data": {"format": "images", "path": "/x", "cache": True}}
    )
    assert cached_files.data.caches is True
    builtin = from_dict({"task": "digits"})
    assert not builtin.data.from_files and builtin.data.caches is True


def test_a_path_that_matches_nothing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.path: nothing matches"):
        sources._paths(str(tmp_path / "*.parquet"))
    with pytest.raises(FileNotFoundError, match=r"data.path: .* does not exist"):
        sources._paths(str(tmp_path / "missing"))
    (tmp_path / "b.csv").write_text("x\n1\n")
    (tmp_path / "a.csv").write_text("x\n1\n")
    assert sources._paths(str(tmp_path / "*.csv")) == [
        str(tmp_path / "a.csv"),
        str(tmp_path / "b.csv"),
    ]


def test_head_reads_a_few_task_rows_without_a_cluster(tmp_path):
    """`relay plan` measures the model on rows `head` reads on the driver, for every format."""
    from jobs.example_data import write_corpus, write_digit_images, write_digits_parquet

    write_digits_parquet(tmp_path / "digits")
    write_digit_images(tmp_path / "images", every=50)
    write_corpus(tmp_path / "corpus", limit=20_000)

    def head(task: str, **data) -> dict:
        cfg = from_dict({"task": task, "size": "debug", "data": data})
        return sources.head(cfg, build_task(task, "debug"), rows=40)

    digits = head(
        "digits",
        format="parquet",
        path=str(tmp_path / "digits"),
        columns={"x": "pixels", "y": "digit"},
    )
    # 8×8 tensors in the file, 64 intensities a row for the model; the data set's own rows.
    from sklearn.datasets import load_digits

    assert digits["x"].shape == (40, 64)
    assert (digits["x"] == load_digits().data[:40]).all()
    images = head("digits", format="images", path=str(tmp_path / "images"))
    assert images["x"].shape[1] == 64 and images["x"].max() <= 16.0
    assert set(images["y"].tolist()) <= set(range(10))
    text = head("charlm", format="text", path=str(tmp_path / "corpus"))
    assert text["tokens"].shape[1] == 33  # debug block_size 32, plus the next byte
