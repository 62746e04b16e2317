"""Every private Ray name relay touches, in this one file: each where Ray 2.60 offers no public
way to do what relay needs (each function says why). Written for Ray RAY_VERSION;
tests/test_ray_private.py imports every name below from the installed Ray and checks its version,
so a Ray upgrade fails there first, naming what to re-read.

What is here: Ray Train's worker-group start-up timeout (an `_internal` exception), the env vars
a Train run's controller gets, the GCS's placement-group and actor tables (for orphaned groups of
killed trials), Serve's `_internal` version flag, and three subclasses that replace private
methods: TorchTrainer (callbacks, failure policy), PopulationBasedTraining (seeded decisions),
and Train's default failure policy (out-of-memory ends a run); and Train's checkpoint manager,
for runs trained in a Tune trial's own process (`RunCheckpoints`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from relay.runtime import background

RAY_VERSION = "2.60.0"

# Each private module and the names relay takes from it (the test imports every one).
PRIVATE_NAMES = {
    "ray._common.constants": ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR"],
    "ray._private.state": ["state"],
    "ray._private.worker": ["global_worker"],
    "ray._raylet": ["PlacementGroupID"],
    "ray.core.generated": ["gcs_pb2"],
    "ray.train.v2._internal.constants": [
        "DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE",
        "get_env_vars_to_propagate",
    ],
    "ray.train.v2._internal.exceptions": ["WorkerGroupStartupTimeoutError"],
    "ray.train.v2._internal.callbacks.datasets": ["DatasetsCallback"],
    "ray.train.v2._internal.callbacks.placement_group_callback": ["PlacementGroupCleanerCallback"],
    "ray.train.v2._internal.execution.failure_handling.default": ["DefaultFailurePolicy"],
    "ray.train.v2._internal.execution.failure_handling.failure_policy": ["FailureDecision"],
    "ray.train.v2._internal.execution.checkpoint.checkpoint_manager": ["CheckpointManager"],
    "ray.train.v2._internal.execution.storage": ["StorageContext"],
    "ray.train.v2._internal.execution.training_report": ["_TrainingReport"],
}
# Private attributes and methods of public Ray classes that relay reads or overrides.
PRIVATE_MEMBERS = {
    "ray.train.torch:TorchTrainer": ["_create_default_callbacks", "_initialize_and_run_controller"],
    "ray.tune.schedulers:PopulationBasedTraining": ["_checkpoint_or_exploit"],
    "ray.train:Result": ["_from_checkpoint_manager"],
}
# Ray Data's Parquet planner logs through this logger (relay/training/data/sources.py quiets it).
PARQUET_PLANNER_LOGGER = "ray.data._internal.datasource.parquet_datasource"


def gave_up_placing_workers(exc: BaseException) -> bool:
    """Whether a failed fit() ended because its worker group could not be placed in time, as
    many times as the run allows. Private: the public ControllerError wraps Train's
    WorkerGroupStartupTimeoutError, which only ray.train.v2._internal.exceptions defines."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return isinstance(getattr(exc, "controller_failure", None), WorkerGroupStartupTimeoutError)


def train_controller_env() -> dict[str, str]:
    """The env_vars Ray Train gives a run's controller actor: what fit() would compute now.
    Private: Ray has no public API for this set (ray/train/v2/api/data_parallel_trainer.py
    builds it in _initialize_and_run_controller)."""
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )

    env = get_env_vars_to_propagate()
    env.setdefault(
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
    )
    return env


def _placement_groups() -> list:
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = state._global_state_accessor.get_placement_group_table()
    return [gcs_pb2.PlacementGroupTableData.FromString(raw) for raw in table]


def _made_by_actor(pg) -> bool:
    # A group made by a driver records the nil actor id (all 0xff bytes) and reads as "dead".
    return pg.creator_actor_id != b"\xff" * len(pg.creator_actor_id) and not pg.is_detached


def _live(pg) -> bool:
    return pg.state in (pg.PENDING, pg.PREPARED, pg.CREATED, pg.RESCHEDULING)


