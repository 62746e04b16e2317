"""The Ray Data ingest (ingest.py chooses it, for data from files and `data.cache: false`): the
driver turns a task's split into Ray Datasets (files: sources.py); each worker reads its shard with
`ray.train.get_dataset_shard` and iterates it in batches. Each dataset costs the run a
SplitCoordinator actor and a streaming executor, which streaming (and data from files) needs; data
that fits in memory goes through the object store instead.

Ray Train splits every dataset with `streaming_split(equal=True)`, so all ranks get the same
number of rows and therefore the same number of batches — DDP needs every rank to run the same
number of steps, or the gradient all-reduce of the longer rank waits forever.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import numpy as np
import ray.data
import ray.train
import torch
from ray.data.extensions import ArrowTensorArray

from relay.tasks.base import Batch, Columns, Split
from relay.training.epochs import CachedBatches, to_tensors

BLOCKS = 8  # enough blocks for the split to spread, few enough to stay cheap
SHUFFLE_BUFFER_BATCHES = 4  # streaming: a worker's local shuffle buffer, in batches (default)


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
        self._shuffle_buffer = shuffle_buffer or SHUFFLE_BUFFER_BATCHES * batch_size
        self._batch_size = batch_size
        self._dtypes = dtypes
        self._device = device
        self._cache = cache
        self._shuffle = shuffle
        self._seed = seed
        self._cached: CachedBatches | None = None
        self._started: _Started | None = None

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

    def epoch(self, epoch: int, *, next_epoch: int | None = None) -> Iterator[Batch]:
        """This worker's batches of `epoch`; streaming, `next_epoch` starts to stream as soon
        as this epoch's last batch is out.

        Ray Data runs each epoch as a new execution of the plan, 0.2-0.3 s here from its start
        to the first batch; started when the training pass ends, it overlaps validation and the
        checkpoint instead of the next training pass."""
        if self._cache:
            self.load()
            yield from self._cached.epoch(epoch)
            return
        started, self._started = self._started, None
        if started is not None and started.epoch != epoch:
            started.close()
            started = None
        yield from started if started is not None else self._stream(epoch)
        if next_epoch is not None:
            self._started = _Started(next_epoch, self._stream(next_epoch))

    def _stream(self, epoch: int) -> Iterator[Batch]:
        buffer = self._shuffle_buffer if self._shuffle else None
        for batch in self._shard.iter_batches(
            batch_size=self._batch_size,
            batch_format="numpy",
            local_shuffle_buffer_size=buffer,
            local_shuffle_seed=self._seed * 100_003 + epoch if self._shuffle else None,
        ):
            yield to_tensors(batch, self._dtypes, self._device)


class _Started:
    """An epoch's batches whose first one is being fetched in a background thread (the
    iteration, and so Ray Data's execution of the epoch, starts now)."""

    def __init__(self, epoch: int, batches: Iterator[Batch]) -> None:
        self.epoch = epoch
        self._batches = batches
        self._first: list[Batch] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._fetch_first, name=f"relay-epoch-{epoch}-first-batch", daemon=True
        )
        self._thread.start()

    def _fetch_first(self) -> None:
        try:
            self._first.append(next(self._batches))
        except StopIteration:
            pass
        except BaseException as error:  # raised where the batches are consumed
            self._error = error

    def __iter__(self) -> Iterator[Batch]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        yield from self._first
        yield from self._batches

    def close(self) -> None:
        self._thread.join()
        self._batches.close()
