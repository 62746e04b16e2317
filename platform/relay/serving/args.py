"""The Serve application's arguments: what `serve run serve.app:app key=value ...`,
serve/config.yaml's `args` and `relay serve` accept (`AppArgs`), the part each replica is built
from (`ReplicaArgs`), and the digest of that part Serve restarts replicas on (`replica_version`).
"""

import hashlib
import json
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

from relay.config import NAME_PATTERN
from relay.version import __version__

MIB = 1 << 20


class ReplicaArgs(BaseModel):
    """What each replica is built from (its constructor's arguments). The rest of `AppArgs`
    either travels in the user_config (which models) or is Serve's own deployment config
    (replica counts, in-flight limit, access log), which Serve changes without a restart."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.5, gt=0, description="CPUs each replica reserves.")
    max_batch_size: int = Field(32, ge=1, description="Instances per forward pass (1: none).")
    batching: Literal["adaptive", "serve"] = Field(
        "adaptive",
        description="adaptive: a request alone never waits for a batch to fill, overlapping "
        "ones do (relay/serving/batching.py); serve: Ray Serve's @serve.batch, every batch "
        "waits.",
    )
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, description="How long a forward may wait for its batch to fill."
    )
    max_instances: int = Field(256, ge=1, description="Instances one request may carry.")
    max_body_bytes: int = Field(MIB, ge=1, description="Largest request body, in bytes.")


class AppArgs(ReplicaArgs):
    """What `serve run serve.app:app key=value ...` and serve/config.yaml's `args` accept.

    Values arrive as strings from the command line; pydantic converts them ("0.5" → 0.5).
    """

    model: list[str] = Field(
        min_length=1,
        description="Registry references (name:best, name:latest, name:N, a run id, or a "
        "checkpoint directory), one per model; a string may list several, comma-separated.",
    )
    storage: str | None = Field(None, description="Storage root; null: $RELAY_HOME, ~/relay.")
    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,  # as registry names: one URL path segment
        description="Model name in URLs, when one model is served; null: the registry model "
        "name (or the task's).",
    )
    replicas: int = Field(1, ge=1, description="Replicas (the minimum when autoscaling).")
    max_replicas: int | None = Field(
        None, ge=1, description="Autoscale up to this many replicas; null: a fixed count."
    )
    target_ongoing_requests: float = Field(
        32, gt=0, description="Autoscaling target of in-flight requests per replica."
    )
    # Serve's default (5) queues requests at the proxy long before a replica is busy; at 256 a
    # replica holds enough requests in flight to fill its batches (RAY-NOTES, 32 clients: 20 →
    # 283 req/s together with the access log off).
    max_ongoing_requests: int = Field(256, ge=1, description="In-flight requests per replica.")
    # Serve's default (-1) lets requests beyond max_ongoing_requests wait without bound, each
    # holding its connection and body; past this many waiting, a replica answers 503 at once.
    max_queued_requests: int = Field(
        1024, ge=1, description="Requests waiting for a replica's in-flight slot; then 503."
    )
    access_log: bool = Field(False, description="Log every request (a log line costs time).")
    replica_resources: dict[str, float] | None = Field(
        None,
        description="Custom Ray resources each replica asks for besides its CPUs, e.g. "
        "{host1: 1} to place replicas on the nodes that offer `host1` (`ray start "
        "--resources`); a string is read as YAML.",
    )

    @field_validator("replica_resources", mode="before")
    @classmethod
    def _resources_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the command line or `serve run key=value`
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError as exc:
                raise ValueError(f"not YAML: {value!r} ({exc.problem})") from None
        return value

    @field_validator("replica_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, amount in (value or {}).items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"{name} is one of Ray's own resources, not a custom one "
                    "(a replica's CPUs: num_cpus)"
                )
            if amount <= 0:
                raise ValueError(f"{name}: {amount} is not a positive amount")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _one_name(self) -> "AppArgs":
        if self.name is not None and len(self.model) > 1:
            raise ValueError("name renames one model; it cannot name several")
        return self

    def replica_args(self) -> ReplicaArgs:
        return ReplicaArgs.model_validate(self.model_dump(include=set(ReplicaArgs.model_fields)))


class BadOption(ValueError):
    """A serving option that AppArgs refused, named the way the caller wrote it."""


def app_args(refs: list[str], options: dict[str, Any], *, flags: bool) -> AppArgs:
    """AppArgs for the models `refs` and the serving `options`. BadOption names the first
    option at fault as the caller wrote it: a flag (`--max-batch-size`) for the command line,
    a keyword (`max_batch_size`) for Python; a rule between options is said on its own."""
    try:
        return AppArgs(model=refs, **options)
    except ValidationError as exc:
        item = exc.errors()[0]
        message = item["msg"].removeprefix("Value error, ")
        if not item["loc"]:
            raise BadOption(message) from None
        parts = [str(part) for part in item["loc"]]
        where = "--" + "-".join(parts).replace("_", "-") if flags else ".".join(parts)
        raise BadOption(f"{where}: {message}") from None


def replica_version(args: ReplicaArgs) -> str:
    """A digest of what the replicas are built from (their arguments and relay's version).
    Serve restarts replicas when it changes; when only the models change, it does not (see
    relay/serving/model_table.py)."""
    built_from = {"relay": __version__, **args.model_dump()}
    return hashlib.sha256(json.dumps(built_from, sort_keys=True).encode()).hexdigest()[:16]
