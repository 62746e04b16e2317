"""The run configuration: one typed, validated tree, loaded from YAML plus `--set` overrides.

Everything a run needs is here and checked once, at the edge, before any cluster work. Below this
package, code receives a `RunConfig`; it becomes a plain dict only at the Ray boundary
(`train_loop_config`) and is rebuilt from that dict inside each worker.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ByteSize,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from relay.config.base import ConfigError, Section, error_lines, name_field
from relay.config.overrides import apply_overrides, read_yaml
from relay.config.uris import (
    _CREDENTIALS_HELP,
    TRACKING_SCHEMES,
    redacted_uri,
    uri_credentials,
)


class OptimConfig(Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(0.003, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled (adamw) or L2 weight decay.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Momentum (sgd only).")
    grad_clip: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value; null disables."
    )


class ScheduleConfig(Section):
    name: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule over all optimizer steps."
    )
    warmup_epochs: float = Field(
        0.0, ge=0, description="Linear warm-up from 0 to `optim.lr` over this many epochs."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Final learning rate as a fraction of `optim.lr` (decays)."
    )


class ScalingConfig(Section):
    num_workers: int | tuple[int, int] = Field(
        2,
        description="Workers (Ray Train worker actors), or [min, max] for elastic training: "
        "the run starts with as many as fit (at least min) and continues with fewer after a "
        "node is lost.",
    )
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

    memory_per_worker: ByteSize | None = Field(
        None,
        description="A hard limit, enforced by the OS, on the memory each worker may allocate "
        "for training (model, gradients, optimizer state, activations), e.g. 1.5GiB: a cgroup "
        "per worker where Linux allows, else RLIMIT_DATA; a worker past it is ended and the run "
        "fails naming its rank. null: no limit.",
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers_shape(cls, value: Any) -> Any:
        # One message for both shapes, instead of pydantic's one per union member.
        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        pair = isinstance(value, list | tuple) and len(value) == 2 and all(map(whole, value))
        if not (pair or whole(value)):
            raise ValueError(f"expected a worker count or [min, max], got {value!r}")
        return value

    @field_validator("num_workers")
    @classmethod
    def _valid_workers(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if low < 1:
            raise ValueError(f"must be >= 1, got {low}")
        if low > high:
            raise ValueError(f"[min, max]: min ({low}) must not exceed max ({high})")
        return value

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def cpus_per_worker(self) -> float:
        """The CPUs each worker reserves (Ray's default: 1)."""
        return (self.resources_per_worker or {}).get("CPU", 1.0)

    @property
    def worker_resources(self) -> dict[str, float]:
        """What each worker asks Ray for: `resources_per_worker`, else Ray Train's default."""
        return self.resources_per_worker or {"CPU": 1.0, **({"GPU": 1.0} if self.use_gpu else {})}

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    def describe(self) -> str:
        if self.elastic:
            return f"{self.min_workers}-{self.max_workers} workers (elastic)"
        return f"{self.max_workers} workers"

    @field_validator("resources_per_worker")
    @classmethod
    def _non_negative(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, amount in (value or {}).items():
            if amount < 0:
                raise ValueError(f"resource {key!r} must be >= 0, got {amount}")
        return value


class ParallelConfig(Section):
    """How the model, its gradients and its optimizer state are spread over the workers.

    In fp32 every strategy trains the same model to the same result (up to float rounding);
    in bf16 fsdp also gathers the parameters in bf16, so its numbers drift a little further.
    All write the same portable checkpoint; they differ in memory per worker and communication.
    """

    strategy: Literal["ddp", "zero1", "fsdp"] = Field(
        "ddp",
        description="ddp: full replicas, gradients all-reduced; zero1: optimizer state "
        "sharded (ZeroRedundancyOptimizer); fsdp: parameters, gradients and optimizer state "
        "sharded (FSDP2, ZeRO-3).",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp only: free gathered parameters after forward (ZeRO-3); false keeps "
        "them until backward (≈ ZeRO-2: more memory, less communication).",
    )
    mixed_precision: Literal["none", "bf16", "fp16"] = Field(
        "none",
        description="Compute dtype of forward/backward; weights and optimizer stay fp32. "
        "fp16 adds a loss scaler.",
    )
    grad_accum: int = Field(
        1,
        ge=1,
        description="Micro-batches of `batch_size` per optimizer step; gradients are "
        "synchronised only on the last.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in backward instead of keeping them "
        "(less memory, ~1/3 more compute).",
    )
    compile: bool = Field(False, description="torch.compile the model (slow first step).")
    meta_init: bool = Field(
        True,
        description="fsdp only: build the model on the meta device and materialise only this "
        "rank's shards, one module at a time (the same values as a whole build); models "
        "without relay's per-module init (the Hugging Face tasks') are built whole.",
    )

    @field_validator("mixed_precision")
    @classmethod
    def _fp16_needs_a_scaler(cls, value: str, info: ValidationInfo) -> str:
        # fp16 gradients need loss scaling, and torch's GradScaler does not agree on skipped
        # steps across fsdp's shards; bf16 has fp32's range and needs no scaler.
        if value == "fp16" and info.data.get("strategy") == "fsdp":
            raise ValueError("fp16 is not supported with strategy fsdp; use bf16")
        return value


class CheckpointConfig(Section):
    every: int = Field(1, ge=1, description="Checkpoint every N epochs (the last epoch always).")
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also checkpoint every N optimizer steps of the run, mid-epoch included, "
        "so a lost worker costs at most N steps: the run resumes at the step after the "
        "checkpoint, and its epoch goes on with exactly the samples it had not yet trained "
        "(same worker count; the task's own data in memory). `keep` then counts the latest "
        "checkpoints, not the best: mid-epoch ones have no validation metric. null: epochs only.",
    )
    every_minutes: float | None = Field(
        None,
        gt=0,
        description="Also checkpoint once this many minutes of wall clock have passed since "
        "the last checkpoint (whichever clock strikes first), mid-epoch included, as "
        "`every_steps` does: a lost worker costs at most this long. Rank 0's clock decides, "
        "looked at every 10 steps and at each epoch's end. null: no wall clock.",
    )

    def step_clocked(self) -> bool:
        """Whether checkpoints are also made mid-epoch (a clock in steps or minutes)."""
        return self.every_steps is not None or self.every_minutes is not None

    keep: int | None = Field(2, ge=1, description="Checkpoints kept (best by `metric`); null: all.")
    metric: str | None = Field(
        None, description="Metric that ranks checkpoints; null: the task's metric."
    )
    mode: Literal["min", "max"] | None = Field(
        None, description="Whether higher (max) or lower (min) `metric` is better; null: task's."
    )
    format: Literal["auto", "full", "sharded"] = Field(
        "auto",
        description="full: rank 0 gathers and writes whole weights and optimizer state; "
        "sharded: every rank writes its own shards in parallel (torch.distributed.checkpoint; "
        "resumes on any worker count and strategy; whole weights made on demand for serving); "
        "auto: sharded with fsdp, full otherwise.",
    )
    upload: Literal["sync", "async"] = Field(
        "sync",
        description="sync: training waits until the checkpoint is in storage; async: each "
        "rank writes its part to local disk and training goes on while Ray Train copies it "
        "to storage (a checkpoint counts for resume, `keep` and best only once copied; the "
        "last epoch's is always sync).",
    )

    def sharded(self, strategy: str) -> bool:
        """Whether this run's checkpoints are written shard by shard (see `format`)."""
        return self.format == "sharded" or (self.format == "auto" and strategy == "fsdp")


class ValidationConfig(Section):
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also validate every N optimizer steps of the run, mid-epoch (the step "
        "report's `val_*` metrics); every epoch still ends with a full validation. null: at "
        "epoch ends only.",
    )
    max_batches: int | None = Field(
        None,
        ge=1,
        description="Batches per rank a mid-epoch validation reads (bounded, on huge "
        "validation data); null: all of them.",
    )


class ReportConfig(Section):
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also report every N optimizer steps: the training metrics of the steps "
        "since the last report (and `validation.every_steps`' metrics) as a line of the "
        "run's steps.jsonl and of the console, with the epoch in progress as a field, and to "
        "the trackers under `step/` (x: the optimizer step). null: epochs only.",
    )


