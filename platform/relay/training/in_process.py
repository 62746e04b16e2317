"""A one-worker run trained in the calling process: how a sweep trial that fits one worker runs,
inside its own Tune trial actor.

A TorchTrainer run starts a controller actor and a worker group: two more processes per trial,
each importing Ray Train and torch (~3.6 CPU-s each here), and a process group of one. For a
trial of one worker none of that buys anything: the trial's actor runs the same worker loop
itself (worker_loop.run_loop under hosts.TrialProcess), and Tune reuses the actor for the next
trial (`reuse_actors`), so a trial after the first starts without a process start at all.

What stays the same: the run's directory, records, history, logs, heartbeat and checkpoints
(kept where and as Train keeps them: ray_private.RunCheckpoints), its callbacks (trackers,
Tune's report) called after each report, `driver.fit`'s result. What changes: the trial's
actor holds the worker's resources (not a worker group), and a failure is Tune's to retry
(`tune.FailureConfig`, from `failure.max_failures`): the trial restarts, in a fresh actor,
from its run's last checkpoint.
"""

from __future__ import annotations

from typing import Any

from relay.config import RunConfig


def unfit_reason(cfg: RunConfig) -> str | None:
    """Why a run of `cfg` must train under Ray Train rather than in the calling process; None
    when it can train in process."""
    from relay.training.data import ingest

    scaling = cfg.scaling
    if scaling.max_workers != 1 or scaling.elastic:
        return "more than one worker"
    if scaling.memory_per_worker is not None:
        return "scaling.memory_per_worker (a limit on the worker's own process)"
    if ingest.choose(cfg) is not ingest.Ingest.OBJECT_STORE:
        return "Ray Data ingest (its shards are handed out by Ray Train)"
    if cfg.checkpoint.sharded(cfg.parallel.strategy):
        return "sharded checkpoints (written as a collective of a process group)"
    return None


class InProcessRun:
    """`fit()` as a TorchTrainer offers it, for one worker trained in this process."""

    def __init__(self, loop_config: dict[str, Any], checkpoint_config, callbacks: list, use_gpu):
        self.loop_config = loop_config
        self.checkpoint_config, self.callbacks, self.use_gpu = checkpoint_config, callbacks, use_gpu

    def fit(self):
        """Train; returns the run's ray.train.Result. The loop's own exception is raised as is."""
        from pathlib import Path

        from relay.runtime import ray_private
        from relay.training import hosts, worker_loop

        checkpoints = ray_private.RunCheckpoints(
            Path(self.loop_config["run_dir"]), self.checkpoint_config
        )
        host = hosts.TrialProcess(checkpoints, self.callbacks, self.use_gpu)
        returned = worker_loop.run_loop(self.loop_config, host)
        return checkpoints.result(host.last_metrics, returned)
