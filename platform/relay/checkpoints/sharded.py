"""Sharded checkpoint files — torch.distributed.checkpoint (DCP) — written and read without
unpickling anything a file could smuggle in.

DCP writes one file per rank (`__<rank>_0.distcp`: tensors as torch.save data, other values as
torch.save bytes) and a `.metadata` index (a plain pickle) on the coordinator. Its stock reader
unpickles `.metadata` with `pickle.load` and non-tensor values with `torch.load(...,
weights_only=False)`: either runs any code a crafted file names. Here the index is read by an
unpickler that builds only DCP's own metadata types, and values with `weights_only=True` —
through DCP's public extension points (a StorageReader, a LoadPlanner).

The index also says where each value lies (a file name, an offset, a length) and how large each
tensor is, and DCP believes it: it opens whatever path it names and allocates whatever size it
claims. So every path must lie inside the shards/ directory, and every tensor must fit in the
bytes the index gives its pieces (which `check_files` holds to the files' real lengths), before
anything is read or allocated.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

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
    """The `.metadata` index of the sharded checkpoint at `path`, read safely: it names only
    files inside `path`, and no tensor larger than the bytes it gives the tensor's pieces."""
    with open(Path(path) / ".metadata", "rb") as file:
        index = _IndexUnpickler(file).load()
    if not isinstance(index, Metadata):
        raise UnsafeCheckpoint(f"{path}/.metadata is not a DCP index")
    _check_locations(index, Path(path))
    _check_tensor_sizes(index)
    return index


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _inside(shards: Path, name: Any) -> bool:
    if (
        not isinstance(name, str)
        or not name
        or Path(name).is_absolute()
        or ".." in Path(name).parts
    ):
        return False
    root = shards.resolve()
    return (root / name).resolve().is_relative_to(root)  # a symlink out is outside too


def _check_locations(index: Metadata, shards: Path) -> None:
    for key, stored in (index.storage_data or {}).items():
        where = f"{shards}/.metadata: {getattr(key, 'fqn', key)!r}"
        if not _inside(shards, getattr(stored, "relative_path", None)):
            raise UnsafeCheckpoint(
                f"{where} lies in {stored.relative_path!r}, outside shards/ "
                "(an index may name only files beside it)"
            )
        if not (_is_count(stored.offset) and _is_count(stored.length)):
            raise UnsafeCheckpoint(f"{where}: offset and length must be byte counts")
        if getattr(stored, "transform_descriptors", None):  # e.g. compression: never written
            raise UnsafeCheckpoint(f"{where} is stored transformed, which relay never writes")


def _check_tensor_sizes(index: Metadata) -> None:
    """Every tensor's size fits the bytes of its pieces: DCP (and consolidate.py) allocate a
    tensor of the size the index claims before reading it."""
    storage = index.storage_data or {}
    for fqn, stored in index.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        size, itemsize = tuple(stored.size), stored.properties.dtype.itemsize
        if not all(_is_count(n) for n in size):
            raise UnsafeCheckpoint(f"{fqn!r}: size {size} is not a tensor size")
        held = 0
        for chunk in stored.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            within = len(offsets) == len(sizes) == len(size) and all(
                _is_count(o) and _is_count(n) and o + n <= whole
                for o, n, whole in zip(offsets, sizes, size, strict=True)
            )
            if not within:
                raise UnsafeCheckpoint(f"{fqn!r}: a piece {sizes} at {offsets} outside {size}")
            piece = storage.get(MetadataIndex(fqn, chunk.offsets))
            nbytes = math.prod(sizes) * itemsize
            if piece is None or piece.length < nbytes:
                stored_bytes = piece.length if piece is not None else 0
                raise UnsafeCheckpoint(
                    f"{fqn!r}: a piece of {nbytes} bytes stored in {stored_bytes} bytes"
                )
            held += nbytes
        if math.prod(size) * itemsize > held:
            raise UnsafeCheckpoint(
                f"{fqn!r}: size {size} ({math.prod(size) * itemsize} bytes) is more than its "
                f"pieces hold ({held} bytes)"
            )


def check_files(index: Metadata, shards: Path) -> None:
    """Every file the index points into is there and long enough (UnsafeCheckpoint names it)."""
    ends: dict[str, int] = {}
    for stored in (index.storage_data or {}).values():
        end = stored.offset + stored.length
        ends[stored.relative_path] = max(end, ends.get(stored.relative_path, 0))
    for name, end in sorted(ends.items()):
        path = shards / name
        if not path.is_file():
            raise UnsafeCheckpoint(f"{path}: missing from the checkpoint")
        if path.stat().st_size < end:
            raise UnsafeCheckpoint(f"{path}: cut short ({path.stat().st_size} of {end} bytes)")


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