def _settled(job, others: set[str]) -> bool:
    """No Train controller of `job` alive but `others`, and no group made by one of its
    actors live (but by `others`).

    PENDING groups count: a dead trial's pending group would be created (and hold its
    CPUs) as soon as the ending trials free them. Only this job's are waited for; another
    job's on a shared cluster are none of its doing.
    """
    if any(
        _made_by_actor(pg)
        and _live(pg)
        and pg.creator_job_id == job.binary()
        and pg.creator_actor_id.hex() not in others
        for pg in _placement_groups()
    ):
        return False
    # Not only ALIVE ones: a controller still being created when its trial was stopped
    # (PENDING_CREATION) comes alive later and may then reserve a group.
    return not alive_actor_ids("TrainController", job, not_dead=True) - others


def alive_actor_ids(class_name: str, job=None, not_dead: bool = False) -> set[str]:
    """The ids of the actors of class `class_name` alive on the connected cluster (`job`'s
    only, if given; with `not_dead`, also those still being created or restarting). Asked of
    the GCS (Ray's public state API goes through the dashboard, which may be off or still
    starting)."""
    from ray._private.state import state

    if not_dead:
        actors = state.actor_table(None, job_id=job)
        return {
            id_
            for id_, actor in actors.items()
            if actor["ActorClassName"] == class_name and actor["State"] != "DEAD"
        }
    alive = state.actor_table(None, job_id=job, actor_state_name="ALIVE")
    return {id_ for id_, actor in alive.items() if actor["ActorClassName"] == class_name}


def actors_of_class(class_name: str) -> dict[str, dict]:
    """Every actor of class `class_name` the connected cluster has created, by id: its state
    ("ALIVE", "DEAD", ...) and process id. Asked of the GCS, as `alive_actor_ids` is: Ray's
    public state API finds its cluster through RAY_ADDRESS and, where that is "local" and
    another Ray runs on the machine, refuses to choose."""
    from ray._private.state import state

    return {
        id_: {"state": actor["State"], "pid": actor["Pid"]}
        for id_, actor in state.actor_table(None).items()
        if actor["ActorClassName"] == class_name
    }


def actors_by_class() -> dict[str, int]:
    """How many actors of each class the connected cluster has created (any state), asked of
    the GCS as `alive_actor_ids` is (bench/startup.py counts what a run starts)."""
    from collections import Counter

    from ray._private.state import state

    return dict(Counter(actor["ActorClassName"] for actor in state.actor_table(None).values()))


def alive_actors(class_name: str) -> int:
    """How many actors of class `class_name` are alive on the connected cluster."""
    return len(alive_actor_ids(class_name))


def _dead(actor_id: bytes) -> bool:
    from ray._private.state import state

    info = state.actor_table(actor_id.hex())
    return bool(info) and info.get("State") == "DEAD"


def release_orphaned_placement_groups() -> list[str]:
    """Remove placement groups whose creating actor is dead; returns their ids (hex).

    A Train run's worker group lives in a placement group its controller actor creates. Ray
    keeps such a group until its creator actor *and* its job are gone, so when Tune stops a
    trial by killing it mid-run, the group outlives the controller for as long as the sweep's
    job runs. Ray Train's own PlacementGroupCleaner is meant to remove it but polls the state
    API and, on a loaded machine, sometimes never does — the group's CPUs then stay reserved
    and later trials (or later runs) wait forever. A group whose creator is dead has no owner
    left, so removing it takes nothing from anyone.

    The group's own `creator_actor_dead` flag is not always enough: a controller killed while
    its group is still pending (a trial waiting for workers, `SweepConfig.overlap`) leaves a
    group without the flag, which Ray creates as soon as CPUs free up and then keeps (seen
    with Ray 2.60). The actor table still says the creator is DEAD, so that is asked too.
    """
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    released = []
    for pg in _placement_groups():
        if not (_live(pg) and _made_by_actor(pg)):
            continue
        if pg.creator_actor_dead or _dead(pg.creator_actor_id):
            remove_placement_group(PlacementGroup(PlacementGroupID(pg.placement_group_id)))
            released.append(pg.placement_group_id.hex())
    return released


