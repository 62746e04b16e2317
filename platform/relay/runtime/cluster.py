"""Getting onto a Ray cluster: the one the caller already joined, the one `RAY_ADDRESS` (or
`ray job submit`) names, or else an embedded local cluster started in this process
(`RAY_ADDRESS=local` insists on that even when a `ray start` cluster runs on this machine)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import ray

from relay.runtime import background

T = TypeVar("T")

# Ray Train's controller polls workers this often and each `ray.train.report` waits for the poll;
# at Ray's default (2 s) short epochs would spend most of their time waiting. The driver's value
# is propagated to the controller by Ray Train itself.
REPORT_POLL_INTERVAL_S = "0.1"

# Ray lowers every worker process it starts to niceness 15 (RAY_worker_niceness) so that its
# daemons win any contest for a core. Train workers are such processes: on a node whose cores
# the workers fill, each wake-up of raylet, the GCS, the dashboard, the driver (or any other
# program) then preempts a training worker at once, and a data-parallel step waits for its
# slowest rank. At 0 the workers share cores with the daemons on equal terms, like any program.
# Read by each worker process at start-up from the environment the raylet hands down, so it
# takes effect on a cluster started here; a `ray start` cluster sets it in its own environment.
WORKER_NICENESS = "0"


# What a relay run does not use, switched off (`connect` sets each unless the environment
# already does: a user's own value wins). Each costs start-up or background CPU on every
# Train run; none is what fault tolerance rests on — health checks, failure handling and the
# worker group's restart, checkpoint bookkeeping, the placement-group cleaner stay as Ray has
# them. Read from Ray 2.60's source (ray/train/v2/_internal/...); what each costs is measured by
# bench/startup.py.
RUN_SWITCHES = {
    # PreemptionCallback (callbacks/preemption_callback.py) starts a PreemptionWatcher actor —
    # one more process — for every worker group, polling the GCS for draining nodes every 5 s,
    # so that a loop calling `ray.train.get_preemption_info()` can checkpoint early. relay's loop
    # does not; a worker killed by a preemption is still charged to the preemption budget, not
    # `max_failures` (failure_handling/default.py), and restarted from the last checkpoint.
    # Read by the controller.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Controller and worker metrics callbacks (callbacks/metrics.py): Prometheus gauges for
    # the Ray dashboard's Train graphs. relay records its own. Read by the caller of fit().
    "RAY_TRAIN_METRICS_ENABLED": "0",
    # JSON log files per controller and worker under the session's logs/train/
    # (logging/logging.py), for the dashboard's Train log view; Ray's own worker logs stay.
    # Read by the controller / the workers.
    "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING": "0",
    "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0",
    # Goes with the line above: Train turns `print` on its workers into a root-logger INFO
    # record (logging/patch_print.py), which only the structured logging's root handler shows;
    # without both, a task's print() would vanish. Off, print() writes to the worker's stdout
    # as in plain Python (Ray's worker log; the console with `verbose`). Read by the workers.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    # Train's WorkingDirectorySetupCallback (callbacks/working_dir_setup.py) creates a working
    # directory per run and moves every worker into it; Tune moves each trial actor into its
    # trial directory (tune/trainable/trainable.py). relay's paths are absolute. Read by the
    # caller of fit() (a Tune trial actor in a sweep) and by Tune.
    "RAY_CHDIR_TO_TRIAL_DIR": "0",
}
# Where they must be: Ray Train itself hands the PREEMPTION_WATCHER, *_STRUCTURED_LOGGING and
# PRINT_PATCH switches from the caller of fit() to the controller and workers
# (ENV_VARS_TO_PROPAGATE); METRICS_ENABLED and CHDIR_TO_TRIAL_DIR are read where fit() or Tune
# runs. A sweep's trial actors call fit(), so every switch must be in the environment of the
# cluster's worker processes: inherited from this process by a cluster started here, through
# the job's runtime_env otherwise (connect passes them).


# Reports to third parties, off in every process relay starts (set like RUN_SWITCHES: a user's
# own value wins). Ray's usage stats are sent by the head's dashboard of a cluster started here,
# which reads this at its start (ray/_common/usage/usage_lib.py); Ray 2.60's ray.init() sets it
# too, except for nightly wheels (_private/worker.py), so relay says so itself rather than lean
# on that. An existing cluster's are its own `ray start`'s choice. MLflow's telemetry is decided
# when a process imports mlflow (mlflow/telemetry/utils.py): the driver, and the controllers and
# trials that log to MLflow.
TELEMETRY_OFF = {"RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}


# How long one start of a worker group waits for its placement group, read by the Train
# controller, which Ray hands it from the caller of fit() (ENV_VARS_TO_PROPAGATE). A start that
# waits longer fails as a controller failure, retried up to FailureConfig's
# `controller_failure_limit` (relay's `failure.start_failures`; Ray's default is unlimited, so
# a run whose workers can never be placed, e.g. behind a node the GCS wrongly declared dead,
# would retry every minute without end). Ray fails at once a request the cluster could never
# hold (InsufficientClusterResourcesError).
WORKER_WAIT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
RUN_WORKER_WAIT_S = 60.0  # Ray 2.60's default (DEFAULT_WORKER_GROUP_START_TIMEOUT_S)
# A sweep's trial may wait for workers as long as another trial trains (`SweepConfig.overlap`
# starts trials the free resources cannot hold yet).
TRIAL_WORKER_WAIT_S = str(24 * 3600)


def let_trial_wait_for_workers() -> None:
    """Called in a Tune trial actor before fit(): its worker group waits for resources."""
    os.environ.setdefault(WORKER_WAIT_ENV, TRIAL_WORKER_WAIT_S)


@contextmanager
def worker_wait(wait_s: float | None) -> Iterator[float]:
    """For the fit() called inside: each worker-group start waits `wait_s` for placement
    (None: what this process has, a sweep trial's or the user's own, else Ray's default).
    Yields the wait in force; the environment is restored after, so one run's value never
    carries into the next run of this process."""
    before = os.environ.get(WORKER_WAIT_ENV)
    if wait_s is not None:
        os.environ[WORKER_WAIT_ENV] = str(wait_s)
    try:
        yield float(os.environ.get(WORKER_WAIT_ENV, RUN_WORKER_WAIT_S))
    finally:
        if before is None:
            os.environ.pop(WORKER_WAIT_ENV, None)
        else:
            os.environ[WORKER_WAIT_ENV] = before


@contextmanager
def run_ends_with_fit() -> Iterator[None]:
    """For the fit() called inside: its run's controller actor ends when fit() returns.

    fit() on the main thread installs a SIGINT handler (Ctrl-C aborts the run) and leaves it
    there; the handler holds the run's controller handle, so the controller — a process —
    lived on after the run, until the next main-thread fit() replaced the handler (Ray 2.60,
    DataParallelTrainer._register_sigint_handler). A sweep started after a run then waited its
    whole settle time for that controller. Putting back the handler that was there drops it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # Ray installs no handler off the main thread (Tune's trials)
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if before is not None:  # None: a handler not installed from Python, left as it is
            signal.signal(signal.SIGINT, before)


def gave_up_placing_workers(exc: BaseException) -> bool:
    """Whether a failed fit() ended because its worker group could not be placed in time, as
    many times as the run allows. Private: the public ControllerError wraps Train's
    WorkerGroupStartupTimeoutError, which only ray.train.v2._internal.exceptions defines."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return isinstance(getattr(exc, "controller_failure", None), WorkerGroupStartupTimeoutError)


def set_missing(env: dict[str, str]) -> dict[str, str]:
    """Set each variable of `env` the environment lacks (a user's own value wins); returns
    those set here."""
    applied = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def _train_controller_env() -> dict[str, str]:
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


def in_train_env(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a task (of no CPU) under the runtime env of the Train run fit() would
    start now; a ValueError or OSError it raises (a config's or a file's fault, whose message
    names it) is raised here as it was, not wrapped in Ray's task error.

    Why: Ray reuses a worker process only for tasks of the same runtime env, and an actor or
    task given a runtime_env never shares the job's, even with the same variables. A run's
    controller always gets one (the env vars above), and with it its DatasetManager, its
    SplitCoordinators and every Ray Data task they start. Ray Data work done by the driver
    before the run (the survey of files) therefore warmed processes the run could not use:
    each of its read tasks started a process and imported anew, 16-18 s before the first
    epoch's first batch here instead of 2-3.5 s. Run under this env, it warms the run's own.
    """

    def call() -> tuple[bool, Any]:
        try:
            return True, fn(*args)
        except (ValueError, OSError) as exc:
            return False, exc

    remote = ray.remote(num_cpus=0, runtime_env={"env_vars": _train_controller_env()})(call)
    ok, value = ray.get(remote.remote())
    if not ok:
        raise value
    return value


def _local_runtime_env() -> dict:
    # Workers of an embedded cluster import user tasks ("module:Class") from where the user is,
    # as the driver does. On a remote cluster `ray job submit --working-dir` plays this role.
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}


def connect(*, verbose: bool = False, num_cpus: int | None = None) -> None:
    """Join or start a cluster; quiet unless `verbose` (worker logs stay in Ray's log files).
    Serve's settings for a cluster started here are relay/serving/ingress.py's business (set in
    the environment before this call)."""
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", REPORT_POLL_INTERVAL_S)
    switches = set_missing(RUN_SWITCHES) | set_missing(TELEMETRY_OFF)
    if ray.is_initialized():
        return
    options: dict = {
        "log_to_driver": verbose,
        "logging_level": logging.INFO if verbose else logging.ERROR,
    }
    if os.environ.get("RAY_ADDRESS", "local") == "local":
        os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)
        options["runtime_env"] = _local_runtime_env()
        options["num_cpus"] = num_cpus
    elif switches:
        # An existing cluster's processes do not inherit this environment: the switches go
        # in the job's runtime_env, which Ray merges with a `ray job submit` one (only keys
        # this process lacked, so none that job sets: no conflict).
        options["runtime_env"] = {"env_vars": switches}
    ray.init(**options)


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
    actors live.

    PENDING groups count: a dead trial's pending group would be created (and hold its
    CPUs) as soon as the ending trials free them. Only this job's are waited for; another
    job's on a shared cluster are none of its doing.
    """
    if any(
        _made_by_actor(pg) and _live(pg) and pg.creator_job_id == job.binary()
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
def reclaiming_orphans(interval_s: float = 2.0, settle_s: float = 60.0) -> Iterator[None]:
    """Release orphaned placement groups every `interval_s` while the block runs, and at its
    end until this job has no Train controller alive but those alive before the block, and no
    group made by an actor left (at most `settle_s`).

    The wait at the end matters: Tune returns once it has stopped its trial actors, but a
    stopped trial's controller dies only when Ray propagates its owner's death. Until then
    its group is no orphan yet, and a controller still alive may even request a new group
    (a sweep's CI run was left with a PENDING one after a 10 s wait for groups alone).
    """
    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    # Controllers alive before the block are another run's of this process, not the block's.
    others = alive_actor_ids("TrainController", job, not_dead=True)
    try:
        with background.every(interval_s, release_orphaned_placement_groups, "relay-pg-reclaim"):
            yield
    finally:
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            release_orphaned_placement_groups()
            if _settled(job, others):
                break
            time.sleep(0.5)


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


def torch_trainer(*, out_of_memory_ends: tuple[str, int] | None = None, **kwargs: Any):
    """Ray Train's TorchTrainer over `kwargs`, with two changes that Ray 2.60 offers no public
    way to make (its trainer builds its controller's callbacks and failure policy itself; the
    subclass below replaces the two private methods that do it):

    - A run with no Ray Datasets starts no DatasetManager. Ray's DatasetsCallback creates that
      actor, one more Python process importing Ray Data (~1.3 s of CPU), for every worker group
      even when `datasets` is empty, beside the workers' own start-up on the same cores. relay's
      in-memory ingest hands the workers object references instead (relay/training/ingest.py); a run
      with Ray Data ingest keeps the callback as Ray has it.
    - With `out_of_memory_ends` (run id, ranks) a worker group that ran out of memory under
      `scaling.memory_per_worker` ends the run at once instead of restarting up to
      `failure.max_failures` times: the same model on the same ranks meets the same wall on
      every try. Any other failure (a killed worker, a lost node) restarts as before. Ray
      Train takes no failure policy from its users (FailureConfig holds only counts)."""
    return _relay_torch_trainer()(out_of_memory_ends=out_of_memory_ends, **kwargs)


@functools.cache
def _relay_torch_trainer() -> type:
    """Made on first use, like the failure policy below: TorchTrainer's module is a Train
    import that only a run pays for."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    class RelayTorchTrainer(TorchTrainer):
        def __init__(self, *, out_of_memory_ends: tuple[str, int] | None, **kwargs: Any):
            self._out_of_memory_ends = out_of_memory_ends
            super().__init__(**kwargs)

        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

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
