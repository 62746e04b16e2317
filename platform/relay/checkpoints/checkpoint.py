"""A checkpoint is a directory anyone can read, in one of two forms.

Full (rank 0 gathers everything first; ddp and zero1, or `checkpoint.format: full`):
model.safetensors   full weights of the plain module — data, never pickled code
train_state.pt      optimizer state keyed by parameter name, scheduler and loss-scaler state
                    (tensors and numbers; loaded weights_only)

Sharded (every rank writes its own part in parallel; fsdp by default):
shards/             weights and optimizer state as torch.distributed.checkpoint writes them:
                    one file per rank and an index, read safely (checkpoints/sharded.py)
train_state.pt      scheduler and loss-scaler state
model.safetensors   absent until made from the shards, tensor by tensor (consolidate.py), for
                    serving and export; made for every registered version

Both:
meta.json           config, epoch, metrics, format, and the relay/ray/torch versions that wrote it
(task assets)       whatever the task's `save_assets` adds: the Hugging Face tasks' config.json
                    and tokenizer files, which make the directory a Hugging Face model too

Whatever strategy and worker count wrote it, a run resumes from either form under another
strategy or worker count with weights, optimizer moments, schedule position and epoch all kept,
and Serve loads it unchanged.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from relay.checkpoints.layout import META, SHARDS, TRAIN_STATE, WEIGHTS  # used here and by callers

# torch is imported where tensors are read or written: the CLI's record commands (`relay runs
# show`, `models show`, `report`) read checkpoints' metadata through this module, and importing
# torch cost each such call ~2 CPU-seconds more than the rest of its work.
if TYPE_CHECKING:
    import torch
    from torch import nn


def is_sharded(directory: str | Path) -> bool:
    return (Path(directory) / SHARDS).is_dir()


def files(directory: str | Path) -> list[Path]:
    """The files that make the checkpoint, relative to it (task assets aside)."""
    directory = Path(directory)
    names = [Path(TRAIN_STATE), Path(META)]
    if (directory / WEIGHTS).exists():
        names.insert(0, Path(WEIGHTS))
    if is_sharded(directory):
        names += sorted(p.relative_to(directory) for p in (directory / SHARDS).iterdir())
    return names


def versions() -> dict[str, str]:
    import ray
    import torch

    from relay.version import __version__

    return {"relay": __version__, "ray": ray.__version__, "torch": torch.__version__}


def tied_aliases(module: nn.Module) -> set[str]:
    """Parameter names that alias another parameter (tied embeddings). safetensors refuses
    tensors that share storage, so each is stored once; the module's own tying restores the
    alias on load (see load_weights)."""
    every = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in module.named_parameters()}


def _plain_state(module: nn.Module) -> dict[str, torch.Tensor]:
    tied = tied_aliases(module)
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if k not in tied}


def save(
    directory: str | Path,
    module: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    meta: dict[str, Any],
) -> Path:
    """Write a checkpoint of a plain (unwrapped, unsharded) module and its optimizer."""
    names = [name for name, _ in module.named_parameters()]
    return save_state(
        directory,
        weights=_plain_state(module),
        optimizer=optimizer_state_by_name(optimizer.state_dict(), names) if optimizer else None,
        scheduler=scheduler.state_dict() if scheduler is not None else None,
        meta=meta,
    )


def save_state(
    directory: str | Path,
    *,
    weights: dict[str, torch.Tensor] | None,
    optimizer: dict[str, Any] | None = None,
    scheduler: dict[str, Any] | None = None,
    scaler: dict[str, Any] | None = None,
    meta: dict[str, Any],
) -> Path:
    """Write full weights and name-keyed train state (see `parallel.Engine.full_state`); with
    `weights` None, the rest of a sharded checkpoint whose shards/ the ranks wrote
    (`parallel.Engine.save_sharded`). meta.json goes last: its presence marks the whole."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if weights is not None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        save_file(tensors, directory / WEIGHTS)
    train_state = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    torch.save({k: v for k, v in train_state.items() if v}, directory / TRAIN_STATE)
    form = "full" if weights is not None else "sharded"
    content = {**meta, "format": form, "versions": versions()}
    (directory / META).write_text(json.dumps(content, indent=2))
    return directory


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch's optimizer state (keyed by position in `names`) → keyed by parameter name, so it
    does not depend on how a strategy ordered or partitioned the parameters."""
    return {
        "state": {names[i]: value for i, value in state["state"].items() if value},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def optimizer_state_by_index(named: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `optimizer_state_by_name`, for an optimizer built over `names`."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(named["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state for parameters the model lacks: {unknown[:5]}")
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in named["param_groups"]
        ],
    }


def load_weights(directory: str | Path, module: nn.Module) -> nn.Module:
    """Load weights into `module` in place; only tied aliases may be absent from the file. A
    sharded checkpoint's whole weights are made first if they are not yet."""
    from safetensors.torch import load_file

    from relay.checkpoints.consolidate import consolidate

    state = load_file(consolidate(directory))
    missing, unexpected = module.load_state_dict(state, strict=False)
    really_missing = [name for name in missing if name not in tied_aliases(module)]
    if really_missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not fit the model: "
            f"missing {really_missing}, unexpected {unexpected}"
        )
    return module


def read_meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / META).read_text())


class CorruptCheckpoint(ValueError):
    """A checkpoint file is missing, cut short or unreadable; the message names the file."""


