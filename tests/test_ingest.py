"""The object-store ingest (relay/training/data/ingest.py) on the shared local Ray cluster: a run's
in-memory
data reaches every rank without a Ray Data SplitCoordinator, and every rank gets its exact rows.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray.cloudpickle
import yaml
from support import REPO

import relay
from relay.config import from_dict
from relay.tasks import build_task
from relay.tasks.base import Split
from relay.training.data import ingest, sources

pytestmark = pytest.mark.timeout(300)

# Ray workers cannot import this test module by name: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAIN_ROWS, VAL_ROWS = 103, 11  # odd: a 2-worker split drops a row; blocks straddle ranks


def _split() -> Split:
    features = np.random.default_rng(0).normal(size=(TRAIN_ROWS + VAL_ROWS, 3)).astype("float32")
    ids = np.arange(TRAIN_ROWS + VAL_ROWS)
    return Split(
        train={"row": ids[:TRAIN_ROWS], "x": features[:TRAIN_ROWS]},
        val={"row": ids[TRAIN_ROWS:], "x": features[TRAIN_ROWS:]},
    )


def _rows_per_rank(config: dict) -> list[dict] | None:
    """Opens the run's ingest as the train loop does; rank 0 returns every rank's rows."""
    import warnings

    import torch
    import torch.distributed as dist

    def opened(name: str, shuffle: bool):
        return ingest.open_batches(
            config["data"],
            name,
            batch_size=10,
            dtypes={},
            device=torch.device("cpu"),
            cache=True,
            shuffle=shuffle,
            seed=config["seed"],
        )

    train, val = opened("train", True), opened("val", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.load()
        val.load()
    mine = {
        "epochs": {
            epoch: [torch.cat([b[c] for b in train.epoch(epoch)]).tolist() for c in ("row", "x")]
            for epoch in (1, 2)
        },
        "val": torch.cat([b["row"] for b in val.epoch(1)]).tolist(),
        "warnings": [str(w.message) for w in caught],
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks if dist.get_rank() == 0 else None


def _fit_rows_per_rank(tmp_path, name: str, put: ingest.PutSplit) -> list[dict]:
    import ray.train
    from ray.train.torch import TorchTrainer

    run_data = ingest.RunData(ingest.Ingest.OBJECT_STORE, put.train.rows, put=put)
    trainer = TorchTrainer(
        _rows_per_rank,
        train_loop_config={"data": run_data.loop_data(), "seed": 7},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=str(tmp_path)),
    )
    return trainer.fit().return_value


@pytest.mark.slow
def test_every_rank_gets_its_exact_rows_reshuffled_per_epoch(ray_cluster, tmp_path):
    split = _split()
    put = ingest.put_split(from_dict({"task": "digits"}), split)
    first = _fit_rows_per_rank(tmp_path, "rows-a", put)
    second = _fit_rows_per_rank(tmp_path, "rows-b", put)

    per_rank = TRAIN_ROWS // 2
    for rank in first:
        assert not [w for w in rank["warnings"] if "not writable" in w], rank["warnings"]
        for rows, x in rank["epochs"].values():
            assert len(rows) == per_rank  # equal step counts for DDP
            # Each row's features arrive with it (the blocks were sliced and joined right).
            np.testing.assert_array_equal(np.array(x, dtype="float32"), split.train["x"][rows])
        epoch_1, epoch_2 = (rank["epochs"][e][0] for e in (1, 2))
        assert sorted(epoch_1) == sorted(epoch_2)  # the same shard every epoch...
        assert epoch_1 != epoch_2  # ...in a new order
    shards = [set(rank["epochs"][1][0]) for rank in first]
    assert not shards[0] & shards[1]
    # streaming_split(equal=True)'s share: world * (rows // world) rows, the remainder dropped.
    assert shards[0] | shards[1] == set(range(2 * per_rank))
    val = [rank["val"] for rank in first]
    assert [len(v) for v in val] == [VAL_ROWS // 2] * 2 and not set(val[0]) & set(val[1])

    # Another run with the same seed: the same rows, in the same order, on every rank.
    assert [r["epochs"] for r in second] == [r["epochs"] for r in first]


def test_one_rank_fetches_all_rows_and_any_range_across_blocks(ray_cluster):
    split = _split()
    put = ingest.put_split(from_dict({"task": "digits"}), split)
    assert len(put.train.blocks) > 1  # ranges below really cross block boundaries

    everything = put.train.fetch(ingest.rank_rows(TRAIN_ROWS, 0, 1))
    for name, column in split.train.items():
        np.testing.assert_array_equal(everything[name], column)
        assert everything[name].flags.writeable  # a copy, not the object store's buffer
    for start, stop in [(0, 1), (5, 40), (13, 14), (60, TRAIN_ROWS), (30, 30)]:
        part = put.train.fetch(range(start, stop))
        np.testing.assert_array_equal(part["row"], np.arange(start, stop))
        assert part["x"].shape == (stop - start, 3)


def test_a_trial_shares_the_sweeps_put_only_when_its_data_would_be_the_same(ray_cluster):
    base = from_dict({"task": "charlm", "size": "debug"})
    shared = ingest.put_for_trials(base, ["optim.lr"])
    assert shared is not None
    same_data = from_dict({**base.model_dump(mode="json"), "optim": {"lr": 0.5}})
    assert ingest.prepare(same_data, shared=shared).put is shared

    def tokens(put: ingest.PutSplit) -> np.ndarray:
        return put.train.fetch(range(put.train.rows))["tokens"]

    # Configs whose data differs from the base's (charlm reads model.corpus_bytes; the seed and
    # val_fraction redraw the split) put their own: the base's tokens would be the wrong data.
    for change in ({"model": {"corpus_bytes": 5000}}, {"seed": 3}, {"data": {"val_fraction": 0.3}}):
        own = ingest.prepare(from_dict({**base.model_dump(mode="json"), **change}), shared=shared)
        assert own.put is not shared, change
        assert not np.array_equal(tokens(own.put), tokens(shared)), change
    # Nothing to share: the search varies the data, or the run streams through Ray Data.
    assert ingest.put_for_trials(base, ["seed", "optim.lr"]) is None
    streaming = from_dict({**base.model_dump(mode="json"), "data": {"cache": False}})
    assert ingest.put_for_trials(streaming, ["optim.lr"]) is None


def _actors(class_name: str) -> set[str]:
    """Every actor of the class the shared cluster has created (any state)."""
    from relay.runtime import ray_private

    return set(ray_private.actors_of_class(class_name))


@pytest.mark.slow
def test_in_memory_data_starts_no_split_coordinator_streaming_does(ray_cluster, relay_home):
    """Nor Ray Train's DatasetManager, which Ray starts for every worker group, Datasets or not
    (relay.runtime.ray_private.torch_trainer leaves it out of a run without them)."""
    watched = ("SplitCoordinator", "DatasetManager")

    def run(cache: bool) -> dict[str, set[str]]:
        before = {name: _actors(name) for name in watched}
        cfg = from_dict(
            {
                "name": f"ingest-cache-{cache}",
                "task": "digits",
                "size": "debug",
                "epochs": 1,
                "batch_size": 32,
                "data": {"cache": cache},
                "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            }
        )
        result = relay.train(cfg, out=None, register=False)
        assert [e["epoch"] for e in result.history] == [1]
        assert result.replicas_in_sync is True
        return {name: _actors(name) - before[name] for name in watched}

    started = run(cache=True)
    assert started == {"SplitCoordinator": set(), "DatasetManager": set()}, started
    # The same look-up finds the Ray Data path's actors: a coordinator per split dataset, and
    # the worker group's DatasetManager.
    started = run(cache=False)
    assert (len(started["SplitCoordinator"]), len(started["DatasetManager"])) == (2, 1), started


# --- data from files (relay/training/data/sources.py) ---------------------------------------


def _write_parquet(directory, ids: np.ndarray, files: int) -> None:
    """Rows `ids` as `files` Parquet files: id, four scalar features f0..f3 and a target."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    features = np.random.default_rng(int(ids[0])).normal(size=(len(ids), 4))
    for i, rows in enumerate(np.array_split(np.arange(len(ids)), files)):
        table = {"id": ids[rows], "target": features[rows].sum(axis=1)}
        table |= {f"f{k}": features[rows, k] for k in range(4)}
        pq.write_table(pa.table(table), directory / f"part-{i}.parquet")


