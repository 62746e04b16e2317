"""Getting onto a Ray cluster: the one the caller already joined, the one `RAY_ADDRESS` (or
`ray job submit`) names, or else an embedded local cluster started in this process
(`RAY_ADDRESS=local` insists on that even when a `ray start` cluster runs on this machine)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import ray

from relay.runtime import ray_private

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

# Ray's raylet starts Python workers for the first driver that connects (2 here), so that its
# first tasks find them warm (RAY_prestart_worker_first_driver). They serve only work of the
# driver's own runtime env, and a run's controller, its tasks and its workers each run under
# one of their own (see in_train_env): in `relay train` runs both stayed idle to the end, after
# importing Ray (0.6-0.7 CPU-s each) on the cores the run's own processes were starting on.
# Off for a cluster started here (its raylet reads this environment); measured on 2 cores
# (2026-12-07): 2 fewer processes and ~1.3 CPU-s less per `relay train`.
PRESTART_SWITCH = {"RAY_prestart_worker_first_driver": "0"}

# Ray's log monitor (one process per node) tails the workers' log files for drivers that print
# them (`log_to_driver`, relay's --verbose) and, while a node has fewer than 1,000 of them, globs
# the log directory for new ones every 0.1 s (ray/_private/log_monitor.py). With the threshold
# at 0 it looks for new files every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S) and still reads the files
# it has every 0.1 s: a new worker's first lines reach a --verbose console up to 0.5 s later.
# Measured on 2 cores (2026-12-08, 3 alternated runs of 2 digits runs then 30 s idle): the log
# monitor's CPU fell from 0.33 + 0.36 s to 0.15 + 0.17 s. Read by the log monitor a cluster
# started here runs (it inherits this environment).
LOG_MONITOR_SWITCH = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


# What a relay run does not use, switched off (`connect` sets each unless the environment
# already does: a user's own value wins). Each costs start-up or background CPU on every
# Train run; none is what fault tolerance rests on — health checks, failure handling and the
# worker group's restart, checkpoint bookkeeping stay as Ray has them (the placement-group
# cleaner too, where a dashboard lets it work: ray_private.torch_trainer). Read from Ray 2.60's
# source (ray/train/v2/_internal/...); what each costs is measured by bench/startup.py.
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


# A cluster relay starts (`relay train/tune/serve` without RAY_ADDRESS) lives as long as that
# command, and relay keeps its own records, report pages and doctor. Ray's dashboard would add
# about ten Python processes, still starting while the first epochs train: on a 2-core machine
# `ray.init`, one task and 2 s idle cost 8.2 CPU-s with it and 6.2 without, and 3 alternated
# pairs of 8-epoch digits runs (2 workers) reached the end of epoch 1 in a median 15.4 s
# without it against 17.5 s with it (steady throughput differed by less than its run-to-run
# spread). So it is off there unless RELAY_RAY_DASHBOARD=1; a `ray start --head` cluster
# (docs/clusters.md) keeps its own. Without it Ray's state API (`ray list`, ray.util.state) has
# nothing to ask, and Ray sends no usage report (its dashboard sends it).
DASHBOARD_ENV = "RELAY_RAY_DASHBOARD"

# Set (to "1") in the environment of a cluster started here without the dashboard, which its
# raylet hands to every process of it: there Ray's State API (`ray list`, ray.util.state),
# which the dashboard serves, answers nobody (Ray still runs a dashboard process for its usage
# report, so its address alone does not say). Read by `state_api_served`.
NO_STATE_API_ENV = "RELAY_CLUSTER_WITHOUT_STATE_API"

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


def state_api_served() -> bool:
    """Whether Ray's State API may answer on the cluster this process is on: not on one relay
    started without the dashboard (NO_STATE_API_ENV, set there for every process of it); on any
    other, as its own `ray start` chose (a `ray start --head` runs the dashboard by default)."""
    return os.environ.get(NO_STATE_API_ENV) != "1"


def set_missing(env: dict[str, str]) -> dict[str, str]:
    """Set each variable of `env` the environment lacks (a user's own value wins); returns
    those set here."""
    applied = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


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

    env = ray_private.train_controller_env()
    remote = ray.remote(num_cpus=0, runtime_env={"env_vars": env})(call)
    ok, value = ray.get(remote.remote())
    if not ok:
        raise value
    return value


def _local_runtime_env() -> dict:
    # Workers of an embedded cluster import user tasks ("module:Class") from where the user is,
    # as the driver does. On a remote cluster `ray job submit --working-dir` plays this role.
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}


def connect(
    *, verbose: bool = False, num_cpus: int | None = None, dashboard: bool | None = None
) -> None:
    """Join or start a cluster; quiet unless `verbose` (worker logs stay in Ray's log files).
    A cluster started here runs Ray's dashboard only when asked (`dashboard`, else
    RELAY_RAY_DASHBOARD=1; see DASHBOARD_ENV). Serve's settings for a cluster started here are
    relay/serving/ingress.py's business (set in the environment before this call)."""
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
        set_missing(PRESTART_SWITCH | LOG_MONITOR_SWITCH)
        options["runtime_env"] = _local_runtime_env()
        options["num_cpus"] = num_cpus
        if dashboard is None:
            dashboard = os.environ.get(DASHBOARD_ENV) == "1"
        options["include_dashboard"] = dashboard
        if dashboard:
            os.environ.pop(NO_STATE_API_ENV, None)
        else:
            os.environ[NO_STATE_API_ENV] = "1"
    elif switches:
        # An existing cluster's processes do not inherit this environment: the switches go
        # in the job's runtime_env, which Ray merges with a `ray job submit` one (only keys
        # this process lacked, so none that job sets: no conflict).
        options["runtime_env"] = {"env_vars": switches}
    ray.init(**options)
