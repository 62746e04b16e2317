"""Which models an endpoint serves: resolved on the driver, loaded and swapped in each replica.

The table travels to the replicas as the deployment's `user_config` ({"models": [ModelInfo,
...]}), not as constructor arguments. Serve applies a change of `user_config` alone in place:
it calls each running replica's `reconfigure` (no restart, no drain). While it runs, Serve
counts the replica as UPDATING, not RUNNING, so new requests go to the other replicas, or with
none to Serve's fallback proxy, which holds them until it is back (ray/serve/_private/
deployment_state.py, get_running_replica_infos); the requests it already has run on. So a
version swap (`relay deploy`) has every replica load the new weights beside the old ones first,
while it still answers (relay/serving/staging.py), and `reconfigure` then only replaces the
whole table in one assignment: a request runs start to finish on the version it found, and once
every replica has swapped, only the new version answers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel


class ModelInfo(BaseModel):
    """A resolved model. Resolved once, on the driver, so that every replica loads the same
    checkpoint even if a newer version is registered meanwhile."""

    name: str  # in URLs: /v1/models/{name}
    reference: str  # e.g. "digits:3", a run id, or a checkpoint path
    version: int | str
    task: str
    checkpoint: str


def resolve(
    reference: str, storage: str | None, name: str | None = None, allow_task: Iterable[str] = ()
) -> ModelInfo:
    """Registry reference → checkpoint. Raises KeyError (no such model), TypeError (its task
    cannot be served), OSError (the checkpoint is unreadable) or relay.tasks.UntrustedTask
    (its meta.json names a task that is neither built in, nor the one the storage root records
    for it, nor in `allow_task`: nothing is imported). The task it returns is the one checked
    here, and the only one a replica imports for this model (see `load`)."""
    from relay import config
    from relay.checkpoints import checkpoint
    from relay.records import registry
    from relay.tasks import resolve_task_class

    root = config.resolve_storage(storage)
    found = registry.resolve_model(root, reference)
    allowed = [*allow_task, *registry.recorded_task(root, found)]
    task_name = checkpoint.checked_task(found.checkpoint, allowed)
    if not resolve_task_class(task_name).servable():
        raise TypeError(
            f"task {task_name!r} cannot be served: it needs Instance and Prediction schemas and "
            "a predict() method (see relay/tasks/base.py)"
        )
    version = found.version or {}
    return ModelInfo(
        name=name or version.get("model") or registry.default_model_name(task_name),
        reference=found.reference,
        version=version.get("version", found.reference),
        task=task_name,
        checkpoint=str(found.checkpoint),
    )


def user_config(models: list[ModelInfo]) -> dict[str, Any]:
    return {"models": [info.model_dump(mode="json") for info in models]}


def models_of(config: dict[str, Any]) -> list[ModelInfo]:
    return [ModelInfo.model_validate(item) for item in config["models"]]


@dataclass(eq=False)
class LoadedModel:
    """One model in a replica: its weights, its task (schemas, predict), what it has run."""

    info: ModelInfo
    task: Any
    model: Any
    batch_sizes: Counter[int] = field(default_factory=Counter)
    batcher: Any = None  # the AdaptiveBatcher for this model's forwards, set by the server
    staged: bool = False  # loaded ahead of the swap that brought it in (relay/serving/staging.py)

    @property
    def version(self) -> str:
        return str(self.info.version)


def load(info: ModelInfo) -> LoadedModel:
    """The model `info` names, in a replica. `info.task` is the task the driver checked
    (`resolve`) and passed here in the application's own arguments (the user_config): the
    replica imports that task only, whatever the checkpoint's meta.json says by now."""
    from relay.checkpoints.checkpoint import load_model

    task, model = load_model(info.checkpoint, allow_task=[info.task])
    return LoadedModel(info, task, model)


async def load_table(
    models: list[ModelInfo], *loaded: dict[str, LoadedModel]
) -> dict[str, LoadedModel]:
    """The new table: a model already in one of the `loaded` tables at the same checkpoint is
    kept (its batcher and counters too), the others loaded in a thread, so the replica serves
    on meanwhile."""
    table = {}
    for info in models:
        kept = [t[info.name] for t in loaded if info.name in t and t[info.name].info == info]
        table[info.name] = kept[0] if kept else await asyncio.to_thread(load, info)
    return table
