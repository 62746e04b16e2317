"""The cluster relay starts for one command (`relay train/tune/serve` without RAY_ADDRESS) runs
no Ray dashboard unless asked: its dozen processes would start while the first epochs train
(relay/runtime/cluster.py, DASHBOARD_ENV). RELAY_RAY_DASHBOARD=1 brings it back. Nor workers
started before there is work for them (PRESTART_SWITCH), and its log monitor globs for new log
files 5 times less often (LOG_MONITOR_SWITCH)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from support import REPO, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROBE = textwrap.dedent(
    """
    import json
    import time

    import ray
    import psutil  # Ray's own copy (ray/thirdparty_files, on sys.path once ray is imported)
    from relay.runtime import cluster

    cluster.connect(num_cpus=2)
    time.sleep(1)  # Ray starts the workers it prestarts as the driver connects
    # The dashboard's modules run as processes named ray-dashboard-<Module>, under the head
    # processes this driver started; idle workers are named ray::IDLE.
    ours = [p.cmdline()[:1] for p in psutil.Process().children(recursive=True)]
    modules = [c for c in ours if c and "ray-dashboard-" in c[0]]
    idle = [c for c in ours if c and c[0].startswith("ray::IDLE")]
    # Ray's log monitor, as the node runs it: how often it globs for new log files.
    (monitor,) = [
        p for p in psutil.Process().children(recursive=True)
        if any("log_monitor.py" in part for part in p.cmdline())
    ]
    threshold = monitor.environ().get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD")
    url = ray._private.worker.get_dashboard_url()
    trained = ray.get(ray.remote(num_cpus=1)(lambda: "ran").remote())  # the cluster works
    print(json.dumps({"url": url, "modules": len(modules), "idle": len(idle), "task": trained,
                      "log_monitor_threshold": threshold}))
    """
)


@pytest.mark.parametrize(("asked", "dashboard"), [(None, False), ("1", True)])
def test_a_cluster_relay_starts_runs_the_dashboard_only_when_asked(asked, dashboard):
    env = subprocess_env()
    env.pop("RELAY_RAY_DASHBOARD", None)
    if asked is not None:
        env["RELAY_RAY_DASHBOARD"] = asked
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["task"] == "ran"
    # No worker started before there was work for it (cluster.PRESTART_SWITCH): with Ray's
    # default, 2 prestarted ones idle here.
    assert seen["idle"] == 0, seen
    # Its log monitor looks for new log files every 0.5 s, not every 0.1 s
    # (cluster.LOG_MONITOR_SWITCH).
    assert seen["log_monitor_threshold"] == "0", seen
    if dashboard:
        assert seen["url"] and seen["modules"] > 0, seen
    else:
        assert not seen["url"] and seen["modules"] == 0, seen
