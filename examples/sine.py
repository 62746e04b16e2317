"""A user's own task, kept outside relay: fit y = sin(3x) + noise with a small MLP.

Point a config at it by import path (see examples/sine.yaml):

    relay train examples/sine.yaml                       # from the repository root
    ray job submit --working-dir . -- python jobs/train.py examples/sine.yaml

The module must be importable where the workers run: relay puts the current directory on the
workers' path for its embedded cluster, and `--working-dir .` ships it to a remote cluster.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field

from relay.models import MLP
from relay.tasks import Split, Task, TaskSize, split_rows
from relay.tasks.base import InstanceSchema, PredictionSchema


class SineSize(TaskSize):
    samples: int = Field(gt=1, description="Points sampled on [-2, 2].")
    hidden: list[int] = Field(description="Hidden layer widths.")


class SineInstance(InstanceSchema):  # what a client sends to be served: {"x": 0.5}
    model_config = ConfigDict(json_schema_extra={"examples": [{"x": 0.5}]})
    shorthand = "x"  # a bare number stands for {"x": number}
    x: float = Field(description="Where to evaluate; the model saw [-2, 2].")


class SinePrediction(PredictionSchema):  # what it gets back: {"y": 0.99}
    y: float


class SineTask(Task):
    metric = "val_loss"
    mode = "min"
    Size = SineSize
    Instance = SineInstance
    Prediction = SinePrediction
    sizes = {
        "debug": {"samples": 512, "hidden": [32]},
        "default": {"samples": 8192, "hidden": [64, 64]},
    }

    def build_model(self) -> torch.nn.Module:
        return MLP(1, self.hp.hidden, 1)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        rng = np.random.default_rng(1234)
        x = rng.uniform(-2, 2, size=(self.hp.samples, 1)).astype(np.float32)
        y = (np.sin(3 * x[:, 0]) + 0.05 * rng.normal(size=self.hp.samples)).astype(np.float32)
        return split_rows({"x": x, "y": y}, val_fraction, seed)

    def loss_and_stats(self, model, batch):
        loss = F.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        n = len(batch["y"])
        return loss, {"count": torch.tensor(float(n)), "loss_sum": loss.detach() * n}

    def predict(self, model, instances):  # one forward for a whole server-side batch
        x = torch.tensor([[instance.x] for instance in instances])
        with torch.inference_mode():
            ys = model(x).squeeze(-1).tolist()
        return [SinePrediction(y=y) for y in ys]
