"""`relay serve REF [REF ...]`: serve models over HTTP from a Ray cluster (Ray Serve), and
`relay deploy REF [REF ...]`: swap versions into a running `relay serve` without a failed request.

Thin, like the rest of the CLI: check the arguments and resolve the models before Ray starts (a
bad reference exits 2 in a second, not after a cluster start), then run relay/serving/app.py's
application with Serve bound to --host:--port (loopback unless asked) behind the chosen ingress
(relay/serving/ingress.py), wait until the endpoint answers, print how to call it, record where
it runs (relay/serving/endpoint.py) and wait for Ctrl-C (or SIGTERM) to take it down again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from relay.serving import endpoint, ingress

EXIT_FAILED, EXIT_USAGE = 1, 2

# CLI flag → AppArgs field (relay/serving/app.py): type and help. Unset flags keep AppArgs'
# defaults, so they live in one place; the help is written out here because building the
# parser must not import Ray (every relay command builds it).
APP_FLAGS: dict[str, tuple[type, str]] = {
    "replicas": (int, "replicas (default: 1; the minimum when autoscaling)"),
    "max_replicas": (int, "autoscale between --replicas and this many (default: fixed)"),
    "num_cpus": (float, "CPUs each replica reserves (default: 0.5)"),
    "replica_resources": (
        str,
        "custom Ray resources each replica asks for, as YAML, e.g. '{host1: 1}': replicas "
        "only on nodes that offer them (default: none)",
    ),
    "max_batch_size": (int, "instances per forward pass; 1 turns batching off (default: 32)"),
    "batching": (
        str,
        "adaptive (default): a request alone never waits for a batch to fill, overlapping "
        "ones do; serve: Ray Serve's @serve.batch, every batch waits",
    ),
    "batch_wait_timeout_s": (float, "how long a forward may wait for its batch (default: 0.005)"),
    "max_instances": (int, "instances one request may carry (default: 256)"),
    "max_body_bytes": (int, "largest request body in bytes (default: 1 MiB)"),
    "name": (str, "model name in URLs (default: the registry name, e.g. digits)"),
    "storage": (str, "storage root (default: $RELAY_HOME, else ~/relay)"),
}


def port_number(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


REFS_HELP = (
    "models to serve, each name:best, name:latest, name:N, a run id, or a checkpoint directory; "
    "several share the endpoint, each under its own name"
)
APP_NAME = "relay"  # the Serve application relay serve runs
# How long relay deploy waits for the replicas to load the new weights before the swap (after
# it, the swap loads what is left).
STAGE_TIMEOUT_S = 600.0
# How Serve names its replica actors (ray/serve/_private/common.py, ReplicaID.to_full_id_str).
REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"


def _task_spec(text: str) -> str:
    from relay.tasks import check_task_spec  # (imports torch: only when the flag is given)

    try:
        return check_task_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_allow_task(parser: argparse.ArgumentParser) -> None:
    """--allow-task: a task a checkpoint names that relay may import (relay.tasks.check_allowed)."""
    parser.add_argument(
        "--allow-task",
        action="append",
        default=[],
        type=_task_spec,
        metavar="PKG.MOD:CLASS",
        help="a task a checkpoint's meta.json may name besides the built-in ones and those the "
        "storage root records: its module is then imported, so only code you trust "
        "(repeatable)",
    )


def _add_endpoint_flags(parser: argparse.ArgumentParser, host_help: str) -> None:
    parser.add_argument("--host", default="127.0.0.1", help=host_help)
    parser.add_argument("--port", type=port_number, default=8000, help="HTTP port (default: 8000)")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve models over HTTP (Ray Serve; KServe v1 and v2 protocols)"
    )
    parser.add_argument("refs", nargs="+", metavar="REF", help=REFS_HELP)
    _add_endpoint_flags(
        parser,
        "address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every interface)",
    )
    parser.add_argument(
        "--ingress",
        choices=ingress.INGRESSES,
        help="what carries requests to the replicas on a cluster relay starts: haproxy "
        "(default; straight to the replicas) or proxy (Serve's Python proxy). A running "
        "cluster (--address) keeps the one it was started with",
    )
    parser.add_argument(
        "--address",
        help="a running Ray cluster to serve from (default: $RAY_ADDRESS, else a cluster "
        "started here that stops with relay serve)",
    )
    for field, (kind, text) in APP_FLAGS.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, help=text)
    parser.add_argument("--verbose", action="store_true", help="show Ray's own logs")
    add_allow_task(parser)

    deploy = subparsers.add_parser(
        "deploy",
        help="swap model versions into a running relay serve, with no failed request",
        description="Each REF replaces the served model of its name (or joins the endpoint). "
        "The replicas load the new weights beside the old and switch at once; requests go on "
        "throughout.",
    )
    deploy.add_argument("refs", nargs="+", metavar="REF", help=REFS_HELP)
    _add_endpoint_flags(
        deploy, "the endpoint's address, as given to relay serve (default: 127.0.0.1)"
    )
    deploy.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    deploy.add_argument("--verbose", action="store_true", help="show Ray's own logs")
    add_allow_task(deploy)


def _fail(message: str, code: int) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def port_taken(host: str, port: int) -> str | None:
    """Why Serve could not listen on host:port, found out before Ray starts; None if it can."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _example_curl(base: str, name: str, instance_model) -> str:
    examples = instance_model.model_json_schema().get("examples") or ["<instance>"]
    body = json.dumps({"instances": [examples[0]]}, separators=(",", ":"))
    return (
        f"curl -s {base}/v1/models/{name}:predict -H 'Content-Type: application/json' -d '{body}'"
    )


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals() -> dict[int, Any]:
    """Ctrl-C and SIGTERM end the wait as KeyboardInterrupt. Set explicitly: a process started
    in the background by a script inherits SIGINT ignored, and Python then never raises it."""

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, raise_interrupt) for sig in STOP_SIGNALS}


