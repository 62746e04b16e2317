"""Data from files (`data.format` + `data.path`): Ray Data reads them on the cluster, streamed.

For each block of rows, one Ray Data task (fused by Ray from the read and one `map_batches`)
reads it, keeps the rows of its part (train or validation), maps the file's columns to the
task's (`data.columns`) and runs the task's `preprocess`; the trainers receive finished
batches. The driver never holds a row: it builds the plan and, before any worker starts,
`survey`s it once on the cluster (rows per part for the LR schedule, and the task's columns).

The validation rows are chosen by a stable hash — of `data.split_key`'s value, else of the
whole row — not by a random draw over a known row count (there is none before reading): the
same rows land on the same side in every run, every epoch and on every worker, whatever the
order the files are read in. pandas' `hash_array` is the hash (SipHash-2-4 with a fixed key for
strings and bytes, a fixed bit mixer for numbers): stable across processes and versions,
unlike Python's own `hash`.
"""

from __future__ import annotations

import functools
import glob
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from relay.config import RunConfig
from relay.runtime import ray_private
from relay.tasks.base import Columns, Task

if TYPE_CHECKING:
    import ray.data

HASH_BITS = 64
_MISSING = "data.columns: the files have no column"


class MissingColumn(ValueError):
    """A column the config or the task names is not in the files."""


# --- pure parts (run inside Ray Data's tasks; tested without a cluster) ------------------------


def _column_hashes(array: np.ndarray) -> np.ndarray:
    import pandas as pd

    array = np.asarray(array)
    if array.dtype.kind in "US":  # fixed-width strings: hash_array takes them as objects
        array = array.astype(object)
    nested = array.dtype == object and any(isinstance(v, list | np.ndarray) for v in array[:1])
    if array.ndim > 1 or nested:
        # Tensors and lists: hash each row's bytes (hash_array takes only flat columns).
        array = np.array([np.asarray(row).tobytes() for row in array], dtype=object)
    return pd.util.hash_array(array, categorize=False)


def row_hashes(batch: Columns, key: str | None) -> np.ndarray:
    """A stable 64-bit hash per row: of column `key`, else of every column (in name order)."""
    if key is not None:
        if key not in batch:
            raise MissingColumn(f"data.split_key: the files have no column {key!r}")
        return _column_hashes(batch[key])
    combined = None
    for name in sorted(batch):
        hashes = _column_hashes(batch[name])
        # An odd multiplier mixes the columns in order; uint64 arithmetic wraps by design.
        combined = hashes if combined is None else combined * np.uint64(1_000_003) ^ hashes
    return combined


