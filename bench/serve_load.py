""".venv/bin/python bench/serve_load.py [--seconds S] [--repeats N]

What serving through `relay serve` costs or gains over a plain FastAPI + uvicorn server running
the same model on the same machine, per ingress, measured in one run.

Servers, each on a free 127.0.0.1 port, each answering `POST /v1/models/digits:predict` with one
image per request (KServe v1 body), validated with the task's `Instance` schema and predicted
with `task.predict` on one torch thread:

  haproxy   `relay serve digits:1` as a user runs it (the CLI, its own embedded cluster), with
            its default ingress: HAProxy straight to the replica (relay/serving/ingress.py).
            One replica (0.5 CPU), adaptive batching (max_batch_size 32: a forward takes what is
            queued when the model frees, no wait), access log off.
  proxy     the same command with `--ingress proxy`: Serve's Python proxy in front.
  haproxy 2 models
            `relay serve digits:1 digits-b:1`: the same, with a second model in every replica's
            table (relay/serving/model_table.py); the load goes to digits alone. What the
            table costs a request.
  haproxy conn-failure retry
            the same as haproxy, with Serve's own HAProxy retry policy (`retry-on conn-failure`)
            instead of relay's (`conn-failure empty-response`, relay/serving/ingress.py), set
            through the environment as an operator would: what resending a request whose
            replica died costs, in HAProxy keeping a copy of every request.
  haproxy serve.batch
            `--batching serve`: Ray Serve's `@serve.batch` (5 ms wait after a batch's first
            instance) instead of relay's adaptive batcher (relay/serving/batching.py).
  plain     this file run as `--plain CHECKPOINT --port P`: one uvicorn process, one FastAPI
            route, one forward per request, access log off.

Two models, each a digits MLP with weights as initialised (speed, not accuracy):
  tiny   the "default" size (64 → 256 → 128 → 10): the ingress, not the model, sets the speed;
         all three servers at c = 1, 8, 32, 64.
  heavy  hidden 4096,4096 (a forward of milliseconds): relay batched (HAProxy; both batchers;
         both retry policies) vs plain, which runs one forward per request, at c = 1 and 32 —
         where batching must pay.

Load: Debian's `wrk` (C, one thread, a Lua script for the POST body and the figures), closed
loop: `c` keep-alive connections, each sending its next request when the previous answer
arrives, for `--seconds` per level after a 1 s warm-up run whose figures are dropped. The same
client for every side; its own CPU time is reported (the two cores are the servers' too). Every
server is started, measured at every level and stopped, side after side, in an order that
alternates between repeats; per level the median over repeats (and min-max of requests/s).

Version swaps under load (tiny model, HAProxy): `relay serve digits:1`, then per repeat two
wrk windows of `--swap-seconds` at c=32 — one steady, one during which `relay deploy` (a
separate process, as a user runs it) swaps to the other version, alternating 1 → 2 → 1 — in an
order that alternates between repeats. Failed requests (socket errors and non-2xx) are counted
in every window; p99 and max latency compare the swap window with the steady one.

The last stdout line is one JSON object: throughput_ratio_c32 and p99_ratio_c32 (haproxy /
plain, tiny), p50_gap_ms_c1 (haproxy − plain), proxy_ratio_c32 (proxy / plain),
two_models_ratio_c32 (haproxy 2 models / haproxy), batched_throughput_ratio_c32 (heavy: relay
batched / plain) and the same with @serve.batch, relay's retry policy against Serve's
(retry_p50_gap_ms_c1: haproxy − conn-failure retry; retry_throughput_ratio_c32 and, heavy,
retry_batched_ratio_c32: haproxy / conn-failure retry), swap_failed_requests, swap_p99_ratio
(swap window / steady window) with the swap figures, then every level's figures.
"""

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    alternated,
    alternated_sides,
    median_of,
    print_results,
    require_program,
    scratch,
)

HOST = "127.0.0.1"
MODEL = "digits"
PATH = f"/v1/models/{MODEL}:predict"
TINY_LEVELS = (1, 8, 32, 64)
HEAVY_LEVELS = (1, 32)
HEAVY_HIDDEN = "4096,4096"
READY_TIMEOUT_S = 180