def _app_args(refs: list[str], options: dict[str, Any]):
    """AppArgs from the command line, or the one-line message for a bad flag."""
    from relay.serving.args import BadOption, app_args

    try:
        return app_args(refs, options, flags=True), None
    except BadOption as exc:
        return None, str(exc)


def resolve(app_args, allow_task: list[str]) -> tuple[list, str | None]:
    from relay.serving.app import resolve_models

    try:
        return resolve_models(app_args, allow_task), None
    except (KeyError, TypeError, ValueError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        return [], f"cannot serve {', '.join(app_args.model)}: {message}"


def cmd_serve(args: argparse.Namespace) -> int:
    options = {f: getattr(args, f) for f in APP_FLAGS if getattr(args, f) is not None}
    app_args, problem = _app_args(args.refs, options)
    if problem:
        return _fail(problem, EXIT_USAGE)
    models, problem = resolve(app_args, args.allow_task)
    if problem:
        return _fail(problem, EXIT_USAGE)
    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    # Our own embedded cluster goes away with us; on a shared one we only remove our app.
    own_cluster = own_cluster_wanted()
    if own_cluster and (reason := port_taken(args.host, args.port)):
        return _fail(f"cannot listen on {args.host}:{args.port}: {reason}", EXIT_USAGE)

    from relay.runtime import cluster

    setup = None
    if own_cluster:  # read by the cluster's processes as they start
        setup = ingress.serve_environment(args.ingress or ingress.HAPROXY)
        setup.apply()
    previous_handlers: dict[int, Any] = {}
    recorded = False
    try:
        cluster.connect(verbose=args.verbose)
        # After ray.init, which installs a SIGTERM handler of its own (it exits at once).
        previous_handlers = _stop_on_signals()
        base, runtime_env = start_app(models, app_args, args.host, args.port)
        _record(args, app_args, runtime_env)
        recorded = True
        _say_where(args, models, base)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("relay: stopping", file=sys.stderr)
        return 0
    except Exception as exc:  # a replica that cannot start, a port Serve cannot take, ...
        return _fail(f"serving failed: {exc}", EXIT_FAILED)
    finally:
        if recorded:
            endpoint.remove(app_args.storage, args.host, args.port, os.getpid())
        take_down(own_cluster)
        if setup is not None:
            setup.remove()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


def start_app(models: list, app_args, host: str, port: int) -> tuple[str, dict[str, Any]]:
    """Serve, bound to host:port, running relay's app for `models` (resolved) on the connected
    cluster; returns (its base URL, the app's runtime_env) once every model answers."""
    import ray
    from ray import serve

    from relay.serving.app import build

    serve.start(
        http_options={"host": host, "port": port},
        logging_config={"enable_access_log": app_args.access_log},
    )
    # Named explicitly (what Serve would default to) and recorded for relay deploy.
    runtime_env = dict(ray.get_runtime_context().runtime_env)
    serve.run(build(models, app_args, runtime_env), name=APP_NAME, route_prefix="/")
    base = f"http://{host}:{port}"
    for info in models:
        ingress.wait_until_answering(f"{base}/v1/models/{info.name}")
    return base, runtime_env


def own_cluster_wanted() -> bool:
    """Whether serving starts a cluster of its own (which goes away with it) rather than using
    the one this process is connected to or RAY_ADDRESS names."""
    import ray

    return not ray.is_initialized() and os.environ.get("RAY_ADDRESS", "local") == "local"


def _record(args: argparse.Namespace, app_args, runtime_env: dict[str, Any]) -> None:
    """This server's endpoint file, which `relay deploy` reads (serving/endpoint.py)."""
    import ray

    here = endpoint.Endpoint(
        host=args.host,
        port=args.port,
        address=ray.get_runtime_context().gcs_address,
        app_name=APP_NAME,
        pid=os.getpid(),
        pid_start=endpoint.process_start_time(os.getpid()),
        args=app_args.model_dump(mode="json"),
        auth_mode=os.environ.get("RAY_AUTH_MODE"),
        runtime_env=runtime_env,
    )
    endpoint.write(app_args.storage, here)


def _say_where(args: argparse.Namespace, models, base: str) -> None:
    """What is served where, through which ingress, and how to call it."""
    from relay.tasks import resolve_task_class

    running = ingress.running_ingress()
    for info in models:
        print(f"serving {info.reference} (task {info.task}) at {base}/v1/models/{info.name}")
    print(f"ingress: {running} ({ingress.DESCRIPTIONS[running]})")
    if args.ingress and args.ingress != running:
        print(
            f"relay: --ingress {args.ingress} ignored: the cluster at "
            f"{os.environ['RAY_ADDRESS']} runs {running} (chosen when it started)",
            file=sys.stderr,
        )
    print(f"API docs: {base}/docs   metrics: {base}/metrics   stop: Ctrl-C")
    first = models[0]
    print(_example_curl(base, first.name, resolve_task_class(first.task).Instance))
    print(f"new version: relay deploy {first.name}:N --port {args.port}", flush=True)


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def cmd_deploy(args: argparse.Namespace) -> int:
    """Swap versions into the relay serve at --host:--port: the same application and replica
    arguments, a new model table (Serve reconfigures the replicas in place)."""
    found = endpoint.read(args.storage, args.host, args.port)
    if found is None:
        where = endpoint.record_path(args.storage, args.host, args.port)
        return _fail(
            f"no relay serve runs at {args.host}:{args.port} (no live record at {where}); "
            "start one with relay serve, or give the --host/--port/--storage it was given",
            EXIT_USAGE,
        )
    # Read by Ray as it is imported (below, with the app): the cluster's authentication mode.
    os.environ["RAY_ADDRESS"] = found.address
    if found.auth_mode:
        os.environ.setdefault("RAY_AUTH_MODE", found.auth_mode)

    from relay.serving.args import AppArgs

    served_args = AppArgs.model_validate(found.args)
    new_args, problem = _app_args(args.refs, served_args.replica_args().model_dump())
    if problem:
        return _fail(problem, EXIT_USAGE)
    new_args.storage = served_args.storage
    new, problem = resolve(new_args, args.allow_task)
    if problem:
        return _fail(problem, EXIT_USAGE)
    with endpoint.changing(args.storage, args.host, args.port):
        return _swap_in(new, served_args, found, args.verbose)


def _swap_in(new: list, served_args, found: endpoint.Endpoint, verbose: bool) -> int:
    """Replace or add the models `new` in the endpoint's table; the replicas reconfigure."""
    import ray
    from ray import serve

    from relay.runtime import cluster
    from relay.serving import staging
    from relay.serving.answers import shown
    from relay.serving.app import build
    from relay.serving.model_table import user_config

    try:
        cluster.connect(verbose=verbose)
        # The record only says where to look: what runs there decides (a record left by
        # another cluster, or edited, must not steer what the replicas are rebuilt with).
        current, problem = _live_table(found)
        if problem:
            where = f"{found.host}:{found.port}"
            return _fail(
                f"the record of relay serve at {where} {problem}; not deploying", EXIT_USAGE
            )
        table = {info.name: info for info in current}
        before = {name: info.version for name, info in table.items()}
        table.update({info.name: info for info in new})
        models = list(table.values())
        served_args.model = [info.reference for info in models]
        # Every replica loads the new weights while it serves, so that the swap itself (when
        # Serve routes nothing to a replica) is short; a replica that cannot load them stops
        # the deploy here, before anything changed.
        try:
            staged = staging.stage(
                found.app_name, user_config(models), _running_replicas(found.app_name),
                STAGE_TIMEOUT_S,
            )  # fmt: skip
        except RuntimeError:
            staging.stage(found.app_name, None, 0, 0)  # the replicas drop what they loaded
            raise
        if not staged and verbose:
            print("relay: not every replica loaded ahead; the swap loads the rest", file=sys.stderr)
        # Returns once every replica runs the new table (Serve's application status).
        app = build(models, served_args, found.runtime_env)
        serve.run(app, name=found.app_name, route_prefix="/")
        for info in new:
            _wait_for_version(found.base_url, info, shown(info.version))
    except Exception as exc:
        return _fail(f"deploy failed: {exc}", EXIT_FAILED)
    finally:
        ray.shutdown()
    found.args = served_args.model_dump(mode="json")
    endpoint.write(served_args.storage, found)
    for info in new:
        was = before.get(info.name)
        change = f"version {was} → {info.version}" if was is not None else "added"
        print(f"deployed {info.reference} at {found.base_url}/v1/models/{info.name} ({change})")
    return 0


def _live_table(found: endpoint.Endpoint) -> tuple[list, str | None]:
    """The models the cluster at the record's address serves, from its Serve controller, once
    the record is checked against it: that cluster serves HTTP at the record's host:port, runs
    the record's application, whose replicas run with the record's runtime_env. Else the
    mismatch, as a message."""
    from ray.serve.context import _get_global_client

    from relay.serving.app import DEPLOYMENT
    from relay.serving.model_table import models_of

    try:
        details = _get_global_client().get_serve_details()
    except Exception as exc:  # no Serve on that cluster (the RayServeException of a lookup)
        return [], f"names a cluster with no Serve running ({found.address}: {exc})"
    http = details.get("http_options") or {}
    if (http.get("host"), http.get("port")) != (found.host, found.port):
        where = f"{http.get('host')}:{http.get('port')}"
        return [], f"names the cluster at {found.address}, which serves HTTP at {where}"
    application = (details.get("applications") or {}).get(found.app_name) or {}
    deployment = (application.get("deployments") or {}).get(DEPLOYMENT)
    if deployment is None:
        return [], f"names application {found.app_name!r}, which {found.address} does not run"
    config = deployment["deployment_config"]
    runtime_env = (config.get("ray_actor_options") or {}).get("runtime_env")
    if runtime_env != found.runtime_env:
        return [], (
            f"gives a runtime_env the running replicas do not have ({found.runtime_env!r}; "
            f"they run with {runtime_env!r})"
        )
    try:
        return models_of(config.get("user_config") or {}), None
    except (KeyError, ValueError) as exc:
        return [], f"names an application that is not relay's ({exc})"


def _running_replicas(app_name: str) -> int:
    from ray import serve

    from relay.serving.app import DEPLOYMENT

    application = serve.status().applications.get(app_name)
    deployment = application.deployments.get(DEPLOYMENT) if application else None
    return deployment.replica_states.get("RUNNING", 0) if deployment else 0


def _wait_for_version(base_url: str, info, version: str, timeout_s: float = 60.0) -> None:
    """Until the endpoint answers for `info.name` with `version`, as the endpoint shows it
    (HAProxy may still be switching over from a replica that left, when the swap restarted
    replicas)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _get_json(f"{base_url}/v1/models/{info.name}")["version"] == version:
                return
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{info.name} did not answer with version {info.version}")
        time.sleep(0.1)


def take_down(own_cluster: bool) -> None:
    """The app gone; with it the cluster, if serving started it."""
    import ray
    from ray import serve

    try:
        if own_cluster:
            _end_replicas_now()
            serve.shutdown()  # stops HAProxy too, which Ray alone would leave running
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
    except Exception as exc:  # already gone (e.g. the cluster died): nothing left to clean up
        print(f"relay: while stopping: {exc}", file=sys.stderr)


def _end_replicas_now() -> None:
    """Serve stops each replica gracefully: it keeps answering for the draining period
    (ingress.DRAIN_S) while HAProxy forgets it. When the whole cluster goes, there is nothing
    to hand its requests to: kill the replicas, so that stopping takes seconds less."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(REPLICA_ACTOR_PREFIX):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