def _file_config(tmp_path, **data) -> dict:
    return {
        "name": "files",
        "task": "tests.id_task:IdTask",
        "size": "debug",
        "epochs": 2,
        "batch_size": 50,
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "data": {
            "format": "parquet",
            "path": str(tmp_path / "train"),
            "columns": {"id": "id", "x": ["f0", "f1", "f2", "f3"], "y": "target"},
            **data,
        },
    }


@pytest.mark.slow
def test_a_hash_split_of_files_is_stable_and_a_missing_column_is_named(ray_cluster, tmp_path):
    ids = np.arange(1_000)
    _write_parquet(tmp_path / "train", ids, files=4)

    def counts(**data) -> dict[str, int]:
        cfg = from_dict(_file_config(tmp_path, val_fraction=0.25, **data))
        task = build_task(cfg.task, cfg.size)
        return sources.survey(cfg, task, sources.datasets(cfg, task))

    by_key, by_row = counts(split_key="id"), counts()
    # Every row lands on exactly one side, the same side each time the files are read.
    assert by_key == counts(split_key="id")
    for split in (by_key, by_row):
        assert split["train"] + split["val"] == len(ids)
        assert 150 <= split["val"] <= 350
    # The survey by footers and key column (taken above) counts what a full read counts.
    cfg = from_dict(_file_config(tmp_path, val_fraction=0.25, split_key="id"))
    task = build_task(cfg.task, cfg.size)
    assert sources._survey_by_reading(sources.datasets(cfg, task), task) == by_key

    # A sweep surveys once for its trials; a trial takes those rows only for the same data.
    shared = ingest.put_for_trials(cfg, ["optim.lr"])
    assert shared.rows == by_key
    made_up = ingest.SurveyedFiles(shared.source, {"train": 7, "val": 3})
    assert ingest.prepare(cfg, made_up).train_rows == 7  # taken, not surveyed again
    other_seed = cfg.model_copy(update={"seed": 1})
    assert ingest.prepare(other_seed, made_up).train_rows == by_key["train"]  # its own survey
    assert ingest.put_for_trials(cfg, ["data.val_fraction"]) is None

    # A missing column is named, whichever way the files are surveyed.
    for split_key in ("id", None):
        columns = {"id": "id", "x": "nope", "y": "target"}
        bad = from_dict(_file_config(tmp_path, columns=columns, split_key=split_key))
        with pytest.raises(ValueError, match=r"data.columns: the files have no column 'nope'"):
            ingest.prepare(bad)

    # Workers that would leave Ray Data's read tasks no CPU fail now, not by waiting forever:
    # the test cluster has 4 CPUs; 3 workers of 1 leave the 0.5 a read task takes, 4 do not.
    fits = _file_config(tmp_path, val_fraction=0.25)
    fits["scaling"]["num_workers"] = 3
    ingest.check_cpus_for_reading(from_dict(fits))
    full = _file_config(tmp_path, val_fraction=0.25)
    full["scaling"]["num_workers"] = 4
    with pytest.raises(ValueError, match=r"data.cpus: reading files needs 0.5 CPU"):
        ingest.prepare(from_dict(full))


