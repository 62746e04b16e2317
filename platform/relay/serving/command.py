"""`relay serve REF`: serve one model over HTTP from a Ray cluster (Ray Serve).

Thin, like the rest of the CLI: check the arguments and resolve the model before Ray starts (a
bad reference exits 2 in a second, not after a cluster start), then run relay/serving/app.py's
application with Serve bound to --host:--port (loopback unless asked) behind the chosen ingress
(relay/serving/ingress.py), wait until the endpoint answers, print how to call it, and wait for
Ctrl-C (or SIGTERM) to take it down again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from relay.serving import ingress

EXIT_FAILED, EXIT_USAGE = 1, 2

# CLI flag → AppArgs field (relay/serving/app.py): type and help. Unset flags keep AppArgs'
# defaults, so they live in one place; the help is written out here because building the
# parser must not import Ray (every relay command builds it).
APP_FLAGS: dict[str, tuple[type, str]] = {
    "replicas": (int, "replicas (default: 1; the minimum when autoscaling)"),
    "max_replicas": (int, "autoscale between --replicas and this many (default: fixed)"),
    "num_cpus": (float, "CPUs each replica reserves (default: 0.5)"),
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


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over HTTP (Ray Serve; KServe v1 protocol)"
    )
    parser.add_argument(
        "ref", help="name:best, name:latest, name:N, a run id, or a checkpoint directory"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every "
        "interface)",
    )
    parser.add_argument("--port", type=_port, default=8000, help="HTTP port (default: 8000)")
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


def _fail(message: str, code: int) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def _port_taken(host: str, port: int) -> str | None:
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


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from relay.serving import app as app_module

    options = {f: getattr(args, f) for f in APP_FLAGS if getattr(args, f) is not None}
    try:
        app_args = app_module.AppArgs(model=args.ref, **options)
    except ValidationError as exc:
        item = exc.errors()[0]
        flag = "--" + "-".join(str(part) for part in item["loc"]).replace("_", "-")
        return _fail(f"{flag}: {item['msg']}", EXIT_USAGE)
    try:
        info = app_module.resolve(app_args)
    except (KeyError, TypeError, ValueError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        return _fail(f"cannot serve {args.ref!r}: {message}", EXIT_USAGE)
    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    import ray

    # Our own embedded cluster goes away with us; on a shared one we only remove our app.
    own_cluster = not ray.is_initialized() and os.environ.get("RAY_ADDRESS", "local") == "local"
    if own_cluster and (reason := _port_taken(args.host, args.port)):
        return _fail(f"cannot listen on {args.host}:{args.port}: {reason}", EXIT_USAGE)

    from ray import serve

    from relay import cluster
    from relay.tasks import resolve_task_class

    setup = None
    if own_cluster:  # read by the cluster's processes as they start
        setup = ingress.serve_environment(args.ingress or ingress.HAPROXY)
        setup.apply()
    app_name = f"relay-{info.name}"
    previous_handlers: dict[int, Any] = {}
    try:
        cluster.connect(verbose=args.verbose)
        # After ray.init, which installs a SIGTERM handler of its own (it exits at once).
        previous_handlers = _stop_on_signals()
        serve.start(
            http_options={"host": args.host, "port": args.port},
            logging_config={"enable_access_log": app_args.access_log},
        )
        serve.run(app_module.build(info, app_args), name=app_name, route_prefix="/")
        base = f"http://{args.host}:{args.port}"
        ingress.wait_until_answering(f"{base}/v1/models/{info.name}")
        running = ingress.running_ingress()
        print(f"serving {info.reference} (task {info.task}) at {base}/v1/models/{info.name}")
        print(f"ingress: {running} ({ingress.DESCRIPTIONS[running]})")
        if args.ingress and args.ingress != running:
            print(
                f"relay: --ingress {args.ingress} ignored: the cluster at "
                f"{os.environ['RAY_ADDRESS']} runs {running} (chosen when it started)",
                file=sys.stderr,
            )
        print(f"API docs: {base}/docs   stop: Ctrl-C")
        print(_example_curl(base, info.name, resolve_task_class(info.task).Instance), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("relay: stopping", file=sys.stderr)
        return 0
    except Exception as exc:  # a replica that cannot start, a port Serve cannot take, ...
        return _fail(f"serving failed: {exc}", EXIT_FAILED)
    finally:
        _take_down(app_name, own_cluster)
        if setup is not None:
            setup.remove()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


def _take_down(app_name: str, own_cluster: bool) -> None:
    import ray
    from ray import serve

    try:
        if own_cluster:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(app_name)
    except Exception as exc:  # already gone (e.g. the cluster died): nothing left to clean up
        print(f"relay: while stopping: {exc}", file=sys.stderr)
