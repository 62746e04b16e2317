"""A task for the step-clock tests (named in configs as `tests.crash_task:CrashTask`): digits,
whose worker process SIGKILLs itself as it begins training step `crash_at_step` of the run, on
the first attempt only (a file in `crash_dir` marks that it happened): a lost worker at a
known step, without a test thread racing a fast run. With `crash_after`, it first waits until
Ray Train has registered that checkpoint of the run in `crash_run_glob` (a step here takes
milliseconds; the controller registers a report when it next polls the worker)."""

from __future__ import annotations

import glob
import os
import signal
import time
from pathlib import Path

import torch
from pydantic import Field

from relay.checkpoints import checkpoint
from relay.tasks.base import Batch
from relay.tasks.digits import DigitsSize, DigitsTask


class CrashSize(DigitsSize):
    crash_dir: str | None = Field(None, description="Where the crash leaves its mark.")
    crash_at_step: int = Field(1, ge=1, description="The run's step whose start kills it.")
    crash_run_glob: str | None = Field(None, description="The run's directory, as a glob.")
    crash_after: str | None = Field(None, description="A checkpoint to wait for, by name.")


class CrashTask(DigitsTask):
    Size = CrashSize

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps = 0  # training micro-batches this process began (one a step here)

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        if model.training and self.hp.crash_dir:
            self._steps += 1
            mark = Path(self.hp.crash_dir) / "crashed"
            if self._steps == self.hp.crash_at_step and not mark.exists():
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.write_text(str(os.getpid()))
                self._await_registered()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().loss_and_stats(model, batch)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return {**super().summarize(sums), "count": sums["count"]}  # samples the pass saw

    def _await_registered(self, wait_s: float = 120.0) -> None:
        if not self.hp.crash_after:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for run_dir in glob.glob(self.hp.crash_run_glob):
                latest = checkpoint.latest_registered(run_dir)
                if latest and latest[0].name == self.hp.crash_after:
                    return
            time.sleep(0.05)
        raise AssertionError(f"{self.hp.crash_after} was never registered")
