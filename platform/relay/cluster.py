"""Getting onto a Ray cluster: the one the caller already joined, the one `RAY_ADDRESS` (or
`ray job submit`) names, or else an embedded local cluster started in this process
(`RAY_ADDRESS=local` insists on that even when a `ray start` cluster runs on this machine)."""

from __future__ import annotations

import logging
import os

import ray

# Ray Train's controller polls workers this often and each `ray.train.report` waits for the poll;
# at Ray's default (2 s) short epochs would spend most of their time waiting. The driver's value
# is propagated to the controller by Ray Train itself.
REPORT_POLL_INTERVAL_S = "0.1"


def _local_runtime_env() -> dict:
    # Workers of an embedded cluster import user tasks ("module:Class") from where the user is,
    # as the driver does. On a remote cluster `ray job submit --working-dir` plays this role.
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}


def connect(
    *, verbose: bool = False, num_cpus: int | None = None, direct_ingress: bool = False
) -> None:
    """Join or start a cluster; quiet unless `verbose` (worker logs stay in Ray's log files).

    `direct_ingress`: Serve's ingress replicas also serve HTTP themselves, on ports 30000+
    (serve/app.py says when that pays). Serve reads the flag from its processes' environment,
    which they inherit from the cluster, so it only takes effect on a cluster started here.
    """
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", REPORT_POLL_INTERVAL_S)
    if direct_ingress:
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    if ray.is_initialized():
        return
    options: dict = {
        "log_to_driver": verbose,
        "logging_level": logging.INFO if verbose else logging.ERROR,
    }
    if os.environ.get("RAY_ADDRESS", "local") == "local":
        options["runtime_env"] = _local_runtime_env()
        options["num_cpus"] = num_cpus
    ray.init(**options)
