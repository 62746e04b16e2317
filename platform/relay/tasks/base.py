"""What a task is: the one extension point of relay.

A task bundles everything that is specific to a problem — the model builder, the data, the loss
and the metrics — so the train loop, Tune and Serve stay generic. Subclass `Task`, give it a
pydantic `Size` model with named presets (one of them "debug", tiny, for tests and smoke runs),
and point a config's `task:` at it as "package.module:Class".

To be served (relay/serving/app.py), a task also declares what one request instance and one
prediction look like — pydantic models `Instance` and `Prediction` — and implements `predict`,
which runs the whole list of instances of a (server-side) batch through the model at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator
from torch import nn

Batch = dict[str, torch.Tensor]
Columns = dict[str, np.ndarray]


class TaskSize(BaseModel):
    """Base for a task's hyper-parameters; a preset is a dict of these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceSchema(BaseModel):
    """Base for a task's request instance: what one client sends to be predicted.

    Strict (no "5" for 5, no true for 1), closed (unknown fields are errors) and finite (NaN and
    infinity are errors): a server must reject bad input, never guess at it.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    #: The field a bare value fills, so `[0, 3, ...]` may stand for `{"pixels": [0, 3, ...]}`
    #: (the TF-Serving "row" form); None: instances must be objects.
    shorthand: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _expand_shorthand(cls, value: Any) -> Any:
        if cls.shorthand is not None and not isinstance(value, dict):
            return {cls.shorthand: value}
        return value

    @classmethod
    def request_item(cls) -> Any:
        """The type one instance of a request may take, as the API documents it: this object,
        or (with a `shorthand`) the bare value of that field, which the server accepts too."""
        if cls.shorthand is None:
            return cls
        field = cls.model_fields[cls.shorthand]
        bare = (
            Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        )
        return Union[cls, bare]  # noqa: UP007 (`|` cannot join a class and an Annotated)


class PredictionSchema(BaseModel):
    """Base for a task's prediction of one instance (the response side)."""

    model_config = ConfigDict(extra="forbid")


@cache
def _instances_adapter(instance: type[BaseModel]) -> TypeAdapter:
    return TypeAdapter(list[instance])  # built once per schema: adapters are costly to build


#: Seeds the test split's draw. A constant, not the run's seed: the test samples must be the same
#: for every run, so that no seed or val_fraction ever trains on or selects by them.
TEST_SPLIT_SEED = 20_240_601


