"""A task for the file-ingest tests (named in configs as `tests.id_task:IdTask`): a linear
model over feature columns whose statistics also sum each row's id and id², so a test can
check which rows an epoch saw — every row exactly once — from the run's own metrics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from relay.tasks.base import Batch, Split, Task, TaskSize


class IdSize(TaskSize):
    features: int = Field(4, ge=1)


class IdTask(Task):
    metric = "val_loss"
    mode = "min"
    Size = IdSize
    sizes = {"debug": {}}
    batch_columns = ("id", "x", "y")

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(self.hp.features, 1)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        raise NotImplementedError("IdTask reads its data from files (data.format)")

    def input_columns(self) -> dict[str, torch.dtype]:
        return {"x": torch.float32, "y": torch.float32, "id": torch.float64}

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        loss = F.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        ids = batch["id"]
        n = len(ids)
        stats = {
            "count": torch.tensor(float(n)),
            "loss_sum": loss.detach() * n,
            "id_sum": ids.sum(),
            "id_sq_sum": (ids * ids).sum(),
        }
        return loss, stats

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return {
            "loss": sums["loss_sum"] / max(sums["count"], 1.0),
            "count": sums["count"],
            "id_sum": sums["id_sum"],
            "id_sq_sum": sums["id_sq_sum"],
        }