# wrk's Lua hooks: the POST body from a file, and at the end one JSON line with the figures
# (latencies in microseconds).
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local file = io.open(os.getenv("RELAY_BENCH_BODY"), "rb")
wrk.body = file:read("*a")
file:close()

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, ' ..
    '"max_us": %d, "errors": %d, "non_2xx": %d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--seconds", type=int, default=6, help="measured seconds per level")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every side")
    parser.add_argument(
        "--swap-seconds", type=int, default=25, help="each swap-phase window (covers a deploy)"
    )
    parser.add_argument(
        "--only", choices=("tiny", "heavy", "swap"), help="one part only (no summary ratios)"
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

    from relay.checkpoints.checkpoint import load_model

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


# --- servers ---------------------------------------------------------------------------------


class Server:
    """One side, started in a session of its own and ended by that session's processes."""

    def __init__(
        self, argv: list[str], ready_line: str | None, env: dict[str, str] | None = None
    ) -> None:
        self.process = subprocess.Popen(
            argv,
            env={**os.environ, "RAY_ADDRESS": "local", "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if ready_line is not None:  # relay serve says when it answers
            deadline = time.monotonic() + READY_TIMEOUT_S
            while time.monotonic() < deadline:
                line = self.process.stdout.readline()
                if not line:
                    raise RuntimeError(f"{argv} exited before it was ready")
                if line.startswith(ready_line):
                    return
            raise TimeoutError(f"{argv} not ready after {READY_TIMEOUT_S} s")

    def stop(self) -> None:
        """SIGTERM to the server, as a user would (relay serve then takes its cluster down and
        removes its files); whatever of its session is left after 20 s gets SIGTERM, then
        SIGKILL."""
        self.process.send_signal(signal.SIGTERM)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + 20
            while session_members(self.process.pid) and time.monotonic() < deadline:
                self.process.poll()
                time.sleep(0.2)
            for pid in session_members(self.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self.process.wait(timeout=30)


def session_members(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


# relay's sides: `relay serve` flags.
RELAY_SIDES = {
    "haproxy": ["--ingress", "haproxy"],
    "haproxy serve.batch": ["--ingress", "haproxy", "--batching", "serve"],
    "proxy": ["--ingress", "proxy"],
    "haproxy 2 models": ["--ingress", "haproxy"],
    "haproxy conn-failure retry": ["--ingress", "haproxy"],
}
# Environment of a side's server, beyond the bench's own (an operator's setting wins over
# relay's default).
SIDE_ENV = {"haproxy conn-failure retry": {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure"}}
# Models each relay side serves (the load goes to the first).
SIDE_MODELS = {"haproxy 2 models": [f"{MODEL}:1", f"{MODEL}-b:1"]}


def start_side(side: str, storage: Path, checkpoint_dir: str, port: int) -> Server:
    if side == "plain":
        argv = [sys.executable, __file__, "--plain", checkpoint_dir, "--port", str(port)]
        server = Server(argv, ready_line=None)
        wait_until_answering(port)
        return server
    models = SIDE_MODELS.get(side, [f"{MODEL}:1"])
    argv = [sys.executable, "-m", "relay.cli", "serve", *models, "--storage", str(storage)]
    argv += ["--port", str(port), "--num-cpus", "0.5", *RELAY_SIDES[side]]
    return Server(argv, ready_line="curl ", env=SIDE_ENV.get(side))


def wait_until_answering(port: int, timeout_s: float = 60.0) -> None:
    import http.client

    body = Path(os.environ["RELAY_BENCH_BODY"]).read_bytes()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("POST", PATH, body, {"Content-Type": "application/json"})
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing answers on {HOST}:{port}")
        time.sleep(0.2)


# --- load ------------------------------------------------------------------------------------


def wrk(port: int, concurrency: int, seconds: int, script: Path) -> dict[str, Any]:
    """One closed-loop run of wrk (whole seconds: what its -d takes); its figures and the CPU
    seconds it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "30s"]
    argv += ["-s", str(script), f"http://{HOST}:{port}{PATH}"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    out = done.stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    figures["client_cpu_s"] = (after.ru_utime - before.ru_utime) + (
        after.ru_stime - before.ru_stime
    )
    return figures


def measure(side: str, port: int, levels, seconds: float, script: Path) -> dict[int, dict]:
    results = {}
    for concurrency in levels:
        wrk(port, concurrency, 1, script)  # warm-up: connections, caches, batch sizes
        raw = wrk(port, concurrency, seconds, script)
        results[concurrency] = figures = {
            "rps": round(raw["requests"] / (raw["duration_us"] / 1e6), 1),
            "p50_ms": round(raw["p50_us"] / 1000, 2),
            "p99_ms": round(raw["p99_us"] / 1000, 2),
            "errors": raw["errors"] + raw["non_2xx"],
            "client_cpu_share": round(raw["client_cpu_s"] / seconds, 3),
        }
        print(
            f"{side:<26} c={concurrency:<3} {figures['rps']:>8.1f} req/s   "
            f"p50 {figures['p50_ms']:>7.2f} ms   p99 {figures['p99_ms']:>7.2f} ms   "
            f"errors {figures['errors']}   wrk cpu {figures['client_cpu_share']:.0%}",
            flush=True,
        )
    return results


def summarise(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Median over repeats per level (and the spread of requests/s)."""
    summary = {}
    for level in runs[0]:
        per_run = [run[level] for run in runs]
        summary[level] = {
            key: round(median_of(per_run, key), 2)
            for key in ("rps", "p50_ms", "p99_ms", "client_cpu_share")
        }
        summary[level]["rps_min"] = min(r["rps"] for r in per_run)
        summary[level]["rps_max"] = max(r["rps"] for r in per_run)
        summary[level]["errors"] = sum(r["errors"] for r in per_run)
    return summary


def compare(
    label: str, sides: list[str], storage: Path, checkpoint_dir: str, levels, args, script: Path
) -> dict[str, dict[int, dict]]:
    runs: dict[str, list] = {side: [] for side in sides}
    for side in alternated_sides(sides, args.repeats):
        port = free_port()
        server = start_side(side, storage, checkpoint_dir, port)
        try:
            runs[side].append(measure(f"{label} {side}", port, levels, args.seconds, script))
        finally:
            server.stop()
    return {side: summarise(side_runs) for side, side_runs in runs.items()}


# --- version swaps under load -----------------------------------------------------------------


def window(port: int, seconds: int, script: Path, deploy_to: int | None, storage: Path) -> dict:
    """One wrk window at c=32; with `deploy_to`, `relay deploy digits:N` runs in it (started
    a few seconds in, after wrk has connected)."""
    import threading

    result: dict[str, Any] = {}
    load = threading.Thread(target=lambda: result.update(wrk(port, 32, seconds, script)))
    load.start()
    deploy_s = None
    if deploy_to is not None:
        time.sleep(3)
        argv = [sys.executable, "-m", "relay.cli", "deploy", f"{MODEL}:{deploy_to}"]
        argv += ["--port", str(port), "--storage", str(storage)]
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True)
        deploy_s = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"relay deploy failed:\n{done.stderr[-2000:]}")
    load.join()
    return {
        "failed": result["errors"] + result["non_2xx"],
        "requests": result["requests"],
        "p99_ms": round(result["p99_us"] / 1000, 2),
        "max_ms": round(result["max_us"] / 1000, 2),
        "deploy_s": None if deploy_s is None else round(deploy_s, 2),
    }


def swaps(storage: Path, args, script: Path) -> dict[str, Any]:
    port = free_port()
    server = start_side("haproxy", storage, "", port)
    steady, swapped = [], []
    try:
        wrk(port, 32, 1, script)  # warm-up
        for repeat, kind in alternated(("steady", "swap"), args.repeats):
            to = 2 if repeat % 2 == 0 else 1  # the version not being served
            deploy_to = to if kind == "swap" else None
            figures = window(port, args.swap_seconds, script, deploy_to, storage)
            (swapped if kind == "swap" else steady).append(figures)
            print(f"swap phase {kind:<6} {figures}", flush=True)
    finally:
        server.stop()

    def median(runs: list[dict], key: str) -> float:
        return round(median_of(runs, key), 2)

    return {
        "swap_failed_requests": sum(r["failed"] for r in swapped),
        "swap_requests": sum(r["requests"] for r in swapped),
        "steady_failed_requests": sum(r["failed"] for r in steady),
        "swap_p99_ms": median(swapped, "p99_ms"),
        "steady_p99_ms": median(steady, "p99_ms"),
        "swap_max_ms": median(swapped, "max_ms"),
        "steady_max_ms": median(steady, "max_ms"),
        "deploy_s": median(swapped, "deploy_s"),
        "swap_p99_ratio": round(median(swapped, "p99_ms") / median(steady, "p99_ms"), 3),
        "windows": {"steady": steady, "swap": swapped},
    }


# --- set-up ----------------------------------------------------------------------------------


def make_checkpoint(
    storage: Path, hidden: str | None = None, seed: int = 0, name: str = MODEL
) -> str:
    """A digits model registered as the next version of `name` in `storage`."""
    import torch

    from relay import config
    from relay.checkpoints import checkpoint
    from relay.records import registry
    from relay.tasks import build_task

    model_overrides = {"hidden": [int(w) for w in hidden.split(",")]} if hidden else {}
    cfg = config.from_dict({"task": MODEL, "model": model_overrides, "storage": str(storage)})
    torch.manual_seed(seed)
    model = build_task(cfg.task, cfg.size, cfg.model).build_model()
    run_id = f"bench-{name}-{seed}"
    directory = storage / "runs" / run_id / "epoch_0000"
    meta = {"epoch": 1, "metrics": {}, "config": cfg.model_dump(mode="json")}
    checkpoint.save(directory, model, meta=meta)
    entry = {"checkpoint": str(directory), "run_id": run_id, "task": MODEL, "score": None}
    registry.register_version(storage, name, entry)
    return str(directory)


def write_inputs(directory: Path) -> Path:
    from sklearn.datasets import load_digits

    body = directory / "body.json"
    body.write_text(json.dumps({"instances": [load_digits().data[0].tolist()]}))
    os.environ["RELAY_BENCH_BODY"] = str(body)
    script = directory / "post.lua"
    script.write_text(WRK_SCRIPT)
    return script


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plain:
        run_plain_server(args.plain, args.port)
        return
    require_program("wrk", "bench/serve_load.py")
    with scratch("serve") as tmp:
        script = write_inputs(Path(tmp))
        tiny_storage, heavy_storage = Path(tmp, "tiny"), Path(tmp, "heavy")
        tiny_checkpoint = make_checkpoint(tiny_storage)
        make_checkpoint(tiny_storage, name=f"{MODEL}-b")  # for the 2-model side
        make_checkpoint(tiny_storage, seed=1)  # digits:2, for the swaps
        heavy_checkpoint = make_checkpoint(heavy_storage, HEAVY_HIDDEN)
        tiny = heavy = swap = None
        if args.only in (None, "tiny"):
            sides = ["plain", "haproxy", "proxy", "haproxy serve.batch", "haproxy 2 models"]
            sides.append("haproxy conn-failure retry")
            tiny = compare("tiny", sides, tiny_storage, tiny_checkpoint, TINY_LEVELS, args, script)
        if args.only in (None, "heavy"):
            sides = ["plain", "haproxy", "haproxy serve.batch", "haproxy conn-failure retry"]
            heavy = compare(
                "heavy", sides, heavy_storage, heavy_checkpoint, HEAVY_LEVELS, args, script
            )
        if args.only in (None, "swap"):
            swap = swaps(tiny_storage, args, script)
    if args.only:
        print_results({"levels": {"tiny": tiny, "heavy": heavy}, "swap": swap})
        return
    plain, haproxy, proxy = tiny["plain"], tiny["haproxy"], tiny["proxy"]
    summary = {
        "throughput_ratio_c32": round(haproxy[32]["rps"] / plain[32]["rps"], 3),
        "p99_ratio_c32": round(haproxy[32]["p99_ms"] / plain[32]["p99_ms"], 3),
        "p50_gap_ms_c1": round(haproxy[1]["p50_ms"] - plain[1]["p50_ms"], 2),
        "proxy_ratio_c32": round(proxy[32]["rps"] / plain[32]["rps"], 3),
        "two_models_ratio_c32": round(tiny["haproxy 2 models"][32]["rps"] / haproxy[32]["rps"], 3),
        "batched_throughput_ratio_c32": round(
            heavy["haproxy"][32]["rps"] / heavy["plain"][32]["rps"], 3
        ),
        # The same with Ray Serve's own batcher instead of relay's adaptive one.
        "serve_batch_throughput_ratio_c32": round(
            heavy["haproxy serve.batch"][32]["rps"] / heavy["plain"][32]["rps"], 3
        ),
        # relay's retry policy (conn-failure empty-response) against Serve's (conn-failure).
        "retry_p50_gap_ms_c1": round(
            haproxy[1]["p50_ms"] - tiny["haproxy conn-failure retry"][1]["p50_ms"], 2
        ),
        "retry_throughput_ratio_c32": round(
            haproxy[32]["rps"] / tiny["haproxy conn-failure retry"][32]["rps"], 3
        ),
        "retry_batched_ratio_c32": round(
            heavy["haproxy"][32]["rps"] / heavy["haproxy conn-failure retry"][32]["rps"], 3
        ),
        **{key: value for key, value in swap.items() if key != "windows"},
        "swap_windows": swap["windows"],
        "levels": {"tiny": tiny, "heavy": heavy},
        "setup": {
            "models": {"tiny": f"{MODEL} default size", "heavy": f"{MODEL} hidden {HEAVY_HIDDEN}"},
            "seconds_per_level": args.seconds,
            "swap_seconds": args.swap_seconds,
            "repeats": args.repeats,
            "client": "wrk -t1, closed loop",
            "cpus": os.cpu_count(),
        },
    }
    print_results(summary)


if __name__ == "__main__":
    main()
