"""Where the worker loop runs, and the few things it asks of that place.

The loop (worker_loop.py) is the same everywhere; what it needs from around it is five things:
its device, the checkpoint its run continues from, the node it runs on (for the hang doctor),
and a way to report an epoch with or without a checkpoint. Two hosts give them:

- `TrainWorker`: a rank of a Ray Train worker group (`relay train`, multi-worker trials);
  Ray Train keeps the run's checkpoints and calls the run's callbacks on its controller.
- `TrialProcess`: the one worker of a sweep trial, run inside the Tune trial's own actor
  (`training/in_process.py`); no controller, no worker group. The host keeps the run's
  checkpoints where Train would (ray_private.RunCheckpoints) and calls the run's callbacks
  (Tune's report among them) itself, in the loop's thread.

Nothing else in the loop knows which one it runs under.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import ray
import ray.train
import torch


class LoopHost(Protocol):
    def device(self) -> torch.device: ...

    def own_checkpoint(self) -> ray.train.Checkpoint | None:
        """The run's latest checkpoint: what a restarted or resumed run continues from."""

    def node(self) -> tuple[str, str]:
        """(Ray node id, node IP) of this process."""

    def report(
        self,
        metrics: dict[str, Any],
        staging: Path | None = None,
        *,
        dir_name: str | None = None,
        overlapped: bool = False,
    ) -> bool:
        """Report an epoch's metrics; with `staging`, the checkpoint written there as the run's
        `dir_name`. Returns True when the host took the staging directory over (it deletes it
        once copied: `overlapped`, the copy runs while training goes on); else the caller
        deletes it."""


def _node() -> tuple[str, str]:
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class TrainWorker:
    """A rank of a Ray Train worker group."""

    def device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def own_checkpoint(self) -> ray.train.Checkpoint | None:
        return ray.train.get_checkpoint()

    def node(self) -> tuple[str, str]:
        return _node()

    def report(self, metrics, staging=None, *, dir_name=None, overlapped=False) -> bool:
        # Every rank calls ray.train.report: a collective.
        if staging is None:
            ray.train.report(metrics)
            return False
        mode = ray.train.CheckpointUploadMode
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(staging),
            checkpoint_dir_name=dir_name,
            checkpoint_upload_mode=mode.ASYNC if overlapped else mode.SYNC,
            delete_local_checkpoint_after_upload=overlapped,
        )
        return overlapped


class TrialProcess:
    """The one worker of a run trained in this process. `checkpoints`: the run's
    (ray_private.RunCheckpoints); `callbacks`: ray.train.UserCallbacks, each called after every
    report as Train's controller would call it (rank 0's metrics, the stored checkpoint)."""

    def __init__(self, checkpoints, callbacks: list, use_gpu: bool) -> None:
        self.checkpoints, self.callbacks, self.use_gpu = checkpoints, callbacks, use_gpu
        self.last_metrics: dict[str, Any] | None = None

    def device(self) -> torch.device:
        # Ray sets CUDA_VISIBLE_DEVICES to the GPU it gave the trial: the first visible one.
        return torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")

    def own_checkpoint(self) -> ray.train.Checkpoint | None:
        return self.checkpoints.latest()

    def node(self) -> tuple[str, str]:
        return _node()

    def report(self, metrics, staging=None, *, dir_name=None, overlapped=False) -> bool:
        # Copied before training goes on: there is no other process to overlap the copy with.
        stored = self.checkpoints.add(staging, dir_name, metrics) if staging else None
        self.last_metrics = metrics
        for callback in self.callbacks:
            callback.after_report(None, [metrics], stored)
        return False
