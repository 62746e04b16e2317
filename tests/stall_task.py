"""A task for the hang-doctor tests (named in configs as `tests.stall_task:StallingTask`): the
regression task, whose one rank sleeps inside a training step once — a rank that stops making
progress while the others wait for it in the step's gradient all-reduce."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from pydantic import Field

from relay import parallel
from relay.tasks.base import Batch
from relay.tasks.regression import RegressionSize, RegressionTask


class StallingSize(RegressionSize):
    stall_rank: int = Field(-1, description="The rank that stalls; -1: none.")
    stall_at: int = Field(20, ge=1, description="The training step (from 1) it stalls in.")
    stall_s: float = Field(20.0, ge=0, description="How long it sleeps there.")
    marker: str | None = Field(None, description="A file it writes the stall's start time to.")
    release: str | None = Field(None, description="A file whose appearance ends the sleep.")


class StallingTask(RegressionTask):
    Size = StallingSize
    sizes = {"debug": {"samples": 2048, "features": 8, "hidden": [32]}}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._training_steps = 0

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        if model.training:
            self._training_steps += 1
            if self._training_steps == self.hp.stall_at and parallel.rank() == self.hp.stall_rank:
                self.stall_in_the_step()
        return super().loss_and_stats(model, batch)

    def stall_in_the_step(self) -> None:
        if self.hp.marker:
            Path(self.hp.marker).write_text(str(time.time()))
        deadline = time.monotonic() + self.hp.stall_s
        while time.monotonic() < deadline:
            if self.hp.release and Path(self.hp.release).exists():
                return
            time.sleep(0.1)
