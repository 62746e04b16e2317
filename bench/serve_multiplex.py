""".venv/bin/python bench/serve_multiplex.py [--seconds S] [--repeats N]

Several models on one endpoint: relay's model table against Ray Serve's model multiplexing
(`@serve.multiplexed`), measured in one run — the choice issue 14 asks to make by measurement.

Both sides serve two digits models (`digits:1` and `digits-b:1`, the tiny MLP) from one replica
(0.5 CPU, adaptive batching, access log off) behind HAProxy ingress on a free 127.0.0.1 port,
and run the same replica code (relay/serving/app.py's ModelServer); they differ only in when a
replica loads a model:

  table        `relay serve digits:1 digits-b:1` as a user runs it: every replica loads every
               model of the endpoint before it takes requests (the model table travels as the
               deployment's user_config, relay/serving/model_table.py).
  multiplexed  this file run as `--multiplexed STORAGE --port P`: the same deployment class,
               its table filled by a `@serve.multiplexed` loader on the first request that names
               a model (a pure ASGI layer awaits it before the routes run), at most as many
               models per replica as the endpoint has (no eviction in this run). Same ingress
               set-up (relay/serving/ingress.py's environment).

Measured per side, each started, measured and stopped in an order that alternates between
repeats:
- cold: the first request to each model once the server answers its health check (wall time
  of one POST with one image, Python's http.client) — where multiplexing puts a model load on
  the request path; for the tiny models, and again on a server of its own with two heavy
  ones (hidden 4096,4096: 17 M parameters, 68 MB of weights each), where loading costs more;
- warm: closed-loop load with Debian's `wrk` (bench/serve_load.py's client and Lua figures)
  at c = 1 and 32, the requests alternating between the two models, each carrying Serve's
  model-id header (`serve_multiplexed_model_id`) as multiplexing's routing expects; the median
  over repeats and the spread of requests/s.

The last stdout line is one JSON object: multiplexed_ratio_c32 (multiplexed / table
requests/s at c=32), multiplexed_p50_gap_ms_c1 (multiplexed − table), cold_first_ms and
cold_first_ms_heavy per side (median over repeats of the first request to each model, the
slower of the two), then every level's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# bench/ is the script's directory, so on sys.path: the same client, servers and checkpoints.
from serve_load import (
    HEAVY_HIDDEN,
    HOST,
    MODEL,
    Server,
    free_port,
    make_checkpoint,
    measure,
    summarise,
    write_inputs,
)

from harness import alternated_sides, print_results, require_program, scratch

MODELS = (MODEL, f"{MODEL}-b")
LEVELS = (1, 32)
MODEL_ID_HEADER = "serve_multiplexed_model_id"  # Serve's (ray/serve/_private/constants.py)
READY_LINE = "multiplexed server ready"

# wrk's Lua hooks: bench/serve_load.py's, with the path and the model-id header alternating
# between the endpoint's models request by request.
ALTERNATING = """
local names = {NAMES}
local n = 0
request = function()
  n = n + 1
  local name = names[n % #names + 1]
  local headers = {["Content-Type"] = "application/json", ["HEADER"] = name}
  return wrk.format("POST", "/v1/models/" .. name .. ":predict", headers, wrk.body)
end
""".replace("NAMES", ", ".join(f'"{name}"' for name in MODELS)).replace("HEADER", MODEL_ID_HEADER)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--seconds", type=int, default=6, help="measured seconds per level")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every side")
    parser.add_argument("--multiplexed", metavar="STORAGE", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- the multiplexed side: relay's replica, models loaded on demand ---------------------------


def multiplexed_deployment(models: list, max_models: int):
    """relay's ModelServer with its table filled on demand by Serve's model multiplexing."""
    from ray import serve

    from relay.serving import app, model_table
    from relay.serving.batching import AdaptiveBatcher
    from relay.serving.routes import build_http_app, model_named_in

    class MultiplexedServer(app.ModelServer.func_or_class):
        async def __init__(self, args) -> None:  # an ingress class's __init__ is async
            await super().__init__(args)
            self.known = {info.name: info for info in models}

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, name: str) -> model_table.LoadedModel:
            entry = await asyncio.to_thread(model_table.load, self.known[name])
            entry.batcher = AdaptiveBatcher(
                lambda instances: self.forward(entry, instances),
                self.args.max_batch_size,
                self.args.batch_wait_timeout_s,
            )
            self.table = {**self.table, name: entry}  # the routes read the table
            return entry

        def __serve_build_asgi_app__(self):
            api = build_http_app(self)
            api.add_middleware(LoadOnDemand, server=self)  # the outermost layer
            return api

    class LoadOnDemand:
        """Before the routes (and relay's own layers, which read the table) see a request
        about a model this endpoint has, make sure the replica has loaded it."""

        def __init__(self, asgi, server: MultiplexedServer) -> None:
            self.asgi, self.server = asgi, server

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http" and (name := model_named_in(scope)) in self.server.known:
                await self.server.get_model(name)
            await self.asgi(scope, receive, send)

    return serve.deployment(MultiplexedServer)


def run_multiplexed_server(storage: str, port: int) -> None:
    """Serve MODELS from `storage` the multiplexed way on HOST:port until SIGTERM."""
    import ray
    from ray import serve

    from relay.runtime import cluster
    from relay.serving import app, ingress

    args = app.AppArgs(model=[f"{name}:1" for name in MODELS], storage=storage, num_cpus=0.5)
    models = app.resolve_models(args)
    setup = ingress.serve_environment(ingress.HAPROXY)
    setup.apply()
    try:
        cluster.connect()
        # After ray.init, which installs a SIGTERM handler of its own (it exits at once).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        serve.start(
            http_options={"host": HOST, "port": port}, logging_config={"enable_access_log": False}
        )
        deployment = multiplexed_deployment(models, max_models=len(models)).options(
            name=app.DEPLOYMENT,
            ray_actor_options={"num_cpus": args.num_cpus},
            max_ongoing_requests=args.max_ongoing_requests,
            logging_config={"enable_access_log": False},
        )
        serve.run(deployment.bind(args.replica_args()), name="relay", route_prefix="/")
        print(READY_LINE, flush=True)
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()
        setup.remove()


# --- measurement ----------------------------------------------------------------------------


def start_side(side: str, storage: Path, port: int) -> Server:
    if side == "table":
        argv = [sys.executable, "-m", "relay.cli", "serve", *(f"{m}:1" for m in MODELS)]
        argv += ["--storage", str(storage), "--port", str(port), "--num-cpus", "0.5"]
        # relay serve prints its curl example once every model has answered a GET.
        return Server(argv, ready_line="curl ")
    argv = [sys.executable, __file__, "--multiplexed", str(storage), "--port", str(port)]
    return Server(argv, ready_line=READY_LINE)


@contextlib.contextmanager
def serving(side: str, storage: Path) -> Iterator[int]:
    """One side's server on a free port, answering its health check; stopped after."""
    port = free_port()
    server = start_side(side, storage, port)
    try:
        wait_for_health(port)
        yield port
    finally:
        server.stop()


def wait_for_health(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", "/v2/health/live")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing answers on {HOST}:{port}")
        time.sleep(0.1)


def first_requests(port: int) -> dict[str, float]:
    """Milliseconds of the first POST to each model, one after the other."""
    body = Path(os.environ["RELAY_BENCH_BODY"]).read_bytes()
    took = {}
    for name in MODELS:
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        headers = {"Content-Type": "application/json", MODEL_ID_HEADER: name}
        started = time.perf_counter()
        conn.request("POST", f"/v1/models/{name}:predict", body, headers)
        response = conn.getresponse()
        response.read()
        took[name] = round((time.perf_counter() - started) * 1000, 2)
        if response.status != 200:
            raise RuntimeError(f"first request to {name}: HTTP {response.status}")
    return took


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.multiplexed:
        run_multiplexed_server(args.multiplexed, args.port)
        return
    require_program("wrk", "bench/serve_multiplex.py")
    sides = ["table", "multiplexed"]
    runs: dict[str, list] = {side: [] for side in sides}
    cold: dict[str, list] = {side: [] for side in sides}
    cold_heavy: dict[str, list] = {side: [] for side in sides}
    with scratch("multiplex") as tmp:
        write_inputs(Path(tmp))
        script = Path(tmp, "alternating.lua")
        script.write_text(Path(tmp, "post.lua").read_text() + ALTERNATING)
        storage, heavy_storage = Path(tmp, "tiny"), Path(tmp, "heavy")
        for name in MODELS:
            make_checkpoint(storage, name=name)
            make_checkpoint(heavy_storage, HEAVY_HIDDEN, name=name)
        for side in alternated_sides(sides, args.repeats):
            with serving(side, storage) as port:
                cold[side].append(first := first_requests(port))
                print(f"{side:<12} tiny, first requests (ms): {first}", flush=True)
                runs[side].append(measure(side, port, LEVELS, args.seconds, script))
            with serving(side, heavy_storage) as port:
                cold_heavy[side].append(first := first_requests(port))
                print(f"{side:<12} heavy, first requests (ms): {first}", flush=True)
    levels = {side: summarise(side_runs) for side, side_runs in runs.items()}

    def slowest_first(runs: dict[str, list]) -> dict[str, float]:
        return {
            side: round(statistics.median(max(first.values()) for first in runs[side]), 2)
            for side in sides
        }

    table, multiplexed = levels["table"], levels["multiplexed"]
    print_results(
        {
            "multiplexed_ratio_c32": round(multiplexed[32]["rps"] / table[32]["rps"], 3),
            "multiplexed_p50_gap_ms_c1": round(multiplexed[1]["p50_ms"] - table[1]["p50_ms"], 2),
            "cold_first_ms": slowest_first(cold),
            "cold_first_ms_heavy": slowest_first(cold_heavy),
            "cold_runs": {"tiny": cold, "heavy": cold_heavy},
            "levels": levels,
            "setup": {
                "models": list(MODELS),
                "sizes": {"tiny": f"{MODEL} default size", "heavy": f"hidden {HEAVY_HIDDEN}"},
                "replicas": 1,
                "seconds_per_level": args.seconds,
                "repeats": args.repeats,
                "client": "wrk -t1, closed loop, alternating models",
                "cpus": os.cpu_count(),
            },
        }
    )


if __name__ == "__main__":
    main()
