""".venv/bin/python bench/serve_load.py

What serving through relay (serve/app.py on Ray Serve) costs or gains over a plain FastAPI +
uvicorn server running the same model on the same machine, measured in one run.

The model: a `digits` MLP (`--size`, default "default": 64 → 256 → 128 → 10; `--hidden 2048,2048`
for one whose forward outweighs the proxy hop) saved as a relay
checkpoint and registered as `digits:1` in a temporary storage root. Three servers, each on a
free 127.0.0.1 port, each answering `POST /v1/models/digits:predict` with one image per request
(KServe v1 body), validated with the task's `Instance` schema and predicted with `task.predict`:

  relay batched   serve/app.py: one replica (0.5 CPU), `@serve.batch` (max_batch_size 32,
                  5 ms wait), max_ongoing_requests 256, access log off, behind Serve's proxy.
  relay unbatched the same with max_batch_size 1 (every request is its own forward).
  plain           this file run as `--plain CHECKPOINT --port P`: one uvicorn process, one
                  FastAPI route, one forward per request, access log off; started as a
                  subprocess and ended by its PID.

Both sides run torch on one intra-op thread (the replica reserves 0.5 CPU; more threads only
fight the load generator on two cores). `--direct-ingress` sets RAY_SERVE_ENABLE_DIRECT_INGRESS=1
before Ray starts and also measures the replica's own HTTP port (Serve allocates it from
30000–31000), to compare with the proxy's port.

Load: closed loop — `c` client threads, each with one keep-alive connection, send the next
request as soon as the previous answer arrives — for `--seconds` per level after a 1 s warm-up,
at c = 1, 8, 32. Figures per level: requests/s, p50 and p99 latency. The last stdout line is one
JSON object: throughput_ratio_c32 and p99_ratio_c32 (relay batched / plain), every level's
figures, and the set-up. Only loopback addresses are used; each level stops by itself.
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MODEL = "digits"
PATH = f"/v1/models/{MODEL}:predict"
LEVELS = (1, 8, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per level")
    parser.add_argument("--size", default="default", help="digits size preset")
    parser.add_argument(
        "--hidden",
        help="override the MLP's hidden widths, e.g. 2048,2048: a model whose forward costs "
        "more than the proxy hop, where batching shows what it buys",
    )
    parser.add_argument(
        "--direct-ingress", action="store_true", help="Serve with direct ingress (see docstring)"
    )
    parser.add_argument("--plain", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# --- the baseline: plain FastAPI + uvicorn --------------------------------------------------


def run_plain_server(checkpoint_dir: str, port: int) -> None:
    import torch
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError

    from relay.checkpoint import load_model

    torch.set_num_threads(1)
    task, model = load_model(checkpoint_dir)
    api = FastAPI()

    @api.post(PATH)
    async def predict(request: Request) -> JSONResponse:
        try:
            instances = task.validate_instances(json.loads(await request.body())["instances"])
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        predictions = task.predict(model, instances)
        return JSONResponse({"predictions": [p.model_dump(mode="json") for p in predictions]})

    uvicorn.run(api, host=HOST, port=port, access_log=False, log_level="warning")


# --- load generator --------------------------------------------------------------------------


def request_body() -> bytes:
    from sklearn.datasets import load_digits

    image = load_digits().data[0].tolist()
    return json.dumps({"instances": [image]}).encode()


def post(conn: http.client.HTTPConnection, body: bytes) -> int:
    conn.request("POST", PATH, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


def closed_loop(port: int, body: bytes, concurrency: int, seconds: float) -> dict[str, Any]:
    """`concurrency` threads send requests back to back; figures from after the warm-up."""
    start = time.perf_counter()
    measure_from, stop_at = start + 1.0, start + 1.0 + seconds
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency

    def client(index: int) -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=30)
        while (now := time.perf_counter()) < stop_at:
            try:
                ok = post(conn, body) == 200
            except OSError:
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(HOST, port, timeout=30)
            done = time.perf_counter()
            if now >= measure_from:
                if ok:
                    latencies[index].append(done - now)
                else:
                    errors[index] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = sorted(x for per_thread in latencies for x in per_thread)
    if not done:
        return {"rps": 0.0, "p50_ms": None, "p99_ms": None, "errors": sum(errors)}
    return {
        "rps": round(len(done) / seconds, 1),
        "p50_ms": round(1000 * done[len(done) // 2], 2),
        "p99_ms": round(1000 * done[min(len(done) - 1, int(len(done) * 0.99))], 2),
        "errors": sum(errors),
    }


def wait_until_up(port: int, body: bytes, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            if post(conn, body) == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing answers on {HOST}:{port}")
        time.sleep(0.2)


def measure(label: str, port: int, body: bytes, seconds: float) -> dict[int, dict[str, Any]]:
    wait_until_up(port, body)
    results = {}
    for concurrency in LEVELS:
        results[concurrency] = figures = closed_loop(port, body, concurrency, seconds)
        print(
            f"{label:<22} c={concurrency:<3} {figures['rps']:>8.1f} req/s   "
            f"p50 {figures['p50_ms']} ms   p99 {figures['p99_ms']} ms   "
            f"errors {figures['errors']}",
            flush=True,
        )
    return results


# --- set-up ----------------------------------------------------------------------------------


def make_checkpoint(storage: Path, size: str, hidden: str | None = None) -> str:
    """A digits model registered as digits:1 (weights as initialised: speed, not accuracy)."""
    import torch

    from relay import checkpoint, config, registry
    from relay.tasks import build_task

    model_overrides = {"hidden": [int(w) for w in hidden.split(",")]} if hidden else {}
    cfg = config.from_dict(
        {"task": MODEL, "size": size, "model": model_overrides, "storage": str(storage)}
    )
    torch.manual_seed(0)
    model = build_task(cfg.task, cfg.size, cfg.model).build_model()
    directory = storage / "runs" / "bench" / "epoch_0000"
    meta = {"epoch": 1, "metrics": {}, "config": cfg.model_dump(mode="json")}
    checkpoint.save(directory, model, meta=meta)
    entry = {"checkpoint": str(directory), "run_id": "bench", "task": MODEL, "score": None}
    registry.register_version(storage, MODEL, entry)
    return str(directory)


def direct_ingress_port(body: bytes) -> int:
    """The replica's own HTTP port: the first in Serve's direct-ingress range that answers."""
    for port in range(30000, 30100):
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=1)
            if post(conn, body) == 200:
                return port
        except OSError:
            continue
    raise RuntimeError("no direct-ingress replica answers on 127.0.0.1:30000-30099")


def measure_relay(
    storage: Path, body: bytes, seconds: float, direct_ingress: bool
) -> dict[str, dict[int, dict[str, Any]]]:
    from ray import serve

    from relay import cluster
    from serve.app import AppArgs, app

    os.environ["RAY_ADDRESS"] = "local"  # a cluster of our own, gone when we are
    cluster.connect(num_cpus=2, direct_ingress=direct_ingress)
    port = free_port()
    serve.start(http_options={"host": HOST, "port": port})
    results = {}
    try:
        for label, batch in (("relay batched", 32), ("relay unbatched", 1)):
            args = AppArgs(model=f"{MODEL}:1", storage=str(storage), max_batch_size=batch)
            serve.run(app(args), name="relay", route_prefix="/")
            results[label] = measure(label, port, body, seconds)
            if direct_ingress:
                direct = direct_ingress_port(body)
                results[f"{label} (replica port)"] = measure(
                    f"{label} :{direct}", direct, body, seconds
                )
            serve.delete("relay")
    finally:
        serve.shutdown()
    return results


def measure_plain(checkpoint_dir: str, body: bytes, seconds: float) -> dict[int, dict[str, Any]]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--plain", checkpoint_dir, "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        return measure("plain FastAPI", port, body, seconds)
    finally:
        server.terminate()  # by PID: only the process this function started
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plain:
        run_plain_server(args.plain, args.port)
        return
    sys.path.insert(0, str(REPO))  # serve.app, as `serve run` finds it from the repo root
    body = request_body()
    with tempfile.TemporaryDirectory(prefix="relay-serve-bench-") as tmp:
        storage = Path(tmp)
        checkpoint_dir = make_checkpoint(storage, args.size, args.hidden)
        plain = measure_plain(checkpoint_dir, body, args.seconds)
        relay = measure_relay(storage, body, args.seconds, args.direct_ingress)
    batched = relay["relay batched"][32]
    summary = {
        "throughput_ratio_c32": round(batched["rps"] / plain[32]["rps"], 3),
        "p99_ratio_c32": round(batched["p99_ms"] / plain[32]["p99_ms"], 3),
    }
    if args.direct_ingress:  # the same figures on the replica's own port, for comparison
        direct = relay["relay batched (replica port)"][32]
        summary["throughput_ratio_c32_replica_port"] = round(direct["rps"] / plain[32]["rps"], 3)
        summary["p99_ratio_c32_replica_port"] = round(direct["p99_ms"] / plain[32]["p99_ms"], 3)
    summary |= {
        "levels": {"plain": plain, **relay},
        "setup": {
            "model": f"{MODEL} ({args.size}, hidden {args.hidden or 'preset'})",
            "seconds_per_level": args.seconds,
            "direct_ingress": args.direct_ingress,
            "cpus": os.cpu_count(),
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