def validate(directory: str | Path) -> Path:
    """Check that a checkpoint's three files are whole, cheaply (headers and sizes, not the
    tensors), so a damaged checkpoint is refused in the driver with one line naming the file,
    instead of failing (and being retried) on every worker after a cluster start.

    A write cut short leaves a file shorter than its own header says (safetensors), without
    its zip central directory (torch.save, which sits at the end), or absent (meta.json is
    written last). Returns the directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CorruptCheckpoint(f"{directory}: checkpoint directory not found")
    weights, train_state, meta = directory / WEIGHTS, directory / TRAIN_STATE, directory / META
    sharded = is_sharded(directory)
    for path in (train_state, meta) if sharded else (weights, train_state, meta):
        if not path.is_file():
            raise CorruptCheckpoint(f"{path}: missing from the checkpoint")
    if sharded:
        _validate_shards(directory / SHARDS)
    if weights.exists() or not sharded:
        try:
            with safe_open(weights, framework="pt") as f:  # reads the header; checks it covers
                f.keys()  # the file exactly (a truncated file does not)
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpoint(
                f"{weights}: unreadable safetensors file ({_one_line(exc)})"
            ) from None
    try:
        size = train_state.stat().st_size
        with zipfile.ZipFile(train_state) as archive:
            for member in archive.infolist():
                if member.header_offset + member.compress_size > size:
                    raise zipfile.BadZipFile(f"{member.filename} runs past the end of the file")
    except (zipfile.BadZipFile, OSError) as exc:
        raise CorruptCheckpoint(
            f"{train_state}: unreadable torch file ({_one_line(exc)})"
        ) from None
    try:
        content = json.loads(meta.read_text())
    except (ValueError, OSError) as exc:
        raise CorruptCheckpoint(f"{meta}: unreadable JSON ({_one_line(exc)})") from None
    if not isinstance(content, dict) or not isinstance(content.get("config"), dict):
        raise CorruptCheckpoint(f"{meta}: no 'config' object")
    if not isinstance(content.get("epoch"), int):
        raise CorruptCheckpoint(f"{meta}: no 'epoch' number")
    return directory


def _validate_shards(shards: Path) -> None:
    """The index reads (safely, pointing only inside `shards`), and every file it points into
    is there and long enough."""
    from relay.checkpoints.sharded import UnsafeCheckpoint, check_files, read_index

    try:
        index = read_index(shards)
    except (UnsafeCheckpoint, pickle.UnpicklingError, EOFError, OSError, AttributeError) as exc:
        raise CorruptCheckpoint(
            f"{shards / '.metadata'}: unreadable shard index ({_one_line(exc)})"
        ) from None
    try:
        check_files(index, shards)
    except UnsafeCheckpoint as exc:
        raise CorruptCheckpoint(str(exc)) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# Ray Train's own record of a run's registered checkpoints, in the run's directory: the one it
# names as latest is the one a resumed run starts from.
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def latest_registered(run_dir: str | Path) -> tuple[Path, int | None] | None:
    """(directory, epoch) of the checkpoint a resumed run would start from, per Ray Train's
    snapshot; None when there is none (yet) or the snapshot cannot be read (Ray writes it in
    place, so a reader can catch it half-written)."""
    try:
        snapshot = json.loads((Path(run_dir) / RAY_SNAPSHOT).read_text())
        latest = snapshot["latest_checkpoint_result"]
        name, epoch = latest["checkpoint_dir_name"], latest["metrics"].get("epoch")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Path(run_dir) / name, epoch


@dataclass
class TrainState:
    optimizer: dict[str, Any] | None  # keyed by parameter name; None in a sharded checkpoint
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None


def load_train_state(directory: str | Path) -> TrainState:
    import torch

    state = torch.load(Path(directory) / TRAIN_STATE, map_location="cpu", weights_only=True)
    return TrainState(state.get("optimizer"), state.get("scheduler"), state.get("scaler"))


def checked_task(directory: str | Path, allow: Iterable[str] = ()) -> str:
    """The task `directory`'s meta.json names, if relay may import it: a built-in, or a name in
    `allow` (relay.tasks.check_allowed); else `relay.tasks.UntrustedTask`. Imports nothing."""
    return _allowed_task(read_meta(directory), directory, allow)


def _allowed_task(meta: dict[str, Any], directory: str | Path, allow: Iterable[str]) -> str:
    from relay.tasks import check_allowed

    config = meta.get("config")
    name = config.get("task") if isinstance(config, dict) else None
    return check_allowed(name, str(Path(directory) / META), allow)


def load_model(directory: str | Path, *, allow_task: Iterable[str] = ()):
    """(task, model in eval mode) rebuilt from a checkpoint's own meta.json — for serving and
    offline inference. Weights load from safetensors; nothing is unpickled. The task meta.json
    names is imported only if it is built in or in `allow_task` (see `checked_task`)."""
    from relay.tasks import build_task

    meta = read_meta(directory)
    task_name = _allowed_task(meta, directory, allow_task)  # before anything is imported
    cfg = meta["config"]
    data_path = (cfg.get("data") or {}).get("path")
    task = build_task(task_name, cfg["size"], cfg.get("model"), data_path)
    task.load_assets(Path(directory))
    model = load_weights(directory, task.build_model())
    return task, model.eval()