class FailureConfig(Section):
    max_failures: int = Field(
        2, ge=-1, description="Worker-group restarts from the last checkpoint; -1: unlimited."
    )
    worker_wait_s: float | None = Field(
        None,
        gt=0,
        description="Seconds one start of the worker group (the first, or one after a "
        "failure) may wait for the cluster to place its workers before that start counts as "
        "failed; null: 60 for a run, 24 h for a sweep's trial (it waits while other trials "
        "train).",
    )
    start_failures: int = Field(
        4,
        ge=-1,
        description="Failed starts of the worker group (placement past `worker_wait_s`, a "
        "worker lost while starting) a run retries before it fails, saying what it waited "
        "for; -1: unlimited. A run whose workers cannot be placed ends after about "
        "`worker_wait_s` x (`start_failures` + 1).",
    )


class DoctorConfig(Section):
    watch: bool = Field(
        True,
        description="Watch the ranks' progress while the run trains; when it stalls, dump "
        "every rank's stack (py-spy) into runs/<id>/doctor/ and name the rank that stands out.",
    )
    stall_s: float | None = Field(
        None,
        gt=0,
        description="Seconds without progress on any rank (a step, a validation batch, a "
        "phase) that count as a stall; null: 300 until the run has timed its steps, then "
        "max(120, 30 x the slowest rank's step time).",
    )


