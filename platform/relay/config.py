"""The run configuration: one typed, validated tree, loaded from YAML plus `--set` overrides.

Everything a run needs is here and checked once, at the edge, before any cluster work. Below this
module, code receives a `RunConfig`; it becomes a plain dict only at the Ray boundary
(`train_loop_config`) and is rebuilt from that dict inside each worker.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
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


class ParallelConfig(_Section):
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


class CheckpointConfig(_Section):
    every: int = Field(1, ge=1, description="Checkpoint every N epochs (the last epoch always).")
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


class FailureConfig(_Section):
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


class DoctorConfig(_Section):
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


TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql")
# A query parameter whose name (or, for e.g. mssql's `odbc_connect=...;PWD=...`, whose value's
# own `name=`) holds one of these words carries a credential.
_SECRET_WORDS = ("pass", "pwd", "secret", "token", "apikey", "api_key", "access_key")
_CREDENTIALS_HELP = {  # where each kind of tracking URI's credentials go instead
    "http": "in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), "
    "environment variables MLflow reads",
    "postgresql": "in PGPASSWORD or ~/.pgpass, which the driver reads",
    "mysql": "in an option file the driver reads (?read_default_file=/path/my.cnf)",
    "mssql": "in a DSN or a trusted connection",
    "sql": "where the database driver reads them (its environment or files)",
}


def _secret_query(query: str) -> list[str]:
    from urllib.parse import parse_qsl

    def secret(text: str) -> bool:
        return any(word in text.lower() for word in _SECRET_WORDS)

    return [
        key
        for key, value in parse_qsl(query, keep_blank_values=True)
        if secret(key) or any(secret(part.partition("=")[0]) for part in value.split(";"))
    ]


def uri_credentials(uri: str) -> str | None:
    """What in a tracking URI is a credential (None: nothing). An HTTP URI may carry none: an
    `@` anywhere is taken for userinfo (requests sends it as basic auth); a database URI may
    name its user but not the password, as SQLAlchemy (MLflow's parser) reads it."""
    from urllib.parse import urlsplit

    scheme, _, rest = uri.partition("://")
    if scheme in ("http", "https") and "@" in rest:
        return "userinfo (user:password@)"
    if scheme not in ("http", "https") and not scheme.startswith("sqlite"):
        try:
            from sqlalchemy.engine import make_url

            password = make_url(uri).password
        except Exception:  # no SQLAlchemy, or not its form: any `user:...@` counts
            password = ":" in rest.rpartition("@")[0]
        if password:
            return "a password (user:password@)"
    named = _secret_query(urlsplit(uri).query)
    return f"the query parameter {named[0]!r}" if named else None


def redacted_uri(uri: str) -> str:
    """A tracking URI fit to print or record: what may be userinfo (all up to the last `@`)
    and the values of secret query parameters as `***`."""
    from urllib.parse import parse_qsl, urlencode

    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest and not scheme.startswith("sqlite"):
        uri = f"{scheme}://***@{rest.rpartition('@')[2]}"
    base, mark, query = uri.partition("?")
    query, hash_, fragment = query.partition("#")
    secret = set(_secret_query(query))
    if secret:
        pairs = [(k, "***" if k in secret else v) for k, v in parse_qsl(query, True)]
        uri = f"{base}{mark}{urlencode(pairs, safe='*/')}{hash_}{fragment}"
    return uri


class MlflowConfig(_Section):
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


class TrackingConfig(_Section):
    tensorboard: bool = Field(
        False,
        description="Write each epoch's metrics as TensorBoard event files in the run's "
        "directory (`tensorboard --logdir <storage>/runs` shows every run and trial).",
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


class DataConfig(_Section):
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


# Names become directory names and URL path segments: letters, digits, '_', '.', '-'.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


def _name_field(default: str, what: str):
    return Field(
        default,
        pattern=NAME_PATTERN,
        max_length=64,
        description=f"{what} name prefix; the {what.lower()} id is `<name>-<timestamp>-<suffix>`.",
    )


class RunConfig(_Section):
    name: str = _name_field("run", "Run")
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
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="Parallelism strategy and precision."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
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


def _error_lines(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        # A section's own validator names the full field itself ("data.path: ...").
        named = not where or message.startswith(f"{where}.")
        lines.append(message if named else f"{where}: {message}")
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


def set_dotted(data: dict[str, Any], path: list[str], value: Any) -> None:
    """`data[path[0]][path[1]]... = value`, creating sections on the way."""
    node = data
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(path[: depth + 1])
            raise ConfigError(f"{where}: is not a section, cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as dotted fields: {"parallel": {"strategy": "ddp"}} → {"parallel.strategy":
    "ddp"} (the names `--set` takes); an empty section stays a field of its own."""
    fields: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            fields.update(flatten(value, f"{prefix}{key}."))
        else:
            fields[f"{prefix}{key}"] = value
    return fields


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        set_dotted(data, *parse_override(text))
    return data


def from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_error_lines(exc))) from None


def load(path: str | os.PathLike[str] | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or none: all defaults) and apply `--set` overrides."""
    data = _read_yaml(path) if path is not None else {}
    return from_dict(apply_overrides(data, list(overrides)))


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    return loaded


# --- sweeps -----------------------------------------------------------------------------------

Distribution = Literal["choice", "grid", "uniform", "loguniform", "randint"]


class SearchDimension(_Section):
    """One searched field: exactly one of the keys below."""

    choice: list[Any] | None = Field(None, min_length=1, description="Sample one of these.")
    grid: list[Any] | None = Field(None, min_length=1, description="Try every one of these.")
    uniform: tuple[float, float] | None = Field(None, description="[low, high], uniform.")
    loguniform: tuple[float, float] | None = Field(
        None, description="[low, high], uniform in log space (both > 0)."
    )
    randint: tuple[int, int] | None = Field(None, description="[low, high): an integer.")

    @model_validator(mode="after")
    def _exactly_one(self) -> SearchDimension:
        given = [name for name in get_args(Distribution) if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(get_args(Distribution))}")
        kind = given[0]
        if kind in ("uniform", "loguniform", "randint"):
            low, high = getattr(self, kind)
            if not low < high:
                raise ValueError(f"{kind}: low ({low}) must be below high ({high})")
            if kind == "loguniform" and low <= 0:
                raise ValueError("loguniform: bounds must be > 0")
        return self

    @property
    def kind(self) -> Distribution:
        return next(n for n in get_args(Distribution) if getattr(self, n) is not None)

    def probe_values(self) -> list[Any]:
        """Values that stand for the whole dimension when checking it against the config."""
        if self.kind in ("choice", "grid"):
            return list(getattr(self, self.kind))
        low, high = getattr(self, self.kind)
        return [low, high - 1] if self.kind == "randint" else [low, high]


class AshaConfig(_Section):
    enabled: bool = Field(True, description="Stop weak trials early; false runs every trial out.")
    max_t: int | None = Field(
        None,
        ge=1,
        description="Epochs a trial may run at most. Always `train.epochs`, the one place to set "
        "a trial's length: leave it null (filled from `train.epochs`); a value that differs "
        "is an error.",
    )
    grace_period: int = Field(1, ge=1, description="Epochs every trial runs before it may stop.")
    reduction_factor: float = Field(
        2.0, gt=1, description="Keep the best 1/reduction_factor of trials at each rung."
    )
    strategy: Literal["stop", "promote"] = Field(
        "stop",
        description="stop: Ray's ASHAScheduler — a trial reaching a rung goes on if it ranks in "
        "the top 1/reduction_factor of the results recorded there so far, else stops (the "
        "first to arrive always goes on). promote: ASHA as published — a trial pauses at each "
        "rung unless it ranks in the rung's top 1/reduction_factor, and a free slot resumes the "
        "best paused trial that has become promotable, else starts a new one; each resume "
        "costs one run start-up (promotion.py).",
    )


SearchAlgorithm = Literal["random", "grid", "tpe", "pbt"]


class PbtConfig(_Section):
    """Population Based Training (`search_alg: pbt`): every `interval` epochs the weaker
    trials copy a stronger trial's checkpoint (weights and optimizer) and perturb its
    hyperparameters (the `search` fields)."""

    interval: int = Field(
        2, ge=1, description="Epochs between exploit/explore steps (PBT's perturbation interval)."
    )
    quantile_fraction: float = Field(
        0.25,
        gt=0,
        le=0.5,
        description="The bottom fraction of trials copies from the top fraction.",
    )
    resample_probability: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Chance that an explored field is drawn afresh from its search "
        "distribution instead of perturbed (a number multiplied by 0.8 or 1.2, a choice moved "
        "to a neighbouring value); perturbed numbers stay within their search bounds.",
    )
    synch: bool = Field(
        True,
        description="true: the population waits at every interval until all its trials "
        "reached it, so each exploit compares the whole population (each trial's Train run "
        "restarts there: a start-up per trial per interval); false: each trial decides when "
        "it arrives, against the scores the others last reported (no waiting, no restart of "
        "a continuing trial, but early arrivals have few trials to compare with).",
    )


# Fields a PBT exploit cannot change: the donor's checkpoint must fit the trial's model and
# optimizer, and every trial runs the sweep's whole length (`train.epochs`).
PBT_FIXED_FIELDS = ("task", "size", "model", "epochs", "optim.name")


class SweepConfig(BaseModel):
    # No validate_assignment here: the validator below fills fields in, and re-validating the
    # whole sweep on each of those assignments would run the validator again.
    model_config = ConfigDict(extra="forbid")

    name: str = _name_field("sweep", "Sweep")
    train: RunConfig = Field(
        ..., description="The train config every trial starts from (a mapping, or a YAML path)."
    )
    search: dict[str, SearchDimension] = Field(
        ..., min_length=1, description="Dotted train-config field → distribution."
    )
    num_samples: int = Field(8, ge=1, description="Trials sampled (× the grid's combinations).")
    seed: int | None = Field(
        None,
        ge=0,
        description="Seeds the search's draws: the same seed samples the same trial configs in "
        "the same order (pbt: and the same exploit/explore draws); null: fresh draws every sweep.",
    )
    metric: str | None = Field(None, description="Metric to optimise; null: the task's metric.")
    mode: Literal["min", "max"] | None = Field(None, description="null: the task's mode.")
    search_alg: SearchAlgorithm = Field(
        "random",
        description="How trial configs are chosen: random (and grid) draws, tpe (Optuna's "
        "Tree-structured Parzen Estimator, learning from finished trials; with ASHA), or pbt "
        "(Population Based Training; replaces ASHA).",
    )
    asha: AshaConfig = Field(default_factory=AshaConfig, description="ASHA early stopping.")
    pbt: PbtConfig = Field(default_factory=PbtConfig, description="Used when search_alg is pbt.")
    workers_per_trial: int | None = Field(
        None, ge=1, description="DDP workers of each trial; null: train.scaling.num_workers."
    )
    max_concurrent_trials: int | None = Field(
        None,
        ge=1,
        description="null: as many as the cluster's free CPUs/GPUs hold at once, plus `overlap`.",
    )
    overlap: int = Field(
        0,
        ge=0,
        description="Trials started beyond what the free CPUs/GPUs hold (max_concurrent_trials "
        "null; not pbt): each prepares its driver, controller and data while others train, and "
        "its workers start when a running trial ends.",
    )
    model_name: str | None = Field(
        None, description="Register the best trial under this model; null: the task's name."
    )

    @model_validator(mode="after")
    def _fit_train(self) -> SweepConfig:
        if self.workers_per_trial is not None:
            self.train.scaling.num_workers = self.workers_per_trial
        self.metric = self.metric or self.train.checkpoint.metric
        self.mode = self.mode or self.train.checkpoint.mode
        # `train.epochs` alone sets how long a trial may train (ASHA decides how many of those
        # epochs each trial gets): a `--set train.epochs=N` must never be silently outvoted.
        epochs = self.train.epochs
        if self.asha.max_t is not None and self.asha.max_t != epochs:
            raise ValueError(
                f"asha.max_t: {self.asha.max_t} contradicts train.epochs ({epochs}); a trial's "
                "length is train.epochs alone: set that, and leave asha.max_t unset"
            )
        self.asha.max_t = epochs
        if self.asha.grace_period > epochs:
            raise ValueError(f"asha.grace_period: must be <= train.epochs ({epochs})")
        base = self.train.model_dump(mode="json", exclude_defaults=False)
        for key, dimension in self.search.items():
            for value in dimension.probe_values():
                try:
                    trial_config(base, {key: value})
                except ConfigError as exc:
                    raise ValueError(f"search.{key}: {value!r} does not fit: {exc}") from None
        return self

    @model_validator(mode="after")
    def _fit_search_alg(self) -> SweepConfig:
        """Each search algorithm takes only the dimensions it can use: grid enumerates, so
        every field must be a list (grid or choice); TPE samples, so no field may be a grid."""
        if self.search_alg == "grid":
            for key, dimension in self.search.items():
                if dimension.kind not in ("grid", "choice"):
                    raise ValueError(
                        f"search.{key}: search_alg grid tries every combination, and "
                        f"{dimension.kind} cannot be enumerated: give grid: [...] or choice: [...]"
                    )
            # Each combination once unless asked: repeats of a grid rerun identical configs.
            if "num_samples" not in self.model_fields_set:
                self.num_samples = 1
        elif self.search_alg == "tpe":
            for key, dimension in self.search.items():
                if dimension.kind == "grid":
                    raise ValueError(
                        f"search.{key}: search_alg tpe samples every field and cannot run a "
                        "grid: use choice: [...] (or search_alg grid)"
                    )
            try:
                import optuna  # noqa: F401  (only whether it imports matters here)
            except ImportError:
                raise ValueError(
                    "search_alg: tpe needs Optuna, which is not installed: "
                    "pip install 'relay[optuna]'"
                ) from None
        return self

    @property
    def population(self) -> int:
        """Trials the sweep creates: num_samples for each combination of the grid fields."""
        grids = [len(d.grid) for d in self.search.values() if d.grid is not None]
        return self.num_samples * math.prod(grids)

    @model_validator(mode="after")
    def _fit_pbt(self) -> SweepConfig:
        if self.search_alg != "pbt":
            return self
        for key in self.search:
            if key in PBT_FIXED_FIELDS or key.startswith("model."):
                raise ValueError(
                    f"search.{key}: search_alg pbt copies checkpoints between trials, so every "
                    "trial keeps the same task, size, model, epochs and optimizer: set it in "
                    "train, not in search"
                )
        if "asha" in self.model_fields_set and self.asha.enabled:
            raise ValueError(
                "asha.enabled: search_alg pbt replaces ASHA (weak trials copy strong ones "
                "instead of stopping): set asha.enabled false, or leave asha out"
            )
        # Left out: off, as the saved sweep.json then says (and `--resume` reads back).
        self.asha.enabled = False
        if self.population < 2:
            raise ValueError("num_samples: search_alg pbt needs a population of at least 2")
        if self.max_concurrent_trials is not None and self.max_concurrent_trials < (
            self.population
        ):
            raise ValueError(
                f"max_concurrent_trials: search_alg pbt trains its whole population at once: "
                f"must be >= {self.population} (num_samples x grid combinations)"
            )
        epochs, every = self.train.epochs, self.train.checkpoint.every
        if self.pbt.interval >= epochs:
            raise ValueError(
                f"pbt.interval: must be below train.epochs ({epochs}): PBT acts every interval "
                "epochs and never at the last"
            )
        if self.pbt.interval % every:
            raise ValueError(
                f"pbt.interval: must be a multiple of train.checkpoint.every ({every}): a trial "
                "hands over the checkpoint of the epoch it reached"
            )
        return self


def trial_config(base: dict[str, Any], params: dict[str, Any]) -> RunConfig:
    """The train config of one trial: the sweep's base with the sampled `params` set."""
    import copy

    data = copy.deepcopy(base)
    for key, value in params.items():
        set_dotted(data, key.split("."), value)
    return from_dict(data)


def load_sweep(path: str | os.PathLike[str], overrides: list[str] = ()) -> SweepConfig:
    """Read a sweep YAML; `train:` may be a path to a train config (relative to the sweep)."""
    data = _read_yaml(path)
    if isinstance(data.get("train"), str):
        train_path = Path(path).parent / data["train"]
        data["train"] = _read_yaml(train_path)
    return sweep_from_dict(apply_overrides(data, list(overrides)))


def sweep_from_dict(data: dict[str, Any]) -> SweepConfig:
    try:
        return SweepConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_error_lines(exc))) from None