@dataclass(frozen=True)
class Split:
    """Train, validation and (optionally) test samples as equal-length numpy columns (row i =
    sample i).

    `train` is trained on; `val` is evaluated every epoch and picks the checkpoints (and the
    sweep's best trial), so it is no longer unseen afterwards; `test` is neither: it is for
    measuring the finished model (jobs/demo.py). None: the task keeps no test split.
    """

    train: Columns
    val: Columns
    test: Columns | None = None

    def __post_init__(self) -> None:
        parts = (("train", self.train), ("val", self.val), ("test", self.test or {}))
        for part, columns in parts:
            lengths = {name: len(array) for name, array in columns.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(f"{part} columns differ in length: {lengths}")


def _take(columns: Columns, rows: np.ndarray) -> Columns:
    return {name: array[rows] for name, array in columns.items()}


def split_rows(
    columns: Columns, val_fraction: float, seed: int, test_fraction: float = 0.0
) -> Split:
    """A deterministic random split of rows into train, validation and test.

    The test rows (`test_fraction` of all, none by default) are drawn first, by a fixed seed
    (TEST_SPLIT_SEED): the same rows whatever `seed` and `val_fraction` are. The rest is split
    into train and validation by `seed`, `val_fraction` of it held out for validation.
    """
    n = len(next(iter(columns.values())))
    rest = np.arange(n)
    test = None
    if test_fraction > 0:
        drawn = np.random.default_rng(TEST_SPLIT_SEED).permutation(n)
        n_test = max(1, round(n * test_fraction))
        test = _take(columns, np.sort(drawn[:n_test]))
        rest = np.sort(drawn[n_test:])
    order = np.random.default_rng(seed).permutation(len(rest))
    n_val = max(1, round(len(rest) * val_fraction))
    val_idx, train_idx = np.sort(rest[order[:n_val]]), np.sort(rest[order[n_val:]])
    return Split(train=_take(columns, train_idx), val=_take(columns, val_idx), test=test)


class Task(ABC):
    """Model + data + loss + metrics for one problem."""

    #: Registry name of a built-in task (user tasks are named by their import path).
    name: ClassVar[str]
    #: The reported metric that ranks checkpoints and trials, e.g. "val_accuracy".
    metric: ClassVar[str]
    mode: ClassVar[Literal["min", "max"]]
    #: The hyper-parameter model and its named presets; "debug" is required.
    Size: ClassVar[type[TaskSize]]
    sizes: ClassVar[dict[str, dict[str, Any]]]
    #: Whether `data.path` means something to this task.
    accepts_data_path: ClassVar[bool] = False
    #: The columns `preprocess` gives (what `loss_and_stats` reads): data from files is checked
    #: for them on the cluster before any worker starts; empty: not checked.
    batch_columns: ClassVar[tuple[str, ...]] = ()
    #: Images read from files (`data.format: images`) are resized to (height, width) in this
    #: mode ("L": grayscale, "RGB"); None: as stored.
    image_size: ClassVar[tuple[int, int] | None] = None
    image_mode: ClassVar[str | None] = None
    #: Throughput is reported in these units (e.g. "tokens"), counted by this key of the
    #: stats `loss_and_stats` returns; default: samples, counted by "count".
    throughput_unit: ClassVar[str] = "samples"
    throughput_stat: ClassVar[str] = "count"
    #: Whether `build_model` may run under `torch.device("meta")` (fsdp's meta init): False
    #: for models that load weights while they are built (a pretrained directory).
    builds_on_meta: ClassVar[bool] = True
    #: Serving: one request instance and one prediction (subclasses of InstanceSchema and
    #: PredictionSchema). Declared, not defined: a task without them cannot be served.
    Instance: ClassVar[type[BaseModel]]
    Prediction: ClassVar[type[BaseModel]]

    def instance_schema(self) -> type[BaseModel]:
        """`Instance` as this model's API documents it: narrowed where the model fixes what
        the task leaves open (regression's feature count). Validation needs no narrowing:
        `Instance` checks such things against the task in its validation context."""
        return self.Instance

    def __init__(
        self,
        size: str = "default",
        model: dict[str, Any] | None = None,
        data_path: str | None = None,
    ) -> None:
        self.size_name = size
        self.hp = self.check_size(size, model or {})
        self.data_path = data_path

    @classmethod
    def check_size(cls, size: str, overrides: dict[str, Any]) -> TaskSize:
        if size not in cls.sizes:
            choices = ", ".join(sorted(cls.sizes))
            raise ValueError(f"size: unknown size {size!r} for this task (choices: {choices})")
        try:
            return cls.Size(**{**cls.sizes[size], **overrides})
        except ValidationError as exc:
            item = exc.errors()[0]
            field = ".".join(str(p) for p in item["loc"])
            message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
            raise ValueError(f"model.{field}: {message}") from None

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A plain nn.Module (no distribution wrappers); relay.parallel wraps it."""

    @abstractmethod
    def load_data(self, val_fraction: float, seed: int) -> Split:
        """All samples, split deterministically by `seed`. Runs once, on the driver.

        A task that keeps a test split (`Split.test`, e.g. `split_rows(..., test_fraction=)`)
        must draw it independently of `seed` and `val_fraction`; only train and val reach the
        workers."""

    def load_test(self) -> Columns | None:
        """The test split: samples that neither training nor checkpoint selection ever sees,
        the same for every run of this task and size; None if the task keeps none."""
        # Any seed and val_fraction: the test rows do not depend on them.
        return self.load_data(val_fraction=0.2, seed=0).test

    @abstractmethod
    def loss_and_stats(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        """The mean loss of `batch`, and sums for metrics: at least "count" and "loss_sum".

        Sums (not means) so that they add up across batches and ranks exactly.
        """

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Turn summed statistics into metrics (without the train_/val_ prefix)."""
        return {"loss": sums["loss_sum"] / max(sums["count"], 1.0)}

    def preprocess(self, batch: Columns) -> Columns:
        """Rows read from files (`data.format`, after `data.columns`) → the task's columns:
        decode, tokenize, normalise. Runs on Ray Data's CPU tasks beside the trainers (never on
        them) and may change the number of rows (charlm packs lines into windows). Default: the
        batch as it is."""
        return batch

    def save_assets(self, directory: Path) -> None:
        """Write files a checkpoint needs besides weights, train state and meta.json (a
        tokenizer, a model config), on rank 0 into the checkpoint's directory. Default: none."""
        return

    def load_assets(self, directory: Path) -> None:
        """Take what `save_assets` wrote, when the task is rebuilt from a checkpoint (serving,
        offline inference). Default: nothing to take."""
        return

    def input_columns(self) -> dict[str, torch.dtype]:
        """The dtype each batch column is converted to on the way into torch."""
        return {}

    def first_rows(self, columns: dict[str, Any], n: int) -> Batch:
        """The first `n` rows of numpy columns as the torch batch the loop would feed."""
        dtypes = self.input_columns()
        batch = {}
        for name, array in columns.items():
            tensor = torch.as_tensor(np.array(array[:n]))  # a copy: files' arrays are read-only
            batch[name] = tensor.to(dtypes.get(name, tensor.dtype))
        return batch

    @classmethod
    def servable(cls) -> bool:
        """Whether this task has what serving needs: both schemas and its own `predict`."""
        has_schemas = hasattr(cls, "Instance") and hasattr(cls, "Prediction")
        return has_schemas and cls.predict is not Task.predict

    def validate_instances(self, items: list[Any]) -> list[BaseModel]:
        """Parse raw (JSON-decoded) instances with `Instance`; raises pydantic's
        ValidationError, whose locations start with the instance's index.

        The task itself is the validation context, so a schema can check what depends on the
        model's size (e.g. regression's feature count: `info.context["task"].hp.features`).
        """
        if not hasattr(self, "Instance"):
            raise TypeError(f"{type(self).__name__} declares no Instance schema")
        return _instances_adapter(self.Instance).validate_python(items, context={"task": self})

    def predict(self, model: nn.Module, instances: list[BaseModel]) -> list[BaseModel]:
        """Predictions for validated `instances`, in order: one forward for the whole list."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot be served: give it Instance and Prediction schemas "
            "and a predict() method (see relay/tasks/digits.py)"
        )