@contextmanager
def reclaiming_orphans(
    interval_s: float = 2.0, settle_s: float = 60.0, grace_s: float = 10.0, quiet_s: float = 3.0
) -> Iterator[None]:
    """Release orphaned placement groups every `interval_s` while the block runs, and at its
    end until this job has no Train controller alive but those alive before the block, and no
    group made by an actor left (at most `settle_s`).

    The wait at the end matters: Tune returns once it has stopped its trial actors, but a
    stopped trial's controller dies only when Ray propagates its owner's death. Until then
    its group is no orphan yet, and a controller still alive may even request a new group
    (a sweep's CI run was left with a PENDING one after a 10 s wait for groups alone).

    A controller the block started that is still alive `grace_s` after it is killed: once
    Tune has returned no trial is left to report to it. (A controller whose creation was
    under way when its trial actor died can come alive without an owner and then holds its
    worker group for as long as the job runs; a CI run was left with one CREATED group after
    the whole settle wait.)

    Settled means settled for `quiet_s`: such a controller can also reach the GCS after the
    first settled look (a CI run was left with a CREATED group of a stopped ASHA trial that
    outlived the sweep and the next test), and any that appears in that time is waited for,
    then killed, as above.
    """
    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    # Controllers alive before the block are another run's of this process, not the block's.
    others = alive_actor_ids("TrainController", job, not_dead=True)
    try:
        with background.every(interval_s, release_orphaned_placement_groups, "relay-pg-reclaim"):
            yield
    finally:
        start = time.monotonic()
        killed: set[str] = set()
        settled_at = None
        while time.monotonic() < start + settle_s:
            release_orphaned_placement_groups()
            if not _settled(job, others):
                settled_at = None
            elif settled_at is None:
                settled_at = time.monotonic()
            elif time.monotonic() - settled_at >= quiet_s:
                break
            if time.monotonic() > start + grace_s:
                stray = alive_actor_ids("TrainController", job, not_dead=True) - others - killed
                killed |= {_kill(actor_id) for actor_id in stray}
            time.sleep(0.5)


def _kill(actor_id: str) -> str:
    """Kill the actor `actor_id` (hex), for good. Private: Ray's public `ray.kill` takes a
    handle, and a Train controller has no name to get one by."""
    from ray._private.worker import global_worker

    global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
    return actor_id


def with_serve_version(deployment, version: str):
    """`deployment` with a fixed Serve code version.

    Serve compares a deployment's version to decide whether a redeploy must restart its
    replicas. `serve.run` gives every deployment without one a random version, so each
    `serve.run` of the same code restarts all replicas (client.py: `deployment._version or
    get_random_string()`), and `.options(version=...)` is refused outside Serve ("removed");
    only config files (`serve deploy`) get a stable one, hashed from the import path. relay
    swaps models by redeploying with a new user_config alone, which Serve applies in place when
    the version is unchanged — so the version is set here, through the `_internal` flag that
    Serve's own config path uses. No public API does this in Ray 2.60.
    """
    return deployment.options(version=version, _internal=True)


