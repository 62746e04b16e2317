"""`digits`: scikit-learn's bundled 8×8 handwritten digits (1,797 real images, no download)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from relay.models import MLP
from relay.tasks.base import Batch, Split, Task, TaskSize, split_rows

PIXEL_MAX = 16.0  # the data set's pixels are intensities 0..16


class DigitsSize(TaskSize):
    hidden: list[int] = Field(description="Hidden layer widths of the MLP.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer.")


class DigitsTask(Task):
    """Classify 64 pixel intensities (0–16) into 10 digits; reports accuracy."""

    name = "digits"
    metric = "val_accuracy"
    mode = "max"
    Size = DigitsSize
    sizes = {
        "debug": {"hidden": [32]},
        "default": {"hidden": [256, 128], "dropout": 0.1},
    }

    def build_model(self) -> torch.nn.Module:
        return MLP(64, self.hp.hidden, 10, dropout=self.hp.dropout, input_scale=1 / PIXEL_MAX)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        from sklearn.datasets import load_digits

        digits = load_digits()
        columns = {"x": digits.data.astype(np.float32), "y": digits.target.astype(np.int64)}
        return split_rows(columns, val_fraction, seed)

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
