"""How a run's data reaches its workers: the one place that chooses, and the object-store ingest.

Two ingests, chosen by `choose` alone; both hand the loop the same thing, an object with
`load()` (read this rank's rows now) and `epoch(n)` (this rank's batches of epoch n):

- OBJECT_STORE: data the task holds in memory (`Task.load_data`) with `data.cache: true`. The
  driver `ray.put`s the split's columns once, in row blocks, and passes the references in the
  loop's config; each worker fetches only the blocks covering its rank's rows and keeps them as
  tensors (`epochs.CachedBatches`, reshuffled per epoch with the seed). No Ray Dataset, so no
  SplitCoordinator actor, streaming executor or barrier per run. A sweep puts the data once for
  all its trials (`put_split`, passed to `driver.fit(data=...)`).
- RAY_DATA: data from files (`data.format`: Datasets that read and preprocess them on the
  cluster, relay/training/data/sources.py), and the task's own data with `data.cache: false`
  (`data.to_ray_datasets`); each rank's shard streams from Ray Data (`data.ShardBatches`). A
  sweep surveys its files once for all trials (`SurveyedFiles`).

Rows per rank follow `streaming_split(equal=True)`'s rule, which the Ray Data ingest gets from
Ray Train: every rank trains `rows // world` rows (the remainder is dropped), so every rank runs
the same number of steps — DDP needs that, or the longer rank's all-reduce waits forever. Here
rank r takes rows [r * (rows // world), (r + 1) * (rows // world)), for the world the worker
group actually has (an elastic run may restart with fewer workers).
"""

from __future__ import annotations

import enum
import itertools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from relay import parallel
from relay.config import RunConfig
from relay.tasks.base import Batch, Columns, Split
from relay.training.epochs import CachedBatches, to_tensors

BLOCKS = 8  # per split part: a worker on another node pulls only the blocks covering its rows

# The config fields `Task.load_data` depends on (charlm reads `model.corpus_bytes`): runs whose
# dumps agree on them load the same split, so a sweep's trials may share one put.
DATA_FIELDS = ("task", "size", "model", "data", "seed")


class Ingest(enum.StrEnum):
    OBJECT_STORE = "object_store"
    RAY_DATA = "ray_data"


def choose(cfg: RunConfig) -> Ingest:
    """The ingest a run uses (the only place that decides): data from files always streams
    through Ray Data; the task's own data goes through the object store when cached."""
    if cfg.data.from_files or not cfg.data.caches:
        return Ingest.RAY_DATA
    return Ingest.OBJECT_STORE


def data_source(cfg: RunConfig) -> dict[str, Any]:
    dump = cfg.model_dump(mode="json")
    return {name: dump[name] for name in DATA_FIELDS}


# --- the object store: driver side --------------------------------------------------------------


def rank_rows(rows: int, rank: int, world: int) -> range:
    """The rows rank `rank` of `world` trains on (see the module's docstring)."""
    per_rank = rows // world
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True)
class PutColumns:
    """One part of a split (train or val) in the object store: block i is a reference to the
    columns of rows bounds[i]:bounds[i + 1]."""

    bounds: tuple[int, ...]
    blocks: tuple[ray.ObjectRef, ...]

    @classmethod
    def put(cls, columns: Columns) -> PutColumns:
        rows = len(next(iter(columns.values())))
        bounds = tuple(int(b) for b in np.linspace(0, rows, max(1, min(BLOCKS, rows)) + 1))
        blocks = tuple(
            ray.put({name: array[lo:hi] for name, array in columns.items()})
            for lo, hi in itertools.pairwise(bounds)
        )
        return cls(bounds, blocks)

    @property
    def rows(self) -> int:
        return self.bounds[-1]

    def fetch(self, rows: range) -> Columns:
        """The columns of `rows` (a contiguous range), from the blocks that cover them only."""
        spans = [
            (i, max(lo, rows.start), min(hi, rows.stop))
            for i, (lo, hi) in enumerate(itertools.pairwise(self.bounds))
            if lo < rows.stop and hi > rows.start
        ]
        if not spans:  # no rows for this rank: empty columns of the right dtypes and shapes
            spans = [(0, self.bounds[0], self.bounds[0])]
        fetched = ray.get([self.blocks[i] for i, _, _ in spans])
        lows = [self.bounds[i] for i, _, _ in spans]
        # np.concatenate copies, even a single part: the object store's arrays are read-only
        # views of shared memory, and torch must own (and may write) what it wraps.
        return {
            name: np.concatenate(
                [
                    block[name][start - low : stop - low]
                    for block, low, (_, start, stop) in zip(fetched, lows, spans, strict=True)
                ]
            )
            for name in fetched[0]
        }