def torch_trainer(
    *,
    out_of_memory_ends: tuple[str, int] | None = None,
    placement_group_cleaner: bool = True,
    **kwargs: Any,
):
    """Ray Train's TorchTrainer over `kwargs`, with three changes that Ray 2.60 offers no public
    way to make (its trainer builds its controller's callbacks and failure policy itself; the
    subclass below replaces the two private methods that do it):

    - A run with no Ray Datasets starts no DatasetManager. Ray's DatasetsCallback creates that
      actor, one more Python process importing Ray Data (~1.3 s of CPU), for every worker group
      even when `datasets` is empty, beside the workers' own start-up on the same cores. relay's
      in-memory ingest hands the workers object references instead
      (relay/training/data/ingest.py); a run with Ray Data ingest keeps the callback as Ray has it.
    - Without `placement_group_cleaner` a run starts no PlacementGroupCleaner (relay's driver
      asks for none on a cluster relay started without Ray's dashboard:
      cluster.state_api_served). Ray's PlacementGroupCleanerCallback starts that detached actor
      for every run, to remove the worker group's placement group should the controller die;
      it learns of the death from the State API, which the dashboard serves. Without one every
      look fails (ServerUnavailable) and the cleaner looks again each second, forever: it can
      never clean, costs a process importing Ray Train (2.2-2.7 CPU-s a run on 2 cores,
      2026-12-07) that the worker group's start waits for, and outlives a controller that
      died. relay's driver releases what such a death orphans itself
      (`release_orphaned_placement_groups` after a failed fit(), `reclaiming_orphans` around a
      sweep).
    - With `out_of_memory_ends` (run id, ranks) a worker group that ran out of memory under
      `scaling.memory_per_worker` ends the run at once instead of restarting up to
      `failure.max_failures` times: the same model on the same ranks meets the same wall on
      every try. Any other failure (a killed worker, a lost node) restarts as before. Ray
      Train takes no failure policy from its users (FailureConfig holds only counts)."""
    return _relay_torch_trainer()(
        out_of_memory_ends=out_of_memory_ends,
        placement_group_cleaner=placement_group_cleaner,
        **kwargs,
    )


@functools.cache
def _relay_torch_trainer() -> type:
    """Made on first use, like the failure policy below: TorchTrainer's module is a Train
    import that only a run pays for."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    class RelayTorchTrainer(TorchTrainer):
        def __init__(
            self,
            *,
            out_of_memory_ends: tuple[str, int] | None,
            placement_group_cleaner: bool,
            **kwargs: Any,
        ):
            self._out_of_memory_ends = out_of_memory_ends
            self._placement_group_cleaner = placement_group_cleaner
            super().__init__(**kwargs)

        def _create_default_callbacks(self) -> list:
            dropped = () if self.datasets else (DatasetsCallback,)
            if not self._placement_group_cleaner:
                dropped += (PlacementGroupCleanerCallback,)
            return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]

        def _initialize_and_run_controller(self, **controller_kwargs: Any):
            if self._out_of_memory_ends is not None:
                run_id, ranks = self._out_of_memory_ends
                policy = _out_of_memory_ends_the_run()(
                    self.run_config.failure_config, run_id, ranks
                )
                controller_kwargs["failure_policy"] = policy
            return super()._initialize_and_run_controller(**controller_kwargs)

    return RelayTorchTrainer


def population_based_training(*, seed: int | None, **kwargs: Any):
    """Tune's PopulationBasedTraining over `kwargs`; with a `seed`, each of its decisions (which
    stronger trial a weak one copies, how each hyperparameter is perturbed or resampled) draws
    from generators seeded by (seed, the trial's place in the population, the PBT time of the
    decision). So the same sweep makes the same choice at the same point whatever order its
    trials' reports reach the driver in, and `relay tune --resume` makes the choices the
    interrupted sweep would have.

    Private: PBT takes no seed; it draws from Python's and NumPy's global generators
    (`random.choice` of the donor and of the perturbation factor, a Tune domain's `sample(None)`
    for a resample), all inside its `_checkpoint_or_exploit`, which the subclass wraps."""
    if seed is None:
        from ray.tune.schedulers import PopulationBasedTraining

        return PopulationBasedTraining(**kwargs)
    return _seeded_population_based_training()(seed=seed, **kwargs)


@contextmanager
def drawing_from(*key: int) -> Iterator[None]:
    """Python's and NumPy's global generators seeded from `key` inside the block; the state
    each had before is put back after it, so no other draw in the process changes."""
    import random

    import numpy as np

    saved = random.getstate(), np.random.get_state()
    random.seed("-".join(map(str, key)))
    np.random.seed(list(key))
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


@functools.cache
def _seeded_population_based_training() -> type:
    from ray.tune.schedulers import PopulationBasedTraining

    class SeededPopulationBasedTraining(PopulationBasedTraining):
        def __init__(self, *, seed: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._seed = seed
            self._place: dict[str, int] = {}  # trial id -> order of arrival (restored: the same)

        def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
            self._place.setdefault(trial.trial_id, len(self._place))
            super().on_trial_add(tune_controller, trial)

        def _checkpoint_or_exploit(self, trial: Any, *args: Any, **kwargs: Any) -> None:
            at = int(self._trial_state[trial].last_train_time)
            with drawing_from(self._seed, self._place[trial.trial_id], at):
                super()._checkpoint_or_exploit(trial, *args, **kwargs)

    return SeededPopulationBasedTraining


@functools.cache
def _out_of_memory_ends_the_run() -> type:
    """Ray's default failure policy, except for out-of-memory failures. Made on first use: its
    base class's module costs ~0.9 s to import, which only a run pays. (Made inside a function,
    the class travels to the controller by value, through Ray's cloudpickle.)"""
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    class OutOfMemoryEndsTheRun(DefaultFailurePolicy):
        def __init__(self, failure_config: Any, run_id: str, ranks: int) -> None:
            super().__init__(failure_config)
            self.run_id, self.ranks = run_id, ranks

        def make_decision(self, training_failed_error: Any) -> Any:
            from relay.runtime import worker_memory

            if isinstance(training_failed_error, WorkerGroupError) and (
                worker_memory.ranks_out_of_memory(self.run_id, self.ranks, training_failed_error)
            ):
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

    return OutOfMemoryEndsTheRun


