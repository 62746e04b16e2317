"""A checkpoint is a directory anyone can read:

model.safetensors   weights of the plain (unwrapped) module — data, never pickled code
train_state.pt      optimizer and scheduler state (tensors and numbers; loaded weights_only)
meta.json           config, epoch, metrics, and the relay/ray/torch versions that wrote it
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS = "model.safetensors"
TRAIN_STATE = "train_state.pt"
META = "meta.json"


def versions() -> dict[str, str]:
    import ray

    from relay import __version__

    return {"relay": __version__, "ray": ray.__version__, "torch": torch.__version__}


def _plain_state(module: nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings): store each once; the
    # module's own tying restores the alias on load (see load_weights).
    state, seen = {}, set()
    for name, tensor in module.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach().cpu().contiguous()
    return state


def save(
    directory: str | Path,
    module: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    meta: dict[str, Any],
) -> Path:
    """Write a checkpoint of a plain module (the caller unwraps DDP & co. first)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_plain_state(module), directory / WEIGHTS)
    train_state = {}
    if optimizer is not None:
        train_state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        train_state["scheduler"] = scheduler.state_dict()
    torch.save(train_state, directory / TRAIN_STATE)
    (directory / META).write_text(json.dumps({**meta, "versions": versions()}, indent=2))
    return directory


def load_weights(directory: str | Path, module: nn.Module) -> nn.Module:
    """Load weights into `module` in place; only tied aliases may be absent from the file."""
    state = load_file(Path(directory) / WEIGHTS)
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = {n for n, p in module.named_parameters(remove_duplicate=False)} - {
        n for n, _ in module.named_parameters()
    }
    really_missing = [name for name in missing if name not in tied]
    if really_missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not fit the model: "
            f"missing {really_missing}, unexpected {unexpected}"
        )
    return module


def read_meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / META).read_text())


@dataclass
class TrainState:
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None


def load_train_state(directory: str | Path) -> TrainState:
    state = torch.load(Path(directory) / TRAIN_STATE, map_location="cpu", weights_only=True)
    return TrainState(state.get("optimizer"), state.get("scheduler"))


def load_model(directory: str | Path):
    """(task, model in eval mode) rebuilt from a checkpoint's own meta.json — for serving and
    offline inference. Weights load from safetensors; nothing is unpickled."""
    from relay.tasks import build_task

    cfg = read_meta(directory)["config"]
    task = build_task(cfg["task"], cfg["size"], cfg.get("model"), cfg.get("data", {}).get("path"))
    model = load_weights(directory, task.build_model())
    return task, model.eval()