class MlflowConfig(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI: an MLflow server (`http://host:5000`) or a database "
        "(`sqlite:////abs/path.db`); null: `sqlite:///<storage>/mlflow/mlflow.db`, nothing to "
        "start (`mlflow ui --backend-store-uri` that URI shows it). No credentials in it (relay "
        "records the URI and refuses one with a password): MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment for a server, "
        "the database driver's own (PGPASSWORD, ~/.pgpass) for a database.",
    )
    experiment: str = Field(
        "relay", min_length=1, description="MLflow experiment the runs and sweeps go to."
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str | None) -> str | None:
        if uri is None:
            return uri
        scheme = uri.partition("://")[0].partition("+")[0]
        if "://" not in uri or scheme not in TRACKING_SCHEMES:
            raise ValueError(
                f"{redacted_uri(uri)!r} is not an MLflow tracking URI: use http(s)://host:port "
                f"of an MLflow server or a database URI ({', '.join(TRACKING_SCHEMES[2:])})"
            )
        credential = uri_credentials(uri)
        if credential:
            # Refused, not redacted: the config is written whole into run.json, meta.json,
            # sweep specs, reports and MLflow params, and travels to every trial as data.
            instead = _CREDENTIALS_HELP.get(scheme.removesuffix("s"), _CREDENTIALS_HELP["sql"])
            raise ValueError(
                f"{redacted_uri(uri)!r} carries {credential}, which relay would write into "
                f"its records; give the URI without it and the credentials {instead}"
            )
        return uri


