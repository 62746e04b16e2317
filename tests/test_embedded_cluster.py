"""The cluster relay starts for one command (`relay train/tune/serve` without RAY_ADDRESS) runs
no Ray dashboard unless asked: its dozen processes would start while the first epochs train
(relay/runtime/cluster.py, DASHBOARD_ENV). RELAY_RAY_DASHBOARD=1 brings it back."""

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

    import ray
    import psutil  # Ray's own copy (ray/thirdparty_files, on sys.path once ray is imported)
    from relay.runtime import cluster

    cluster.connect(num_cpus=1)
    # The dashboard's modules run as processes named ray-dashboard-<Module>, under the head
    # processes this driver started.
    ours = psutil.Process().children(recursive=True)
    modules = [p for p in ours if p.cmdline()[:1] and "ray-dashboard-" in p.cmdline()[0]]
    url = ray._private.worker.get_dashboard_url()
    trained = ray.get(ray.remote(num_cpus=1)(lambda: "ran").remote())  # the cluster works
    print(json.dumps({"url": url, "modules": len(modules), "task": trained}))
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
    if dashboard:
        assert seen["url"] and seen["modules"] > 0, seen
    else:
        assert not seen["url"] and seen["modules"] == 0, seen
