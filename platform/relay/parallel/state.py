"""State as plain tensors: copies that training on cannot change, and digests that compare
replicas across ranks."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def snapshot(tree: Any) -> Any:
    """A CPU copy of every tensor in a nested dict/list (`.cpu()` of a CPU tensor aliases)."""
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: snapshot(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(snapshot(value) for value in tree)
    return tree


def state_digest(weights: dict[str, torch.Tensor]) -> str:
    """A hash of a state dict: equal on every rank iff replicas agree."""
    h = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
