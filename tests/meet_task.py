"""A task for tests whose runs must be under way at the same time (named in configs as
`tests.meet_task:MeetingTask`): digits, whose rank 0 waits at its first training step until
`meet_count` runs have reached theirs (a file each in `meet_dir`), or `meet_s` has passed."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import torch
from pydantic import Field

from relay import parallel
from relay.tasks.base import Batch
from relay.tasks.digits import DigitsSize, DigitsTask


class MeetingSize(DigitsSize):
    meet_dir: str | None = Field(None, description="Where each run leaves its file.")
    meet_count: int = Field(1, ge=1, description="How many runs meet there.")
    meet_s: float = Field(120.0, ge=0, description="The longest a run waits for the others.")


class MeetingTask(DigitsTask):
    Size = MeetingSize

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._met = False

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        if model.training and not self._met and self.hp.meet_dir and parallel.rank() == 0:
            self._met = True
            self.meet(Path(self.hp.meet_dir))
        return super().loss_and_stats(model, batch)

    def meet(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{os.getpid()}-{uuid.uuid4().hex[:8]}").write_text(str(time.time()))
        deadline = time.monotonic() + self.hp.meet_s
        while len(list(directory.iterdir())) < self.hp.meet_count:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
