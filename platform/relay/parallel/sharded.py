"""Sharded checkpoint files — torch.distributed.checkpoint (DCP) — written and read without
unpickling anything a file could smuggle in.

DCP writes one file per rank (`__<rank>_0.distcp`: tensors as torch.save data, other values as
torch.save bytes) and a `.metadata` index (a plain pickle) on the coordinator. Its stock reader
unpickles `.metadata` with `pickle.load` and non-tensor values with `torch.load(...,
weights_only=False)`: either runs any code a crafted file names. Here the index is read by an
unpickler that builds only DCP's own metadata types, and values with `weights_only=True` —
through DCP's public extension points (a StorageReader, a LoadPlanner).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# What a DCP index may name: its own dataclasses, and the torch and pathlib values they hold.
_INDEX_TYPES = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # the path the checkpoint was written to: a name, never opened
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError):
    """A sharded checkpoint's index names something other than DCP's metadata types."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _INDEX_TYPES or dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"checkpoint index names {module}.{name}, which is not DCP metadata")


def read_index(path: str | Path) -> Metadata:
    """The `.metadata` index of the sharded checkpoint at `path`, read safely."""
    with open(Path(path) / ".metadata", "rb") as file:
        index = _IndexUnpickler(file).load()
    if not isinstance(index, Metadata):
        raise UnsafeCheckpoint(f"{path}/.metadata is not a DCP index")
    return index


class SafeReader(FileSystemReader):
    """DCP's file reader, with the index read by `read_index` — once per reader, so loading
    a checkpoint tensor by tensor (consolidate.py) does not re-read it for every tensor."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._index: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank indexes: relay never writes them
            raise UnsafeCheckpoint("per-rank DCP indexes are not supported")
        if self._index is None:
            self._index = read_index(self.path)
            self._index.storage_meta = self._index.storage_meta or StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, with non-tensor values (optimizer hyperparameters, step counts) loaded
    `weights_only` — plain data, never code."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # The stock planner loads `weights_only=False`; what passes a `weights_only` load first
        # is plain data, so loading it again there is safe.
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def save(state: dict[str, Any], path: Path) -> None:
    """Every rank writes its part of `state` under `path` (a collective)."""
    dcp.save(state, checkpoint_id=path)


def load(
    state: dict[str, Any],
    path: Path,
    *,
    no_dist: bool = False,
    reader: SafeReader | None = None,
) -> None:
    """Fill `state` in place from the checkpoint at `path`, resharded to `state`'s layout;
    every key of `state` must be in it (a collective unless `no_dist`). `reader`: one reused
    across loads of the same checkpoint."""
    dcp.load(
        state,
        storage_reader=reader or SafeReader(path),
        planner=SafeLoadPlanner(),
        no_dist=no_dist,
    )
