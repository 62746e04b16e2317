"""The run configuration: one typed, validated tree, loaded from YAML plus `--set` overrides.

Everything a run needs is here and checked once, at the edge, before any cluster work. Below this
module, code receives a `RunConfig`; it becomes a plain dict only at the Ray boundary
(`train_loop_config`) and is rebuilt from that dict inside each worker.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptimConfig(_Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(0.003, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled (adamw) or L2 weight decay.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Momentum (sgd only).")
    grad_clip: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value; null disables."
    )


class ScheduleConfig(_Section):
    name: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule over all optimizer steps."
    )
    warmup_epochs: float = Field(
        0.0, ge=0, description="Linear warm-up from 0 to `optim.lr` over this many epochs."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Final learning rate as a fraction of `optim.lr` (decays)."
    )


class ScalingConfig(_Section):
    num_workers: int = Field(2, ge=1, description="DDP workers (Ray Train worker actors).")
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL backend; else CPU, gloo.")
    resources_per_worker: dict[str, float] | None = Field(
        None,
        description=(
            "Ray resources each worker reserves, e.g. {CPU: 1} or {CPU: 4, GPU: 1}; "
            "null: Ray's default (1 CPU, plus 1 GPU with use_gpu)."
        ),
    )
    threads_per_worker: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per worker; null: the worker's reserved CPUs.",
    )

    @field_validator("resources_per_worker")
    @classmethod
    def _non_negative(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, amount in (value or {}).items():
            if amount < 0:
                raise ValueError(f"resource {key!r} must be >= 0, got {amount}")
        return value


class CheckpointConfig(_Section):
    every: int = Field(1, ge=1, description="Checkpoint every N epochs (the last epoch always).")
    keep: int | None = Field(2, ge=1, description="Checkpoints kept (best by `metric`); null: all.")
    metric: str | None = Field(
        None, description="Metric that ranks checkpoints; null: the task's metric."
    )
    mode: Literal["min", "max"] | None = Field(
        None, description="Whether higher (max) or lower (min) `metric` is better; null: task's."
    )


class FailureConfig(_Section):
    max_failures: int = Field(
        2, ge=-1, description="Worker-group restarts from the last checkpoint; -1: unlimited."
    )


class DataConfig(_Section):
    path: str | None = Field(
        None,
        description="Files or a directory the task reads (tasks that take data, e.g. charlm); "
        "null: the task's built-in data.",
    )
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Share of samples held out.")
    cache: bool = Field(
        True,
        description="Hold each worker's shard in memory after the first pass (fast epochs); "
        "false streams it from Ray Data every epoch.",
    )
    shuffle: bool = Field(True, description="Reshuffle training samples every epoch (seeded).")


class FaultInjection(_Section):
    """A testing aid: kill a real worker to exercise recovery. Leave unset in real runs."""

    kill_rank: int | None = Field(None, ge=0, description="Rank whose process is SIGKILLed.")
    kill_at_epoch: int | None = Field(
        None, ge=1, description="Epoch at whose start that rank dies (once per run)."
    )


class RunConfig(_Section):
    name: str = Field(
        "run",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        max_length=64,
        description="Run name prefix; the run id is `<name>-<timestamp>-<suffix>`.",
    )
    task: str = Field(
        ..., description='A built-in task name, or a user task as "package.module:Class".'
    )
    size: str = Field("default", description='Task size preset; every task has "debug".')
    model: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the size preset's model fields."
    )
    epochs: int = Field(10, ge=1, description="Training epochs.")
    batch_size: int = Field(64, ge=1, description="Samples per batch, per worker.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="Worker group.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    failure: FailureConfig = Field(default_factory=FailureConfig, description="Fault tolerance.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data loading and split.")
    seed: int = Field(0, ge=0, description="Seeds model init, data split and shuffling.")
    storage: str | None = Field(
        None,
        description="Where runs are kept (absolute); null: $RELAY_HOME, else ~/relay. "
        "Multi-node clusters need a path every node shares (NFS).",
    )
    fault_injection: FaultInjection = Field(
        default_factory=FaultInjection, description="Testing aid; leave unset."
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        # Imported here: tasks pull in torch, which a config's users need not pay for up front.
        from relay.tasks import resolve_task_class

        resolve_task_class(value)
        return value

    @model_validator(mode="after")
    def _fit_task(self) -> RunConfig:
        # Errors raised here carry no location of their own, so each message names its field.
        from relay.tasks import resolve_task_class

        task_cls = resolve_task_class(self.task)
        task_cls.check_size(self.size, self.model)
        if self.data.path is not None and not task_cls.accepts_data_path:
            raise ValueError(f"data.path: task {self.task!r} has built-in data; leave it null")
        if self.checkpoint.metric is None:
            self.checkpoint.metric = task_cls.metric
        if self.checkpoint.mode is None:
            self.checkpoint.mode = task_cls.mode
        return self

    def storage_path(self) -> Path:
        return resolve_storage(self.storage)


def resolve_storage(storage: str | None) -> Path:
    """The absolute storage root: `storage`, else $RELAY_HOME, else ~/relay.

    Read at call time (never at import), so each process sees its own environment; absolute, so
    a `ray job submit` run never lands in the job's temporary working directory.
    """
    raw = storage or os.environ.get("RELAY_HOME") or "~/relay"
    return Path(raw).expanduser().resolve()


def _error_lines(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{where}: {message}" if where else message)
    return lines


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=0.05` → (["optim", "lr"], 0.05); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML ({exc})") from None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise ConfigError(f"{where}: is not a section, cannot set {'.'.join(path)}")
            node = child
        node[path[-1]] = value
    return data


def from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_error_lines(exc))) from None


def load(path: str | os.PathLike[str] | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or none: all defaults) and apply `--set` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of fields")
        data = loaded
    return from_dict(apply_overrides(data, list(overrides)))