class RunCheckpoints:
    """The checkpoints of a run trained in this process (a one-worker Tune trial in its own
    actor: relay/training/hosts.py), kept as a Ray Train controller keeps a run's: each copied
    to `<runs>/<run id>/<dir name>`, the best `num_to_keep` kept by the config's score, Train's
    snapshot written beside them. So `Result.from_path`, a resume (`latest`) and relay's
    records read such a run as any other. A run that has a snapshot continues from it.

    Private: Train's CheckpointManager and StorageContext are `_internal`. Ray 2.60's public
    way to train without a worker group (TorchTrainer's local mode, `num_workers=0`) keeps only
    the last checkpoint, in memory, and calls no callbacks."""

    def __init__(self, run_dir: Path, config) -> None:
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
            CheckpointManager,
        )
        from ray.train.v2._internal.execution.storage import StorageContext

        self._storage = StorageContext(
            storage_path=str(run_dir.parent), experiment_dir_name=run_dir.name
        )
        self._manager = CheckpointManager(checkpoint_config=config, storage_context=self._storage)
        # The manager wakes its waiters with asyncio tasks: one loop, for this run's reports.
        self._loop = asyncio.new_event_loop()

    def latest(self):
        """The run's latest checkpoint (a ray.train.Checkpoint), or None."""
        latest = self._manager.latest_checkpoint_result
        return latest.checkpoint if latest else None

    def add(self, directory: Path, dir_name: str, metrics: dict[str, Any]):
        """Copy the checkpoint at `directory` into the run as `dir_name`, register it with
        `metrics` (which may delete worse ones); returns the stored ray.train.Checkpoint."""
        from ray.train import Checkpoint
        from ray.train.v2._internal.execution.training_report import _TrainingReport

        stored = self._storage.persist_current_checkpoint(
            Checkpoint.from_directory(str(directory)), dir_name
        )
        report = _TrainingReport(checkpoint=stored, metrics=metrics, validation=False)

        async def register() -> None:
            self._manager.register_checkpoint(report)
            await asyncio.sleep(0)  # the manager's notify task

        self._loop.run_until_complete(register())
        return stored

    def result(self, metrics: dict[str, Any] | None, return_value: Any):
        """The run's ray.train.Result, as `fit()` returns it: the last reported `metrics` (None:
        its latest checkpoint's, as for a run resumed after its last epoch), the latest and best
        checkpoints, the loop's return value."""
        from ray.train import Result

        self._loop.close()
        result = Result._from_checkpoint_manager(
            checkpoint_manager=self._manager, storage_context=self._storage
        )
        if metrics is None:
            return dataclasses.replace(result, return_value=return_value)
        return dataclasses.replace(result, metrics=metrics, return_value=return_value)