@dataclass(frozen=True)
class PutSplit:
    """A split's train and val parts in the object store, and the `data_source` of the config
    it was loaded for (whoever shares it checks that a run would load the same)."""

    source: dict[str, Any]
    train: PutColumns
    val: PutColumns

    def serves(self, cfg: RunConfig) -> bool:
        return choose(cfg) is Ingest.OBJECT_STORE and data_source(cfg) == self.source


def load_split(cfg: RunConfig) -> Split:
    from relay.tasks import build_task

    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    return task.load_data(cfg.data.val_fraction, cfg.seed)


def put_split(cfg: RunConfig, split: Split | None = None) -> PutSplit:
    """Load `cfg`'s split (unless given) and put its train and val parts in the object store.
    The blocks live as long as something holds the returned references."""
    split = split or load_split(cfg)
    return PutSplit(data_source(cfg), PutColumns.put(split.train), PutColumns.put(split.val))


@dataclass(frozen=True)
class SurveyedFiles:
    """Data from files, surveyed once (rows per part) for every run of the same data source:
    a sweep's trials skip the survey's pass over the files."""

    source: dict[str, Any]
    rows: dict[str, int]

    def serves(self, cfg: RunConfig) -> bool:
        return cfg.data.from_files and data_source(cfg) == self.source


#: What a sweep prepares once for all its trials (`driver.fit(data=)`).
SharedData = PutSplit | SurveyedFiles


def put_for_trials(base: RunConfig, searched: Iterable[str]) -> SharedData | None:
    """A sweep's data, prepared once for all its trials: the base config's split put in the
    object store, or its files surveyed. None when the search varies a field the data depends
    on (each trial then prepares its own), or the base streams its own data."""
    if any(key.split(".")[0] in DATA_FIELDS for key in searched):
        return None
    if base.data.from_files:
        return SurveyedFiles(data_source(base), _survey_files(base)[1])
    if choose(base) is not Ingest.OBJECT_STORE:
        return None
    return put_split(base)


@dataclass(frozen=True)
class RunData:
    """What the driver hands one Train run: Datasets for `TorchTrainer(datasets=)` (Ray Data)
    or the put split (object store), and the train rows (for the loop's steps per epoch)."""

    ingest: Ingest
    train_rows: int
    datasets: dict | None = None
    put: PutSplit | None = None

    def loop_data(self) -> dict[str, Any]:
        """The part of the loop's config `open_batches` reads on each worker."""
        return {"ingest": self.ingest.value, "split": self.put}


def prepare(cfg: RunConfig, shared: SharedData | None = None) -> RunData:
    """The run's data for the chosen ingest; `shared` (a sweep's) is used when it is what
    this config would prepare, else the run prepares its own."""
    ingest = choose(cfg)
    serves = shared is not None and shared.serves(cfg)
    if ingest is Ingest.OBJECT_STORE:
        put = shared if serves else put_split(cfg)
        return RunData(ingest, put.train.rows, put=put)
    if cfg.data.from_files:
        return _from_files(cfg, shared.rows if serves else None)
    from relay.training.data.raydata import to_ray_datasets

    split = load_split(cfg)
    rows = len(next(iter(split.train.values())))
    return RunData(ingest, rows, datasets=to_ray_datasets(split))


