"""Whole weights from a sharded checkpoint: `model.safetensors`, streamed tensor by tensor.

Serving and Hugging Face export need whole weights; a sharded checkpoint (checkpoint.py) holds
each tensor in pieces across the ranks' files. The safetensors header depends only on the
tensors' names, shapes and dtypes, which the shard index records, so it is written first; then
each tensor is read whole from its pieces (DCP reshards it), written after the previous one and
freed. The process never holds more than one tensor — the model may be larger than its memory.
(safetensors' own writer takes every tensor at once, hence this writer.)
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

from relay.checkpoints.layout import SHARDS, TRAIN_STATE, WEIGHTS

# safetensors' dtype codes (its format spec).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
WEIGHTS_PREFIX = "model."  # the weights' keys in the shards (`parallel.Strategy.sharded_state`)


def consolidate(directory: str | Path) -> Path:
    """`directory`'s whole weights file, made from its shards if it is not there yet.

    Written to a temporary name and renamed into place, so concurrent callers (replicas that
    load the same checkpoint) never see half a file; each makes the same bytes."""
    directory = Path(directory)
    target = directory / WEIGHTS
    if not target.exists() and (directory / SHARDS).is_dir():
        temporary = directory / f".{WEIGHTS}.{os.getpid()}.partial"
        try:
            write_weights(directory / SHARDS, temporary)
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
    return target


def export(directory: str | Path, out: str | Path | None = None) -> Path:
    """The checkpoint as a model to load elsewhere: whole weights (`model.safetensors`),
    `meta.json` and the task's assets (a Hugging Face task's config and tokenizer: the
    directory then loads with `from_pretrained`). In place when `out` is None (the weights file
    is made beside the shards); else into `out`, which must be new or empty, leaving the
    optimizer state and shards behind. Returns the directory."""
    directory = Path(directory)
    if out is None:
        consolidate(directory)
        return directory
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for item in sorted(directory.iterdir()):
        if item.name in (SHARDS, TRAIN_STATE, WEIGHTS) or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    if (directory / WEIGHTS).exists():
        shutil.copy2(directory / WEIGHTS, out / WEIGHTS)
    else:
        write_weights(directory / SHARDS, out / WEIGHTS)
    return out


def write_weights(shards: Path, target: Path) -> list[str]:
    """Write the weights held in `shards` to `target` as safetensors; returns their names."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from relay.checkpoints import sharded

    # Each tensor's size is checked against the bytes the index gives it, and those against
    # the files: nothing below allocates more than the checkpoint holds.
    index = sharded.read_index(shards)
    sharded.check_files(index, shards)
    tensors = [
        (key.removeprefix(WEIGHTS_PREFIX), stored)
        for key, stored in index.state_dict_metadata.items()
        if key.startswith(WEIGHTS_PREFIX) and isinstance(stored, TensorStorageMetadata)
    ]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, stored in tensors:
        size = stored.size.numel() * stored.properties.dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[stored.properties.dtype],
            "shape": list(stored.size),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    reader = sharded.SafeReader(shards)
    with open(target, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name, stored in tensors:
            tensor = torch.empty(stored.size, dtype=stored.properties.dtype)
            sharded.load({WEIGHTS_PREFIX + name: tensor}, shards, no_dist=True, reader=reader)
            out.write(tensor.reshape(-1).view(torch.uint8).numpy())
            del tensor
    return [name for name, _ in tensors]
