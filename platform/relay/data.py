"""The Ray Data ingest (relay/ingest.py chooses it, for data from files and `data.cache:
false`): the driver turns a task's split into Ray Datasets (files: relay/sources.py); each
worker reads its shard with `ray.train.get_dataset_shard` and iterates it in batches. Each
dataset costs the run a SplitCoordinator actor and a streaming executor, which streaming (and
data from files) needs; data that fits in memory goes through the object store instead.

Ray Train splits every dataset with `streaming_split(equal=True)`, so all ranks get the same
number of rows and therefore the same number of batches — DDP needs every rank to run the same
number of steps, or the gradient all-reduce of the longer rank waits forever.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import ray.data
import ray.train
import torch
from ray.data.extensions import ArrowTensorArray

from relay.epochs import CachedBatches, to_tensors
from relay.tasks.base import Batch, Columns, Split

BLOCKS = 8  # enough blocks for the split to spread, few enough to stay cheap


def _to_dataset(columns: Columns) -> ray.data.Dataset:
    import pyarrow as pa

    # In-memory Arrow blocks: no read or map tasks, so no CPU slots needed beyond the workers'
    # own (a map stage would wait forever for a CPU on a cluster the workers fill).
    n = len(next(iter(columns.values())))
    bounds = np.linspace(0, n, min(BLOCKS, n) + 1, dtype=int)
    tables = []
    for lo, hi in itertools.pairwise(bounds):
        table = {}
        for name, array in columns.items():
            part = array[lo:hi]
            table[name] = ArrowTensorArray.from_numpy(part) if part.ndim > 1 else part
        tables.append(pa.table(table))
    return ray.data.from_arrow(tables)


def to_ray_datasets(split: Split) -> dict[str, ray.data.Dataset]:
    return {"train": _to_dataset(split.train), "val": _to_dataset(split.val)}


class ShardBatches:
    """This worker's batches of one dataset, epoch after epoch.

    cache=True reads the shard once and keeps it as tensors on the worker's device
    (`epochs.CachedBatches`, which the torchrun baseline uses too); later epochs only permute
    indices (the hot path never touches Ray Data again). cache=False streams the shard from Ray
    Data every epoch, for data larger than a worker's memory.
    """

    def __init__(
        self,
        name: str,
        *,
        batch_size: int,
        dtypes: dict[str, torch.dtype],
        device: torch.device,
        cache: bool,
        shuffle: bool,
        seed: int,
        shuffle_buffer: int | None = None,
    ) -> None:
        self._shard = ray.train.get_dataset_shard(name)
        self._shuffle_buffer = shuffle_buffer or 4 * batch_size
        self._batch_size = batch_size
        self._dtypes = dtypes
        self._device = device
        self._cache = cache
        self._shuffle = shuffle
        self._seed = seed
        self._cached: CachedBatches | None = None

    def _materialize(self) -> Batch:
        parts = list(self._shard.iter_batches(batch_size=None, batch_format="numpy"))
        columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        return to_tensors(columns, self._dtypes, self._device)

    def load(self) -> None:
        """Read the shard into memory now (cache mode), so epoch timings measure training."""
        if self._cache and self._cached is None:
            self._cached = CachedBatches(
                self._materialize(),
                batch_size=self._batch_size,
                shuffle=self._shuffle,
                seed=self._seed,
            )

    def epoch(self, epoch: int) -> Iterator[Batch]:
        if not self._cache:
            yield from self._stream(epoch)
            return
        self.load()
        yield from self._cached.epoch(epoch)

    def _stream(self, epoch: int) -> Iterator[Batch]:
        buffer = self._shuffle_buffer if self._shuffle else None
        for batch in self._shard.iter_batches(
            batch_size=self._batch_size,
            batch_format="numpy",
            local_shuffle_buffer_size=buffer,
            local_shuffle_seed=self._seed * 100_003 + epoch if self._shuffle else None,
        ):
            yield to_tensors(batch, self._dtypes, self._device)