class TrackingConfig(Section):
    tensorboard: bool = Field(
        False,
        description="Write each epoch's metrics (and step report's, under `step/`) as "
        "TensorBoard event files in the run's directory (`tensorboard --logdir "
        "<storage>/runs` shows every run and trial).",
    )
    mlflow: MlflowConfig | None = Field(
        None,
        description="Track each run (params, per-epoch metrics, artifacts), each sweep (a "
        "parent run, nested trials) and each model version (Model Registry, alias `best`) in "
        "MLflow; `true` for the defaults below; null: off.",
    )

    @field_validator("mlflow", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @field_validator("mlflow")
    @classmethod
    def _installed(cls, value: MlflowConfig | None) -> MlflowConfig | None:
        if value is not None and importlib.util.find_spec("mlflow") is None:
            raise ValueError("MLflow is not installed: pip install 'relay[mlflow]'")
        return value


FileFormat = Literal["parquet", "csv", "jsonl", "text", "images"]


class DataConfig(Section):
    """Where a run's samples come from: the task's own loader (`Task.load_data`, in memory),
    or files read and preprocessed on the cluster by Ray Data (`format` + `path`)."""

    format: FileFormat | None = Field(
        None,
        description="Read `path` as files of this format with Ray Data, streamed to the workers "
        "(larger than memory is fine); null: the task's own data.",
    )
    path: str | None = Field(
        None,
        description="With `format`: a file, a directory or a glob, local or any filesystem "
        "pyarrow reads (s3://, gs://, ...). Without: files or a directory the task reads "
        "itself (tasks that take data, e.g. charlm); null: the task's built-in data.",
    )
    columns: dict[str, str | list[str]] | None = Field(
        None,
        description="Task column ← file column(s), e.g. {y: label, x: [f0, f1, f2]} (a list "
        "stacks scalar columns into one); null: the file's own names.",
    )
    val: str | None = Field(
        None,
        description="Validation files (same format), instead of holding out `val_fraction` "
        "of `path`.",
    )
    split_key: str | None = Field(
        None,
        description="Files only: the column whose hash puts a row in validation (stable across "
        "runs and workers); null: a hash of the whole row.",
    )
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Share of samples held out.")
    cache: bool | None = Field(
        None,
        description="Hold each worker's shard in memory after the first pass (fast epochs); "
        "false streams it from Ray Data every epoch; null: true for the task's own data, "
        "false for files.",
    )
    shuffle: bool = Field(True, description="Reshuffle training samples every epoch (seeded).")
    shuffle_buffer: int | None = Field(
        None,
        ge=1,
        description="Streaming only: rows in each worker's local shuffle buffer; null: 4 "
        "batches. Files are also read in a new seeded order every epoch.",
    )
    cpus: float = Field(
        0.5,
        gt=0,
        description="Files only: CPUs each Ray Data read/preprocess task reserves (they run "
        "beside the workers, on CPUs the workers leave free).",
    )

    @model_validator(mode="after")
    def _source_fields_agree(self) -> DataConfig:
        if self.format is not None and self.path is None:
            raise ValueError(f"data.path: format {self.format!r} needs a path to read")
        if self.format is None:
            for name in ("columns", "val", "split_key"):
                if getattr(self, name) is not None:
                    raise ValueError(f"data.{name}: only for files; set data.format too")
        if self.format == "images" and importlib.util.find_spec("PIL") is None:
            raise ValueError(
                "data.format: images are decoded by Pillow: pip install 'relay[images]'"
            )
        if self.val is not None and self.split_key is not None:
            raise ValueError("data.split_key: the split comes from data.val; give one of them")
        return self

    @property
    def from_files(self) -> bool:
        return self.format is not None

    @property
    def caches(self) -> bool:
        """Whether workers keep their shard in memory (`cache`, resolved)."""
        return (not self.from_files) if self.cache is None else self.cache


class RunConfig(Section):
    name: str = name_field("run", "Run")
    task: str = Field(
        ..., description='A built-in task name, or a user task as "package.module:Class".'
    )
    size: str = Field("default", description='Task size preset; every task has "debug".')
    model: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the size preset's model fields."
    )
    epochs: int = Field(10, ge=1, description="Training epochs (unless `max_steps` is set).")
    max_steps: int | None = Field(
        None,
        ge=1,
        description="The run's length in optimizer steps instead of epochs: it trains epoch "
        "after epoch until this many steps, the last epoch ending where the budget does "
        "(validated and checkpointed there); the LR schedule spans these steps. null: `epochs`.",
    )
    batch_size: int = Field(64, ge=1, description="Samples per batch, per worker.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="Worker group.")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="Parallelism strategy and precision."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig, description="Validation between epoch ends."
    )
    report: ReportConfig = Field(
        default_factory=ReportConfig, description="Metrics between epoch ends."
    )
    failure: FailureConfig = Field(default_factory=FailureConfig, description="Fault tolerance.")
    doctor: DoctorConfig = Field(
        default_factory=DoctorConfig, description="The hang doctor (stalled ranks)."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Data loading and split.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Where else each epoch's metrics go."
    )
    seed: int = Field(0, ge=0, description="Seeds model init, data split and shuffling.")
    storage: str | None = Field(
        None,
        description="Where runs are kept (absolute); null: $RELAY_HOME, else ~/relay. "
        "Multi-node clusters need a path every node shares (NFS).",
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
        if self.data.path is not None and not (self.data.from_files or task_cls.accepts_data_path):
            raise ValueError(f"data.path: task {self.task!r} has built-in data; leave it null")
        if self.checkpoint.metric is None:
            self.checkpoint.metric = task_cls.metric
        if self.checkpoint.mode is None:
            self.checkpoint.mode = task_cls.mode
        if self.checkpoint.step_clocked() and (self.data.from_files or not self.data.caches):
            # Where a stream of files stands mid-epoch is not recorded yet: its resume would
            # retrain or skip samples.
            field = "every_steps" if self.checkpoint.every_steps is not None else "every_minutes"
            raise ValueError(
                f"checkpoint.{field}: mid-epoch resume needs the task's own data held in "
                "memory (no data.format, data.cache not false)"
            )
        if self.checkpoint.format == "sharded" and self.parallel.strategy == "zero1":
            # ZeroRedundancyOptimizer's state is not a torch.distributed.checkpoint state dict.
            raise ValueError(
                "checkpoint.format: sharded checkpoints need strategy ddp or fsdp, not zero1"
            )
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


def from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(error_lines(exc))) from None


def load(path: str | os.PathLike[str] | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or none: all defaults) and apply `--set` overrides."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(apply_overrides(data, list(overrides)))
