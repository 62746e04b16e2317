"""`relay.serve(...)`: what `relay serve` does, from Python, without blocking: the models served
over HTTP by relay's app on the connected Ray cluster (or one started here, behind HAProxy as the
CLI's), returned as a `Served` handle once every model answers; `stop()` takes it down again.

The checks come first, as the CLI's do: the options are AppArgs' fields (serving/args.py), a bad
one raises ConfigError naming it before anything of Ray is imported, and an unknown or untrusted
model raises before a cluster starts. Unlike `relay serve`, nothing is written for `relay deploy`
(no endpoint file): the handle is how this process reaches what it serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.config import ConfigError
from relay.serving import command, ingress


@dataclass
class Served:
    """Models being served: `url` is the base (e.g. http://127.0.0.1:8000; a model answers at
    `{url}/v1/models/{name}:predict`); `models` their names. A context manager too."""

    url: str
    models: list[str]
    own_cluster: bool = field(repr=False)
    _setup: ingress.ServeSetup | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        """Take the app down; a cluster started for it goes with it. A second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        command.take_down(self.own_cluster)
        if self._setup is not None:
            self._setup.remove()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def app_args(refs: Sequence[str], options: dict[str, Any]):
    """AppArgs for `refs` and `options`, or ConfigError naming the option at fault."""
    from relay.serving.args import BadOption
    from relay.serving.args import app_args as build

    if isinstance(refs, str) or not refs:
        raise ConfigError("refs: name one model or more, e.g. relay.serve('digits:best')")
    try:
        return build(list(refs), options, flags=False)
    except BadOption as exc:
        raise ConfigError(str(exc)) from None


def start(args, allow_task: Sequence[str], host: str, port: int) -> Served:
    """relay.serve's work once its options are good (`app_args`): the models resolved, then
    served."""
    from relay.tasks import check_task_spec

    try:
        allowed = [check_task_spec(spec) for spec in allow_task]
    except ValueError as exc:
        raise ConfigError(f"allow_task: {exc}") from None
    models, problem = command.resolve(args, allowed)
    if problem:
        raise ConfigError(problem)
    own_cluster = command.own_cluster_wanted()
    if own_cluster and (reason := command.port_taken(host, port)):
        raise ConfigError(f"port: cannot listen on {host}:{port}: {reason}")

    from relay.runtime import cluster

    setup = None
    if own_cluster:  # read by the cluster's processes as they start
        setup = ingress.serve_environment(ingress.HAPROXY)
        setup.apply()
    try:
        cluster.connect()
        base, _ = command.start_app(models, args, host, port)
    except BaseException:
        command.take_down(own_cluster)
        if setup is not None:
            setup.remove()
        raise
    return Served(base, [info.name for info in models], own_cluster, setup)