def _survey(cfg_dict: dict) -> dict[str, int]:
    cfg = from_dict(cfg_dict)
    task = build_task(cfg.task, cfg.size, cfg.model)
    return sources.survey(cfg, task, sources.datasets(cfg, task))


@pytest.mark.slow
def test_csv_jsonl_text_and_image_files_are_read_and_split_alike(ray_cluster, tmp_path):
    import pandas as pd

    ids = np.arange(900)
    frame = pd.DataFrame({"id": ids, "target": ids * 0.5} | {f"f{k}": ids * k for k in range(4)})
    (tmp_path / "csv").mkdir()
    (tmp_path / "jsonl").mkdir()
    for i, rows in enumerate(np.array_split(np.arange(len(frame)), 3)):
        part = frame.iloc[rows]
        part.to_csv(tmp_path / "csv" / f"part-{i}.csv", index=False)
        part.to_json(tmp_path / "jsonl" / f"part-{i}.jsonl", orient="records", lines=True)
    counts = {
        fmt: _survey(_file_config(tmp_path, format=fmt, path=str(tmp_path / fmt), split_key="id"))
        for fmt in ("csv", "jsonl")
    }
    # The same ids hash alike whatever the format: the same rows go to validation.
    assert counts["csv"] == counts["jsonl"]
    assert counts["csv"]["train"] + counts["csv"]["val"] == len(ids)

    # The example config's digits, as Parquet (jobs/example_data.py writes them).
    from jobs.example_data import write_digits_parquet

    write_digits_parquet(tmp_path / "digits")
    example = yaml.safe_load((REPO / "jobs/configs/digits-files.yaml").read_text())
    example["data"]["path"] = str(tmp_path / "digits")
    digits = _survey(example)
    assert digits["train"] + digits["val"] == 1_797
    assert 0.1 < digits["val"] / 1_797 < 0.2  # val_fraction 0.15, by a hash of `id`

    # digits from a folder of images per class (decoding is test_sources.py's): every image
    # is read, in train or validation.
    from jobs.example_data import write_digit_images

    assert write_digit_images(tmp_path / "images", every=4) == 450
    images = _survey(
        {"task": "digits", "data": {"format": "images", "path": str(tmp_path / "images")}}
    )
    assert images["train"] + images["val"] == 450

    # charlm over a directory of text files: its lines packed into windows of 33 bytes.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [f"line {i}: " + "x" * (i % 50) for i in range(2_000)]
    for i in range(4):
        (corpus / f"{i}.txt").write_text("\n".join(lines[i::4]) + "\n")
    text = {"task": "charlm", "size": "debug", "data": {"format": "text", "path": str(corpus)}}
    windows = _survey(text)
    total = sum(len(line) + 1 for line in lines)
    assert 0.9 * total / 33 < windows["train"] + windows["val"] <= total / 33
    assert 0.1 < windows["val"] / (windows["train"] + windows["val"]) < 0.3
