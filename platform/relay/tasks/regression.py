"""`regression`: synthetic tabular regression — the fastest smoke test of the whole stack."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, ValidationInfo, create_model, field_validator

from relay.models import MLP
from relay.tasks.base import (
    Batch,
    InstanceSchema,
    PredictionSchema,
    Split,
    Task,
    TaskSize,
    split_rows,
)


class RegressionSize(TaskSize):
    samples: int = Field(gt=1, description="Rows generated.")
    features: int = Field(ge=1, description="Input features.")
    hidden: list[int] = Field(description="Hidden layer widths.")
    noise: float = Field(0.1, ge=0, description="Std of the Gaussian label noise.")


class RegressionInstance(InstanceSchema):
    """One row of features; how many depends on the model (its size's `features`)."""

    shorthand = "features"
    features: list[float] = Field(min_length=1, description="The model's input features.")

    @field_validator("features")
    @classmethod
    def _fits_the_model(cls, value: list[float], info: ValidationInfo) -> list[float]:
        task = (info.context or {}).get("task")
        if task is not None and len(value) != task.hp.features:
            raise ValueError(f"expected {task.hp.features} features, got {len(value)}")
        return value


@cache  # one class per width: the OpenAPI document names it once
def instance_of_width(features: int) -> type[BaseModel]:
    exactly = Field(min_length=features, max_length=features, description="The input features.")
    return create_model(
        f"RegressionInstance{features}",
        __base__=RegressionInstance,
        __doc__=f"One row of {features} features.",
        features=(list[float], exactly),
    )


class RegressionPrediction(PredictionSchema):
    value: float = Field(description="The predicted target.")


class RegressionTask(Task):
    """y = tanh-mixed linear function of x plus noise; reports MSE and R²."""

    name = "regression"
    metric = "val_loss"
    mode = "min"
    Size = RegressionSize
    Instance = RegressionInstance
    Prediction = RegressionPrediction
    sizes = {
        "debug": {"samples": 512, "features": 8, "hidden": [32]},
        "default": {"samples": 20_000, "features": 32, "hidden": [128, 128]},
    }

    def instance_schema(self) -> type[BaseModel]:
        return instance_of_width(self.hp.features)

    def build_model(self) -> torch.nn.Module:
        return MLP(self.hp.features, self.hp.hidden, 1)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        # The generating function is fixed (seed 0) so every run learns the same problem; the
        # run's seed only decides the split.
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.hp.samples, self.hp.features)).astype(np.float32)
        w = rng.normal(size=(self.hp.features,)) / np.sqrt(self.hp.features)
        y = np.tanh(x @ w) + 0.5 * (x @ w) + self.hp.noise * rng.normal(size=self.hp.samples)
        return split_rows({"x": x, "y": y.astype(np.float32)}, val_fraction, seed)

    batch_columns = ("x", "y")

    def input_columns(self) -> dict[str, torch.dtype]:
        return {"x": torch.float32, "y": torch.float32}

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        pred = model(batch["x"]).squeeze(-1)
        loss = F.mse_loss(pred, batch["y"])
        y = batch["y"].detach()
        stats = {
            "count": torch.tensor(float(len(y))),
            "loss_sum": loss.detach() * len(y),
            "y_sum": y.sum(),
            "y_sq_sum": (y * y).sum(),
        }
        return loss, stats

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["count"], 1.0)
        mse = sums["loss_sum"] / n
        variance = sums["y_sq_sum"] / n - (sums["y_sum"] / n) ** 2
        return {"loss": mse, "r2": 1.0 - mse / variance if variance > 0 else 0.0}

    def predict(
        self, model: torch.nn.Module, instances: list[RegressionInstance]
    ) -> list[RegressionPrediction]:
        x = torch.tensor([instance.features for instance in instances], dtype=torch.float32)
        if x.shape[1] != self.hp.features:  # unvalidated input; the schema checks this too
            raise ValueError(f"expected {self.hp.features} features, got {x.shape[1]}")
        with torch.inference_mode():
            values = model(x).squeeze(-1)
        return [RegressionPrediction(value=value) for value in values.tolist()]
