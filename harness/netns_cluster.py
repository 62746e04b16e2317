"""Real multi-host Ray on one machine: each "host" a Linux network namespace of its own.
For trying relay on many machines without them (the tests and bench/scaling.py use it too);
as root:

    .venv/bin/python harness/netns_cluster.py --hosts 2      # or: make cluster-demo

builds the cluster, prints its addresses and a `ray job submit` line to paste into another
shell, and removes everything on Ctrl-C or SIGTERM. From Python:

    with NetnsCluster(2, storage=shared_dir, host_resources={"worker_slot": 1}) as cluster:
        cluster.run(0, ["ray", "job", "submit", f"--address={cluster.dashboard_address}", ...])

The layout (all of it inside namespaces this module creates; nothing in the root namespace,
no route to anywhere else):

    netns <prefix>-net: bridge <prefix>br, ports <prefix>h0, <prefix>h1, ...
                             |                  |
    netns <prefix>-h0: eth0 10.213.X.1/24   netns <prefix>-h1: eth0 10.213.X.2/24  ...

`<prefix>` is `rly` + 6 hex digits, new for every cluster; X is drawn per cluster too. Each host
also has a host name of its own (`<prefix>-hK`, in a UTS namespace of each process started on
it) that resolves, through its own /etc/hosts (`ip netns exec` mounts /etc/netns/<ns>/hosts
there), to its own address, as a real machine's does: gloo binds to the address the host name
resolves to, so this is what makes it bind to eth0 and not to loopback. Each host runs its own
`ray start` (head on host 0, `--address=<head>` on the others): raylet, object store and temp
dir of its own, `--node-ip-address` its namespace address, a custom resource `hostK` and any
`host_resources`. Only the storage (RELAY_HOME) is shared, as NFS would be: all hosts see the
same filesystem.

Every `ray start` runs in a session of its own, so `stop()` (and `kill_host()`) end exactly the
processes of that host. `stop()` then deletes the namespaces (with them every veth and the
bridge) and the /etc/netns entries; it runs on any failure during start as well.
Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's `ip`; `netns_unavailable()` says why not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlencode

from relay.runtime.processes import stop_session

BIN = Path(sys.executable).parent  # the venv's ray, relay and python

NETNS_ETC = Path("/etc/netns")

# Ports every host uses. Each host has a network namespace, and so a port space, of its own,
# with nothing else in it: these are free by construction (a free port found in the root
# namespace would say nothing about another namespace). All below Ray's worker port range
# (10002-19999), as the Ray client server port must be.
GCS_PORT = 6379
DASHBOARD_PORT = 8265
NODE_PORTS = {
    "--ray-client-server-port": 10001,
    "--node-manager-port": 7001,
    "--object-manager-port": 7002,
    "--dashboard-agent-listen-port": 7003,
    "--dashboard-agent-grpc-port": 7004,
    "--metrics-export-port": 7005,
    "--runtime-env-agent-port": 7006,
}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`, not permitted), or None."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    probe = f"rly{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    index: int
    netns: str
    ip: str
    hostname: str
    temp_dir: Path
    leader: subprocess.Popen | None = None
    log: IO[str] | None = field(default=None, repr=False)

    def argv(self, command: list[str]) -> list[str]:
        """`command` as a process of this host: in its network namespace, under its host name."""
        return [
            "ip", "netns", "exec", self.netns,
            "unshare", "--uts", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh",
            self.hostname, *map(str, command),
        ]  # fmt: skip

    @property
    def log_path(self) -> Path:
        return self.temp_dir / "ray-start.log"


class NetnsCluster:
    """A Ray cluster of `hosts` network namespaces (see the module docstring).

    `storage`: the directory every host sees, RELAY_HOME of every Ray process.
    `cpus_per_host`: each host's `--num-cpus` (logical: the machine's cores are shared).
    `host_resources`: custom resources every host offers besides `hostK: 100`, e.g.
    `{"worker_slot": 1}` so that workers asking for one land one per host.
    `token_auth`: Ray 2.60's token authentication, one token for the whole cluster; every
    host's `ray start` and every client started by `run()` present it (`env`).
    """

    def __init__(
        self,
        hosts: int = 2,
        *,
        storage: Path,
        cpus_per_host: int = 2,
        host_resources: dict[str, float] | None = None,
        token_auth: bool = True,
        object_store_bytes: int = 200 * 1024**2,
        ready_timeout_s: float = 180,
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts: 1 to 250, got {hosts}")
        self.prefix = f"rly{secrets.token_hex(3)}"
        self.subnet = f"10.213.{random.randrange(256)}"
        self.storage = Path(storage).resolve()
        self.cpus_per_host = cpus_per_host
        self.host_resources = dict(host_resources or {})
        self.object_store_bytes = object_store_bytes
        self.ready_timeout_s = ready_timeout_s
        self.bridge_netns = f"{self.prefix}-net"
        # Short: Ray's socket paths (temp dir + session dir + sockets/...) must stay short.
        self.temp_root = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp"))
        self.hosts = [
            Host(
                index=k,
                netns=f"{self.prefix}-h{k}",
                ip=f"{self.subnet}.{k + 1}",
                hostname=f"{self.prefix}-h{k}",
                temp_dir=self.temp_root / f"h{k}",
            )
            for k in range(hosts)
        ]
        # Every process on a host: this venv first, no Ray settings of the caller's (every
        # client names the cluster explicitly), the shared storage, the cluster's token.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["RELAY_HOME"] = str(self.storage)
        # On SIGTERM `ray start --block` drains its node first (up to 30 s by default), for
        # Serve traffic on a node leaving a cluster that stays; stop() ends every host at once.
        self.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
        if token_auth:
            self.env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self._made_netns: list[str] = []
        self._made_etc: list[Path] = []
        self._made_netns_etc = False
        self.up_in_s: float | None = None

    # --- addresses ----------------------------------------------------------------------------

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def dashboard_address(self) -> str:
        """The job server and State API, on the head's namespace address (reachable only from
        inside the hosts' namespaces)."""
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    # --- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        began = time.monotonic()
        try:
            self._build_network()
            for host in self.hosts:
                self._start_ray(host)
                if host.index == 0:
                    # Workers that find no GCS yet retry, but a head that is up first keeps
                    # their logs free of connection errors.
                    self._wait_for(lambda: self._alive_node_count() >= 1, "the head node")
            self._wait_for(lambda: self._alive_node_count() == len(self.hosts), "all nodes")
            self._wait_for(self._job_server_answers, "the job server")
        except BaseException:
            self.stop()
            raise
        self.up_in_s = time.monotonic() - began

    def stop(self, keep_logs: bool = False) -> None:
        """End every process of every host (workers first), then delete what was made. Safe to
        call again, and after a partial start."""
        for host in reversed(self.hosts):
            if host.leader is not None:
                with contextlib.suppress(Exception):
                    stop_session(host.leader)
                host.leader = None
            if host.log is not None:
                host.log.close()
                host.log = None
        # Deleting a namespace deletes the interfaces in it: the veth pairs and the bridge.
        for name in reversed(self._made_netns):
            _ip("netns", "del", name, check=False)
        self._made_netns.clear()
        for directory in self._made_etc:
            shutil.rmtree(directory, ignore_errors=True)
        self._made_etc.clear()
        if self._made_netns_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()  # only if empty: another cluster's entries stay
            self._made_netns_etc = False
        if not keep_logs:
            shutil.rmtree(self.temp_root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (namespaces, /etc/netns entries, processes): empty
        after `stop()`."""
        listed = _ip("netns", "list", check=False).stdout.split()
        left = [f"netns {n}" for n in listed if n.startswith(self.prefix)]
        left += [f"file {p}" for p in NETNS_ETC.glob(f"{self.prefix}*")]
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and self.prefix in (entry / "cmdline").read_text():
                    left.append(f"process {entry.name}")
        return left

    # --- running things on a host -------------------------------------------------------------

    def run(
        self, host: int, command: list[str], *, timeout: float = 120, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run `command` on host `host` (its namespace and host name, the cluster's token)."""
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.hosts[host].argv(command), timeout=timeout, **kwargs)

    def ray_json(self, resource: str, *args: str, host: int = 0) -> list[dict]:
        """What `ray list RESOURCE ARGS --format=json` prints, asked of this cluster's State API
        from `host` through its REST endpoint: ARGS as `ray list` takes them (`--filter=K=V`
        or `--filter K!=V`, `--limit=N`, `--detail`). Without Ray in the asking process: the
        `ray list` command imports Ray, 1.5-3 s of CPU per call, and the tests poll while the
        cluster trains on the same cores."""
        query: dict[str, list[str]] = {"limit": ["100"], "detail": ["false"]}  # ray list's
        rest = iter(args)
        for arg in rest:
            flag, _, value = arg.partition("=")
            if flag == "--filter":
                key, op, wanted = _parse_filter(value or next(rest))
                query.setdefault("filter_keys", []).append(key)
                query.setdefault("filter_predicates", []).append(op)
                query.setdefault("filter_values", []).append(wanted)
            elif flag == "--limit":
                query["limit"] = [value or next(rest)]
            elif flag == "--detail":
                query["detail"] = ["true"]
            else:
                raise ValueError(f"ray_json: {arg!r} is not a `ray list` option it knows")
        url = f"{self.dashboard_address}/api/v0/{resource.replace('-', '_')}?" + urlencode(
            query, doseq=True
        )
        reply = json.loads(self._http_get(url, host))
        if not reply.get("result"):
            raise RuntimeError(f"ray list {resource} {' '.join(args)}: {reply.get('msg')}")
        return reply["data"]["result"]["result"]

    def _http_get(self, url: str, host: int = 0) -> str:
        """GET `url` from inside host `host`'s namespace, with the cluster's token if any."""
        out = self.run(host, [sys.executable, "-c", _HTTP_GET, url], timeout=90)
        if out.returncode != 0:
            raise RuntimeError(f"GET {url}: {out.stderr[-2000:]}")
        return out.stdout

    def submit_train(
        self, working_dir: Path, *train_args: str, wait: bool = True, timeout: float = 1800
    ) -> tuple[str, subprocess.CompletedProcess]:
        """`ray job submit --working-dir WORKING_DIR -- python jobs/train.py TRAIN_ARGS` from
        host 0 to the head's job server on its namespace address: (the job's submission id,
        the submit command's outcome). With `wait` it returns once the job has ended (its
        output in the outcome's stdout; `train_result` reads `--json`'s line), else once the
        job is submitted (`job_outcome` waits for it)."""
        submission_id = f"relay-train-{secrets.token_hex(4)}"
        submit = self.run(
            0,
            [
                BIN / "ray", "job", "submit", f"--address={self.dashboard_address}",
                f"--submission-id={submission_id}", "--working-dir", str(working_dir),
                *([] if wait else ["--no-wait"]), "--", "python", "jobs/train.py", *train_args,
            ],
            timeout=timeout,
        )  # fmt: skip
        return submission_id, submit

    @staticmethod
    def train_result(submit: subprocess.CompletedProcess) -> dict:
        """What `relay train --json` printed last in a job submitted with `wait`."""
        line = next(x for x in reversed(submit.stdout.splitlines()) if x.startswith('{"run_id"'))
        return json.loads(line)

    def job_status(self, submission_id: str) -> str:
        (job,) = self.ray_json("jobs", f"--filter=submission_id={submission_id}")
        return job["status"]

    def job_outcome(self, submission_id: str, timeout_s: float = 300) -> str:
        """The job's final status (SUCCEEDED, FAILED or STOPPED) once it has one; raises
        TimeoutError if it is still pending or running after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (status := self.job_status(submission_id)) in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(2)
        raise TimeoutError(f"job {submission_id} still running after {timeout_s:.0f} s")

    def job_logs(self, submission_id: str) -> str:
        return self.run(
            0, [BIN / "ray", "job", "logs", f"--address={self.dashboard_address}", submission_id]
        ).stdout

    def node_ips(self) -> dict[str, str]:
        """node_id → node IP of every node that ever joined."""
        return {n["node_id"]: n["node_ip"] for n in self.ray_json("nodes", "--limit=1000")}

    def kill_host(self, host: int, sig: signal.Signals = signal.SIGKILL) -> None:
        """A host lost: every process of its `ray start` session gets `sig` at once."""
        target = self.hosts[host]
        stop_session(target.leader, signals=((sig, 15),))
        target.leader = None

    def restart_host(self, host: int) -> None:
        """Start host `host`'s `ray start` again (after `kill_host`): a new node joins in the
        lost one's place, at the same address; returns once it is alive."""
        target = self.hosts[host]
        if target.log is not None:
            target.log.close()
            target.log = None
        self._start_ray(target)
        self._wait_for(
            lambda: self._alive_node_count() == len(self.hosts), f"host {host} to rejoin"
        )

    def link_bytes(self, host: int) -> int:
        """Bytes received + sent on the host's eth0 so far (its only way to the other hosts)."""
        (link,) = json.loads(
            _ip("-s", "-j", "-n", self.hosts[host].netns, "link", "show", "eth0").stdout
        )
        return link["stats64"]["rx"]["bytes"] + link["stats64"]["tx"]["bytes"]

    def describe(self) -> str:
        lines = [f"network: {self.subnet}.0/24 on bridge {self.prefix}br in netns "
                 f"{self.bridge_netns}"]  # fmt: skip
        for host in self.hosts:
            role = "head" if host.index == 0 else "worker"
            lines.append(
                f"  host {host.index} ({role}): netns {host.netns}, {host.ip}, "
                f"hostname {host.hostname}, temp dir {host.temp_dir}"
            )
        lines.append(f"GCS {self.gcs_address}, dashboard/jobs {self.dashboard_address}")
        lines.append(f"storage (RELAY_HOME): {self.storage}")
        return "\n".join(lines)

    # --- internals ----------------------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made_netns.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build_network(self) -> None:
        bridge = f"{self.prefix}br"
        self._add_netns(self.bridge_netns)
        _ip("-n", self.bridge_netns, "link", "add", bridge, "type", "bridge")
        _ip("-n", self.bridge_netns, "link", "set", bridge, "up")
        with contextlib.suppress(FileExistsError):
            NETNS_ETC.mkdir()
            self._made_netns_etc = True
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.ip} {h.hostname}\n" for h in self.hosts)
        for host in self.hosts:
            self._add_netns(host.netns)
            port = f"{self.prefix}h{host.index}"  # in the bridge's namespace
            # Both ends made where they live: neither is ever in the root namespace.
            _ip("-n", self.bridge_netns, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", host.netns)  # fmt: skip
            _ip("-n", self.bridge_netns, "link", "set", port, "master", bridge)
            _ip("-n", self.bridge_netns, "link", "set", port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True)  # parents: another cluster may remove an empty /etc/netns
            self._made_etc.append(etc)
            (etc / "hosts").write_text(hosts_file)

    def _start_ray(self, host: Host) -> None:
        host.temp_dir.mkdir(parents=True, exist_ok=True)  # a restarted host keeps its dir
        resources = {f"host{host.index}": 100, **self.host_resources}
        command = [
            BIN / "ray", "start", "--block", "--disable-usage-stats",
            f"--num-cpus={self.cpus_per_host}", f"--resources={json.dumps(resources)}",
            f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={host.temp_dir}", f"--node-ip-address={host.ip}",
            *(f"{flag}={port}" for flag, port in NODE_PORTS.items()),
        ]  # fmt: skip
        if host.index == 0:
            command += [
                "--head", f"--port={GCS_PORT}",
                f"--dashboard-host={host.ip}", f"--dashboard-port={DASHBOARD_PORT}",
            ]  # fmt: skip
        else:
            command += [f"--address={self.gcs_address}"]
        host.log = open(host.log_path, "a")  # noqa: SIM115 - closed by stop()
        host.leader = subprocess.Popen(
            host.argv(command),
            env=self.env,
            stdout=host.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # stop()/kill_host() end this session's processes only
        )

    def _alive_node_count(self) -> int:
        try:
            return len(self.ray_json("nodes", "--filter=state=ALIVE"))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            return 0

    def _job_server_answers(self) -> bool:
        try:
            self._http_get(f"{self.dashboard_address}/api/jobs/")
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return True

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready():
            for host in self.hosts:
                if host.leader is not None and host.leader.poll() is not None:
                    raise RuntimeError(
                        f"`ray start` on host {host.index} exited ({host.leader.returncode}) "
                        f"while waiting for {what}:\n{host.log_path.read_text()[-3000:]}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not up after {self.ready_timeout_s:.0f} s")
            time.sleep(1)


# A GET from inside a namespace, in a Python without Ray (the State API and job server answer
# HTTP; Ray's own clients import Ray). Prints the body; fails on a non-2xx status.
_HTTP_GET = """
import os, sys, urllib.request
request = urllib.request.Request(sys.argv[1])
if os.environ.get("RAY_AUTH_TOKEN"):
    request.add_header("Authorization", "Bearer " + os.environ["RAY_AUTH_TOKEN"])
with urllib.request.urlopen(request, timeout=60) as response:
    sys.stdout.write(response.read().decode())
"""


def _parse_filter(text: str) -> tuple[str, str, str]:
    """`KEY=VALUE` or `KEY!=VALUE` (as `ray list --filter` takes it) → (key, predicate, value)."""
    key, op, value = text.partition("!=") if "!=" in text else text.partition("=")
    if not op:
        raise ValueError(f"ray_json: filter {text!r} is not KEY=VALUE or KEY!=VALUE")
    return key.strip(), op, value.strip()


# --- the recipe: python harness/netns_cluster.py --------------------------------------------------


def client_auth_env(cluster: NetnsCluster) -> str:
    """The `VAR=value ` words a client shell needs for `cluster`'s token, naming a file that
    holds it and never the token itself: the printed lines end up in terminal scrollback, logs
    and CI output, where a token would let anyone who reads them run code on the cluster. The
    file (0600, in the cluster's own 0700 temp dir) goes with the cluster in `stop()`. A client
    needs the mode as well: with a token alone it stays in Ray's default mode (disabled)."""
    token = cluster.env.get("RAY_AUTH_TOKEN")
    if token is None:
        return ""
    path = cluster.temp_root / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token)
    return f"RAY_AUTH_MODE={cluster.env['RAY_AUTH_MODE']} RAY_AUTH_TOKEN_PATH={path} "


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # the same cleanup as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="hosts (namespaces), 1-8")
    parser.add_argument("--cpus", type=int, default=2, help="--num-cpus of each host")
    parser.add_argument(
        "--storage", type=Path, help="RELAY_HOME every host shares (default: a new temp dir)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.hosts <= 8:
        parser.error("--hosts: 1 to 8")
    if reason := netns_unavailable():
        print(f"cannot build the cluster: {reason}", file=sys.stderr)
        return 1
    storage = args.storage or Path(tempfile.mkdtemp(prefix="relay-netns-home-"))
    storage.mkdir(parents=True, exist_ok=True)
    # Ctrl-C stops the cluster even when started from a shell that made it ignore SIGINT
    # (a background job `... &` of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    signal.signal(signal.SIGHUP, _stop_on_sigterm)

    cluster = NetnsCluster(
        args.hosts, storage=storage, cpus_per_host=args.cpus, host_resources={"worker_slot": 1}
    )
    names = [cluster.bridge_netns, *(h.netns for h in cluster.hosts)]
    print(f"building {args.hosts} hosts; if this script is SIGKILLed, clean up with:")
    cleanup = (
        f"for ns in {' '.join(names)}; do ip netns pids $ns | xargs -r kill -9; "
        f"ip netns del $ns; done; rm -rf /etc/netns/{cluster.prefix}-* {cluster.temp_root}"
    )
    print(f"  {cleanup}")
    try:
        cluster.start()
        head = cluster.head
        env = client_auth_env(cluster)
        submit = (
            f"ip netns exec {head.netns} env {env}{BIN / 'ray'} job submit "
            f"--address={cluster.dashboard_address} --working-dir . -- "
            f"python jobs/train.py jobs/configs/digits.yaml --set size=debug --set epochs=2 "
            f"--set storage={cluster.storage} --set scaling.num_workers={len(cluster.hosts)} "
            f"--set {shlex.quote('scaling.resources_per_worker={CPU: 1, worker_slot: 1}')}"
        )
        status = (
            f"ip netns exec {head.netns} env {env}{BIN / 'ray'} list nodes "
            f"--address={cluster.dashboard_address}"
        )
        print(f"\ncluster up in {cluster.up_in_s:.1f} s\n{cluster.describe()}")
        print(f"\nhead address (ray start --address): {cluster.gcs_address}")
        print(f"\nits nodes (from the repo root, in another shell):\n  {status}")
        print(f"\na job with one worker per host (from a relay checkout):\n  {submit}")
        print("\nCtrl-C ends the cluster and removes the namespaces.", flush=True)
        while True:
            for host in cluster.hosts:
                if host.leader is not None and host.leader.poll() is not None:
                    print(f"`ray start` on host {host.index} exited; stopping", file=sys.stderr)
                    return 1
            time.sleep(2)
    except KeyboardInterrupt:
        print("\nstopping the cluster ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        left = cluster.leftovers()
        print("removed everything" if not left else f"left behind: {left}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