def _survey_files(cfg: RunConfig, rows: dict[str, int] | None = None):
    """Datasets that read `data.path` on the cluster (sources.py) and their rows per part:
    `rows` when known (a sweep's survey), else surveyed now, before any worker starts (which
    also checks the task's columns)."""
    from relay.runtime import cluster
    from relay.tasks import build_task
    from relay.training.data import sources

    check_cpus_for_reading(cfg)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    planned = sources.datasets(cfg, task)
    # In the run's own runtime env: the processes it starts serve the run's first epoch.
    return planned, rows or cluster.in_train_env(sources.survey, cfg, task, planned)


def _from_files(cfg: RunConfig, rows: dict[str, int] | None) -> RunData:
    planned, rows = _survey_files(cfg, rows)
    return RunData(Ingest.RAY_DATA, rows["train"], datasets=planned)


def cpus_to_start(cfg: RunConfig) -> int | None:
    """The CPUs an embedded cluster started for `cfg` advertises: the machine's, or, when it
    reads files and the workers would take every core, one more than the workers reserve, so
    that Ray Data's tasks share cores with the trainers (as a DataLoader's worker processes
    would) instead of waiting forever for a free one. None: Ray's own count."""
    if not cfg.data.from_files:
        return None
    cores = os.cpu_count() or 1
    needed = math.ceil(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker + cfg.data.cpus)
    return max(cores, needed)


def check_cpus_for_reading(cfg: RunConfig) -> None:
    """Fail now, not by waiting forever, when the workers would leave Ray Data no CPU: its
    read tasks (`data.cpus` each) run beside the workers."""
    worker_cpus = cfg.scaling.cpus_per_worker
    total = ray.cluster_resources().get("CPU", 0.0)
    free = total - cfg.scaling.max_workers * worker_cpus
    needed = cfg.data.cpus
    if free < needed:
        raise ValueError(
            f"data.cpus: reading files needs {needed:g} CPU(s) beside the workers, but the "
            f"cluster's {total:g} CPUs minus {cfg.scaling.max_workers} workers × {worker_cpus:g} "
            f"leave {free:g}; use fewer workers, a smaller scaling.resources_per_worker CPU, "
            "or a cluster with more CPUs"
        )


# --- worker side ----------------------------------------------------------------------------------


class ObjectStoreBatches:
    """This rank's rows of one part of a put split, held as tensors on `device`; the same
    interface as `data.ShardBatches`."""

    def __init__(
        self,
        part: PutColumns,
        *,
        batch_size: int,
        dtypes: dict[str, torch.dtype],
        device: torch.device,
        shuffle: bool,
        seed: int,
    ) -> None:
        self._part = part
        self._batch_size = batch_size
        self._dtypes = dtypes
        self._device = device
        self._shuffle = shuffle
        self._seed = seed
        self._cached: CachedBatches | None = None

    def load(self) -> None:
        if self._cached is not None:
            return
        # This worker group's world (an elastic run's may be smaller than configured).
        rows = rank_rows(self._part.rows, parallel.rank(), parallel.world_size())
        columns = self._part.fetch(rows)
        self._cached = CachedBatches(
            to_tensors(columns, self._dtypes, self._device),
            batch_size=self._batch_size,
            shuffle=self._shuffle,
            seed=self._seed,
        )

    def epoch(self, epoch: int, *, next_epoch: int | None = None) -> Iterator[Batch]:
        """This rank's batches of `epoch` (`next_epoch`: nothing to start ahead, all in memory)."""
        self.load()
        yield from self._cached.epoch(epoch)


def open_batches(
    loop_data: dict[str, Any],
    name: str,
    *,
    batch_size: int,
    dtypes: dict[str, torch.dtype],
    device: torch.device,
    cache: bool,
    shuffle: bool,
    seed: int,
    shuffle_buffer: int | None = None,
):
    """This worker's batches of dataset `name` ("train" or "val") through the run's ingest."""
    options = {"batch_size": batch_size, "dtypes": dtypes, "device": device, "seed": seed}
    if Ingest(loop_data["ingest"]) is Ingest.OBJECT_STORE:
        return ObjectStoreBatches(getattr(loop_data["split"], name), shuffle=shuffle, **options)
    from relay.training.data.raydata import ShardBatches

    return ShardBatches(
        name, cache=cache, shuffle=shuffle, shuffle_buffer=shuffle_buffer, **options
    )
