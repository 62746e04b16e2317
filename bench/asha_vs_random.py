""".venv/bin/python bench/asha_vs_random.py [--samples 6] [--epochs 6] [--task charlm]

ASHA vs no early stopping over the same trials, in one run on one embedded Ray cluster.

Both arms get exactly the same trial configs: the learning rates are drawn once, up front
(log-uniform, seeded) and given to both sweeps as a grid, so the only difference is the
scheduler. Each trial is a full relay trial — a TorchTrainer with its own worker group — so the
per-trial start-up (worker group, process group, Ray Data shards) is paid in both arms and is
measured and reported separately: it bounds what early stopping can save.

Default workload: charlm (a 4-block GPT, 128-wide) on a 100 kB slice of the stdlib corpus,
1 worker per trial (so two trials run side by side on a 2-core machine), 6 epochs of ~10 s;
about 6 minutes in all on 2 cores.

Prints wall time, epochs trained and best metric of each arm, the per-trial start-up, and ends
with one JSON line: `wall_ratio` (ASHA / no stopping) and `best_metric_gap` (relative
difference of the best metrics, |asha - full| / |full|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from relay import cluster, history, registry, sweep
from relay.config import sweep_from_dict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--size", default="default")
    parser.add_argument("--model", default='{"corpus_bytes": 100000}', help="JSON model overrides")
    parser.add_argument("--samples", type=int, default=6, help="trials per arm")
    parser.add_argument("--epochs", type=int, default=6, help="max_t: epochs of a full trial")
    parser.add_argument("--workers", type=int, default=1, help="DDP workers per trial")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--grace", type=int, default=1)
    parser.add_argument("--reduction-factor", type=float, default=3.0)
    parser.add_argument("--lr-range", default="1e-5,3e-2", help="log-uniform low,high")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def sweep_spec(args, storage: Path, lrs: list[float], asha: bool) -> dict:
    return {
        "name": "asha" if asha else "full",
        "train": {
            "task": args.task,
            "size": args.size,
            "model": json.loads(args.model),
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "storage": str(storage),
            "checkpoint": {"keep": 1},
        },
        "search": {"optim.lr": {"grid": lrs}},
        "num_samples": 1,
        "workers_per_trial": args.workers,
        "asha": {
            "enabled": asha,
            "max_t": args.epochs,
            "grace_period": args.grace,
            "reduction_factor": args.reduction_factor,
        },
    }


def startup_seconds(storage: Path, result) -> list[float]:
    """Per trial: from the trial's fit() starting to its first training step."""
    out = []
    for trial in result.trials:
        record = registry.get_run(storage, trial["run_id"])
        epochs = history.read(record["run_dir"])
        if epochs:
            started = datetime.fromisoformat(record["started_at"]).timestamp()
            out.append(epochs[0]["time"] - epochs[0]["epoch_s"] - started)
    return out


def run_arm(args, storage: Path, lrs: list[float], asha: bool) -> dict:
    cfg = sweep_from_dict(sweep_spec(args, storage, lrs, asha))
    started = time.perf_counter()
    result = sweep.run(cfg, out=None)
    wall = time.perf_counter() - started
    startup = startup_seconds(storage, result)
    return {
        "wall_s": wall,
        "best": result.best["best_score"],
        "best_lr": result.best["config"]["optim.lr"],
        "epochs_trained": sum(t["epochs_run"] for t in result.trials),
        "trials_stopped_early": sum(t["status"] == "stopped" for t in result.trials),
        "startup_s_median": statistics.median(startup) if startup else None,
        "metric": cfg.metric,
        "mode": cfg.mode,
    }


def main() -> int:
    args = parse_args()
    low, high = (float(x) for x in args.lr_range.split(","))
    rng = np.random.default_rng(args.seed)
    # In the order drawn, as a random search would try them (sorted, every weak trial would
    # run before any strong one and ASHA would have nothing to compare against).
    lrs = [float(x) for x in np.exp(rng.uniform(np.log(low), np.log(high), args.samples))]
    cluster.connect()
    with tempfile.TemporaryDirectory(prefix="relay-bench-asha-") as tmp:
        full = run_arm(args, Path(tmp) / "full", lrs, asha=False)
        asha = run_arm(args, Path(tmp) / "asha", lrs, asha=True)

    print(
        f"\n{args.samples} trials of {args.task}/{args.size}, max_t {args.epochs} epochs, "
        f"{args.workers} worker(s) per trial; learning rates {[f'{x:.2g}' for x in lrs]}"
    )
    print(f"{'':24}{'ASHA':>12}{'no stopping':>14}")
    for key, fmt in (
        ("wall_s", "{:.1f} s"),
        ("epochs_trained", "{}"),
        ("trials_stopped_early", "{}"),
        ("best", "{:.4f}"),
        ("best_lr", "{:.2g}"),
        ("startup_s_median", "{:.1f} s"),
    ):
        print(f"{key:<24}{fmt.format(asha[key]):>12}{fmt.format(full[key]):>14}")
    figures = {
        "wall_ratio": asha["wall_s"] / full["wall_s"],
        "best_metric_gap": abs(asha["best"] - full["best"]) / abs(full["best"]),
        "metric": full["metric"],
        "asha": asha,
        "no_stopping": full,
        "trials": args.samples,
        "max_t": args.epochs,
        "task": args.task,
        "size": args.size,
        "model": json.loads(args.model),
        "workers_per_trial": args.workers,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
