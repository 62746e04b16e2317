"""`digits`: scikit-learn's bundled 8×8 handwritten digits (1,797 real images, no download).

A fixed 15% (270 images) is kept as a test split (`Task.load_test`); `data.val_fraction` holds
out that share of the other 1,527 for validation."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, field_validator

from relay.models import MLP
from relay.tasks.base import (
    Batch,
    Columns,
    InstanceSchema,
    PredictionSchema,
    Split,
    Task,
    TaskSize,
    split_rows,
)

PIXEL_MAX = 16.0  # the data set's pixels are intensities 0..16
SIDE = 8  # images are SIDE × SIDE
# Share of the 1,797 images (270) kept as the test split before train/val are drawn: the same
# images for every seed and val_fraction, never trained on and never used to pick a checkpoint.
TEST_FRACTION = 0.15

Pixel = Annotated[float, Field(ge=0, le=PIXEL_MAX)]


class DigitsSize(TaskSize):
    hidden: list[int] = Field(description="Hidden layer widths of the MLP.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer.")


class DigitsInstance(InstanceSchema):
    """One 8×8 image: 64 pixel intensities 0–16, flat (row by row) or as 8 rows of 8."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"pixels": [[0, 8, 16, 8, 0, 0, 0, 0]] * 8}]}
    )
    shorthand = "pixels"
    pixels: list[Pixel] = Field(
        min_length=SIDE * SIDE,
        max_length=SIDE * SIDE,
        description="64 intensities 0–16 (as in the data set), row by row; or 8 rows of 8.",
    )

    @field_validator("pixels", mode="before")
    @classmethod
    def _flatten_rows(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
            if len(value) != SIDE or any(len(row) != SIDE for row in value):
                raise ValueError(f"an image as rows needs {SIDE} rows of {SIDE} pixels")
            return [pixel for row in value for pixel in row]
        return value


class DigitsPrediction(PredictionSchema):
    label: int = Field(description="The most likely digit.")
    probabilities: list[float] = Field(description="Probability of each digit 0–9.")


class DigitsTask(Task):
    """Classify 64 pixel intensities (0–16) into 10 digits; reports accuracy."""

    name = "digits"
    metric = "val_accuracy"
    mode = "max"
    Size = DigitsSize
    Instance = DigitsInstance
    Prediction = DigitsPrediction
    sizes = {
        "debug": {"hidden": [32]},
        "default": {"hidden": [256, 128], "dropout": 0.1},
    }

    batch_columns = ("x", "y")
    image_size = (SIDE, SIDE)
    image_mode = "L"

    def build_model(self) -> torch.nn.Module:
        return MLP(64, self.hp.hidden, 10, dropout=self.hp.dropout, input_scale=1 / PIXEL_MAX)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        from sklearn.datasets import load_digits

        digits = load_digits()
        columns = {"x": digits.data.astype(np.float32), "y": digits.target.astype(np.int64)}
        return split_rows(columns, val_fraction, seed, test_fraction=TEST_FRACTION)

    def input_columns(self) -> dict[str, torch.dtype]:
        return {"x": torch.float32, "y": torch.long}

    def preprocess(self, batch: Columns) -> Columns:
        """Images read from a folder per class (`data.format: images`; 8×8 grayscale after
        the read resizes them) become 64 intensities on the data set's 0–16 scale, and the
        class index their label; tabular rows pass with "x" flattened to 64 columns (from
        8×8 tensors, say)."""
        if "image" not in batch:
            x = np.asarray(batch["x"]).reshape(len(batch["x"]), -1)
            if x.shape[1] != SIDE * SIDE:
                raise ValueError(f"digits takes x of {SIDE * SIDE} pixels a row, got {x.shape}")
            return {**batch, "x": x}
        images = np.asarray(batch["image"], dtype=np.float32).reshape(len(batch["image"]), -1)
        if images.shape[1] != SIDE * SIDE:
            raise ValueError(f"digits takes {SIDE}×{SIDE} grayscale images, got {images.shape}")
        return {"x": images * (PIXEL_MAX / 255.0), "y": np.asarray(batch["label"])}

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        logits = model(batch["x"])
        loss = F.cross_entropy(logits, batch["y"])
        n = len(batch["y"])
        stats = {
            "count": torch.tensor(float(n)),
            "loss_sum": loss.detach() * n,
            "correct": (logits.detach().argmax(-1) == batch["y"]).sum().float(),
        }
        return loss, stats

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["count"], 1.0)
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n}

    def predict(
        self, model: torch.nn.Module, instances: list[DigitsInstance]
    ) -> list[DigitsPrediction]:
        x = torch.tensor([instance.pixels for instance in instances], dtype=torch.float32)
        with torch.inference_mode():
            probabilities = F.softmax(model(x), dim=-1)
        labels = probabilities.argmax(dim=-1).tolist()
        return [
            DigitsPrediction(label=label, probabilities=row)
            for label, row in zip(labels, probabilities.tolist(), strict=True)
        ]
