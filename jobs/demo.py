"""The whole path on one embedded Ray cluster: train → ASHA sweep → serve the best → HTTP.

    make demo                      # or: .venv/bin/python jobs/demo.py [--quick]

1. trains `digits` with 2 DDP workers (jobs/configs/digits.yaml), one line per epoch;
2. runs a small ASHA sweep over the learning rate and width (each trial its own TorchTrainer);
3. serves `digits:best` — the best of all registered versions — with Ray Serve on 127.0.0.1;
4. sends the whole digits test split over real HTTP (batched requests) — images that neither
   training nor checkpoint selection saw (`Task.load_test`) — and prints the test accuracy;
5. shuts Serve and the cluster down.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


REQUEST_INSTANCES = 64  # images per HTTP request (the server's limit is 256)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def main() -> int:
    parser = argparse.ArgumentParser(description="train → tune → serve, end to end")
    parser.add_argument("--quick", action="store_true", help="debug sizes and few epochs")
    args = parser.parse_args()

    import ray
    from ray import serve

    import relay
    from relay.config import load_sweep
    from relay.runtime import cluster
    from relay.serving.app import AppArgs, build, resolve_models
    from relay.tasks import build_task
    from relay.tuning import sweep

    quick = ["size=debug", "epochs=3"] if args.quick else []
    cluster.connect()

    print("== 1. train digits with 2 DDP workers")
    trained = relay.train(relay.load_config(REPO / "jobs/configs/digits.yaml", quick))

    print("\n== 2. ASHA sweep (every trial is its own TorchTrainer run)")
    sweep_overrides = ["num_samples=4", "workers_per_trial=1", "train.epochs=6"]
    if args.quick:
        sweep_overrides += ["train.size=debug", "train.epochs=3", "asha.grace_period=1"]
    tuned = sweep.run(load_sweep(REPO / "jobs/configs/digits-sweep.yaml", sweep_overrides))

    print("\n== 3. serve digits:best on 127.0.0.1")
    port = free_port()
    app_args = AppArgs(model="digits:best")  # same storage root as the runs: $RELAY_HOME, ~/relay
    (info,) = resolve_models(app_args)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build([info], app_args), name="relay-demo", route_prefix="/")
    base = f"http://127.0.0.1:{port}/v1/models/{info.name}"
    print(f"serving {info.reference} (train run {trained.model}, sweep best {tuned.model})")

    print(f"\n== 4. POST {base}:predict: the test split, unseen by training and selection")
    test = build_task("digits", "default").load_test()
    images, labels = test["x"], test["y"].tolist()
    predictions = []
    for start in range(0, len(images), REQUEST_INSTANCES):
        chunk = images[start : start + REQUEST_INSTANCES]
        reply = post(f"{base}:predict", {"instances": [{"pixels": img.tolist()} for img in chunk]})
        predictions += reply["predictions"]
    for label, prediction in zip(labels[:8], predictions[:8], strict=True):
        confidence = max(prediction["probabilities"])
        print(f"  true {label}  predicted {prediction['label']}  ({confidence:.0%})")
    correct = sum(p["label"] == label for p, label in zip(predictions, labels, strict=True))
    requests = -(-len(images) // REQUEST_INSTANCES)
    print(
        f"  test accuracy {correct / len(labels):.4f}: {correct}/{len(labels)} images correct "
        f"({requests} requests of up to {REQUEST_INSTANCES})"
    )
    bad = urllib.request.Request(
        f"{base}:predict", b'{"instances": [[99]]}', {"Content-Type": "application/json"}
    )
    try:
        urllib.request.urlopen(bad, timeout=30)
    except urllib.error.HTTPError as exc:
        print(f"  a bad request gets {exc.code}: {json.load(exc)['error']}")

    print("\n== 5. shut down")
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