def in_val(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Whether each row is a validation row: its hash falls in the lowest `val_fraction` of
    the 64-bit range (so a larger fraction only adds rows to validation)."""
    top_bits = hashes >> np.uint64(HASH_BITS - 53)  # exact in float64
    return top_bits < np.uint64(int(val_fraction * 2**53))


def select_columns(batch: Columns, mapping: dict[str, str | list[str]] | None) -> Columns:
    """The task's columns from the file's: `mapping` is task name ← file name, or ← a list of
    scalar file columns stacked into one (n, k) column; None keeps the batch as it is."""
    if mapping is None:
        return batch

    def column(name: str) -> np.ndarray:
        if name not in batch:
            have = ", ".join(sorted(batch))
            raise MissingColumn(f"{_MISSING} {name!r} (they have: {have})")
        return np.asarray(batch[name])

    return {
        target: np.stack([column(s) for s in source], axis=1)
        if isinstance(source, list)
        else column(source)
        for target, source in mapping.items()
    }


def prepare_batch(batch: Columns) -> Columns:
    """Columns torch can take: lists read from Parquet or JSON arrive as object arrays of
    arrays, stacked here into one (n, k) array."""
    out = {}
    for name, array in batch.items():
        array = np.asarray(array)
        if array.dtype == object and len(array) and isinstance(array[0], list | np.ndarray):
            array = np.stack([np.asarray(row) for row in array])
        out[name] = array
    return out


def _transform(batch: Columns, *, data, task: Task, part: str | None) -> Columns:
    """One block's way from file rows to the task's batch (the function `map_batches` runs)."""
    if part is not None:
        val = in_val(row_hashes(batch, data.split_key), data.val_fraction)
        keep = val if part == "val" else ~val
        batch = {name: np.asarray(array)[keep] for name, array in batch.items()}
    return prepare_batch(task.preprocess(select_columns(batch, data.columns)))


# --- reading -----------------------------------------------------------------------------------


def _paths(path: str) -> str | list[str]:
    """What Ray Data's readers take: local globs expanded here (the readers take files and
    directories, not patterns); URIs (s3://...) are passed on as they are."""
    if "://" in path:
        return path
    expanded = os.path.expanduser(path)
    if any(char in expanded for char in "*?["):
        matches = sorted(glob.glob(expanded, recursive=True))
        if not matches:
            raise FileNotFoundError(f"data.path: nothing matches {path!r}")
        return [os.path.abspath(match) for match in matches]
    if not os.path.exists(expanded):
        raise FileNotFoundError(f"data.path: {path!r} does not exist")
    return os.path.abspath(expanded)


def _image_classes(root: str) -> dict[str, int]:
    """Class directory name → label index, in sorted order (torchvision's ImageFolder rule)."""
    import pyarrow.fs

    filesystem, base = pyarrow.fs.FileSystem.from_uri(root if "://" in root else f"file://{root}")
    infos = filesystem.get_file_info(pyarrow.fs.FileSelector(base))
    names = sorted(info.base_name for info in infos if info.type == pyarrow.fs.FileType.Directory)
    if not names:
        raise FileNotFoundError(f"data.path: images need a directory per class under {root!r}")
    return {name: index for index, name in enumerate(names)}


def _label_images(batch: Columns, classes: dict[str, int]) -> Columns:
    labels = np.array([classes[str(name)] for name in batch.pop("class")], dtype=np.int64)
    return {**batch, "label": labels}


def _read_parquet(path: str, files: int | None = None, **options: Any) -> ray.data.Dataset:
    """Parquet files through Ray Data's file-based (V1) reader, one read task per file.

    Ray Data 2.60's default Parquet reader (DataSourceV2) lists the files again in every
    execution, that is every epoch, and reads their footers in actors it starts and kills each
    time (`FooterFileIndexer.list_files`): measured here, 2.5-4 s of process start-up before
    each epoch's first batch, whatever the data's size. The V1 reader lists the files once, when
    the Dataset is built (`DataContext.use_datasource_v2`, Ray's public switch, is read only
    inside `read_parquet`, so it is restored at once).

    One read task per file (`override_num_blocks`): left to choose, V1 plans at least 2 blocks
    per cluster CPU and splits each file's output to get there, and a split read cannot fuse
    with the `map_batches` after it, so every block would go through the object store twice
    (in the larger-than-memory test, a 75 MiB store: 3x slower). A file is then read by one task,
    in batches, so a dataset of few large files is read with few tasks. `files`: their number,
    when the caller has listed them already."""
    import logging

    import ray.data

    if files is None:
        files = len(_parquet_footers(path).files)
    context = ray.data.DataContext.get_current()
    # Also quiet while planning: V1 samples two files for their encoding ratio with a progress
    # bar and two INFO lines on the driver's terminal, for every Dataset it builds.
    saved = context.use_datasource_v2, context.enable_progress_bars
    context.use_datasource_v2, context.enable_progress_bars = False, False
    planner_log = logging.getLogger(ray_private.PARQUET_PLANNER_LOGGER)
    log_level = planner_log.level
    planner_log.setLevel(logging.WARNING)
    try:
        return ray.data.read_parquet(_paths(path), override_num_blocks=max(1, files), **options)
    finally:
        context.use_datasource_v2, context.enable_progress_bars = saved
        planner_log.setLevel(log_level)


def _read(data, path: str, task: Task, *, seed: int, shuffle_files: bool) -> ray.data.Dataset:
    import ray.data

    paths = _paths(path)
    options: dict[str, Any] = {"num_cpus": data.cpus}
    if shuffle_files:
        # A new seeded file order every epoch (each epoch is one execution of the plan).
        options["shuffle"] = ray.data.FileShuffleConfig(seed=seed, reseed_after_execution=True)
    if data.format == "parquet":
        return _read_parquet(path, **options)
    if data.format == "csv":
        return ray.data.read_csv(paths, **options)
    if data.format == "jsonl":
        return ray.data.read_json(paths, lines=True, **options)
    if data.format == "text":
        return ray.data.read_text(paths, drop_empty_lines=False, **options)
    if data.format == "images":
        from ray.data.datasource import Partitioning

        if not isinstance(paths, str):
            raise ValueError("data.path: images are read from one directory (a folder per class)")
        dataset = ray.data.read_images(
            paths,
            size=task.image_size,
            mode=task.image_mode,
            partitioning=Partitioning("dir", field_names=["class"], base_dir=paths),
            **options,
        )
        # Labels from the train folders' classes, for validation files too: a class missing
        # from `data.val` must not shift the others' indices.
        classes = _image_classes(_paths(data.path))
        return dataset.map_batches(
            functools.partial(_label_images, classes=classes),
            batch_format="numpy",
            num_cpus=data.cpus,
        )
    raise ValueError(f"data.format: unknown format {data.format!r}")


def _part(source: ray.data.Dataset, data, task: Task, part: str | None) -> ray.data.Dataset:
    return source.map_batches(
        functools.partial(_transform, data=data, task=task, part=part),
        batch_format="numpy",
        num_cpus=data.cpus,
    )


def datasets(cfg: RunConfig, task: Task) -> dict[str, ray.data.Dataset]:
    """The run's train and val Datasets (lazy: nothing is read until they are iterated)."""
    data = cfg.data
    shuffle = data.shuffle
    if data.val is not None:
        train = _read(data, data.path, task, seed=cfg.seed, shuffle_files=shuffle)
        val = _read(data, data.val, task, seed=cfg.seed, shuffle_files=False)
        return {"train": _part(train, data, task, None), "val": _part(val, data, task, None)}
    return {
        part: _part(
            _read(data, data.path, task, seed=cfg.seed, shuffle_files=shuffle and part == "train"),
            data,
            task,
            part,
        )
        for part in ("train", "val")
    }


# --- a few rows on the driver (`relay plan`, which runs without a cluster) -------------------


def _to_numpy(column) -> np.ndarray:
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    return column.to_numpy(zero_copy_only=False)


def _head_rows(data, task: Task, rows: int) -> Columns:
    """The first `rows` rows of `data.path` as the files hold them, read here with pyarrow
    (Pillow for images); no cluster."""
    paths = _paths(data.path)
    if data.format in ("parquet", "csv", "jsonl"):
        import pyarrow.dataset

        kind = {"parquet": "parquet", "csv": "csv", "jsonl": "json"}[data.format]
        table = pyarrow.dataset.dataset(paths, format=kind).head(rows)
        return {name: _to_numpy(table[name]) for name in table.column_names}
    files = sorted(
        str(p)
        for path in ([paths] if isinstance(paths, str) else paths)
        for p in (Path(path).rglob("*") if Path(path).is_dir() else [Path(path)])
        if p.is_file()
    )
    if data.format == "text":
        lines: list[str] = []
        for file in files:
            lines += Path(file).read_text(encoding="utf-8", errors="replace").splitlines()
            if len(lines) >= rows:
                break
        return {"text": np.array(lines[:rows], dtype=object)}
    from PIL import Image

    classes = _image_classes(paths)
    images, labels = [], []
    for file in files[:rows]:
        image = Image.open(file)
        image = image.convert(task.image_mode) if task.image_mode else image
        image = image.resize(task.image_size[::-1]) if task.image_size else image
        images.append(np.asarray(image))
        labels.append(classes[Path(file).parent.name])
    return {"image": np.stack(images), "label": np.array(labels, dtype=np.int64)}


def head(cfg: RunConfig, task: Task, rows: int = 256) -> Columns:
    """A few of the task's rows from the files, as a batch of the train part would have them
    (columns mapped, preprocessed), for measuring the model on the driver (`relay plan`)."""
    batch = _head_rows(cfg.data, task, rows)
    return prepare_batch(task.preprocess(select_columns(batch, cfg.data.columns)))


# --- the survey --------------------------------------------------------------------------------


def _tally(batch: Columns, *, part: str) -> dict[str, np.ndarray]:
    rows = len(next(iter(batch.values()))) if batch else 0
    return {
        "part": np.array([part]),
        "rows": np.array([rows]),
        "columns": np.array([",".join(sorted(batch))]),
    }


def survey(cfg: RunConfig, task: Task, planned: dict[str, ray.data.Dataset]) -> dict[str, int]:
    """Rows per part (the schedule needs the train part's length before the first step),
    checked before any worker starts; fails with the config's field named when the files lack
    a column, a part is empty, or the batches lack one of `task.batch_columns`.

    Parquet files that the task does not preprocess are surveyed from their footers (row
    counts and schema) and, for a split by `split_key`, a read of that one column; anything
    else takes one pass over the planned datasets on the cluster."""
    data = cfg.data
    by_footers = data.val is not None or data.split_key is not None
    if data.format == "parquet" and type(task).preprocess is Task.preprocess and by_footers:
        counts = _survey_parquet(cfg, task)
    else:
        counts = _survey_by_reading(planned, task)
    for name, count in counts.items():
        if count == 0:
            where = "data.val" if name == "val" else "data.path"
            raise ValueError(f"{where}: the {name} part has no rows after preprocessing")
    return counts


def _parquet_footers(path: str):
    import pyarrow.dataset

    return pyarrow.dataset.dataset(_paths(path), format="parquet", partitioning="hive")


def _survey_parquet(cfg: RunConfig, task: Task) -> dict[str, int]:
    data = cfg.data
    train = _parquet_footers(data.path)
    names = set(train.schema.names)
    if data.split_key is not None and data.split_key not in names:
        raise MissingColumn(f"data.split_key: the files have no column {data.split_key!r}")
    empty = {name: np.empty(0) for name in names}  # the mapping, checked on the names alone
    _check_batch_columns(task, set(select_columns(empty, data.columns)))
    if data.val is not None:
        return {"train": train.count_rows(), "val": _parquet_footers(data.val).count_rows()}
    # Only the key column is read, on the cluster (the driver holds none of it).
    keys = _read_parquet(data.path, len(train.files), columns=[data.split_key], num_cpus=data.cpus)
    tallies = keys.map_batches(
        functools.partial(_tally_split, data=data), batch_format="numpy", num_cpus=data.cpus
    ).take_all()
    val = sum(int(row["val"]) for row in tallies)
    return {"train": train.count_rows() - val, "val": val}


def _tally_split(batch: Columns, *, data) -> dict[str, np.ndarray]:
    val = in_val(row_hashes(batch, data.split_key), data.val_fraction)
    return {"val": np.array([int(val.sum())])}


def _check_batch_columns(task: Task, have: set[str]) -> None:
    missing = [column for column in task.batch_columns if column not in have]
    if missing:
        raise MissingColumn(
            f"data.columns: the task needs column(s) {missing} (the batches have: "
            f"{', '.join(sorted(have))}); map them with data.columns"
        )


def _survey_by_reading(planned: dict[str, ray.data.Dataset], task: Task) -> dict[str, int]:
    tallies = [
        dataset.map_batches(functools.partial(_tally, part=name), batch_format="numpy")
        for name, dataset in planned.items()
    ]
    try:
        rows = tallies[0].union(*tallies[1:]).take_all()
    except Exception as exc:  # Ray wraps the task's error; find ours in its message
        found = re.search(r"data\.(columns|split_key): [^\n]*", str(exc))
        if found:
            raise MissingColumn(found.group(0)) from None
        raise
    counts = dict.fromkeys(planned, 0)
    seen: set[str] = set()
    for row in rows:
        counts[row["part"]] += int(row["rows"])
        if row["rows"]:
            seen.update(filter(None, row["columns"].split(",")))
    _check_batch_columns(task, seen)
    return counts
