""".venv/bin/python bench/search_algorithms.py [--samples 4] [--epochs 8] [--seeds 0,1,2]
                                            [--arms random,tpe,pbt] [--interval 2]
                                            [--search-concurrency 1]

Random search vs TPE vs PBT on the same budget, on one embedded Ray cluster.

Every arm trains `--samples` trials of `--epochs` epochs over the same search space (charlm:
`optim.lr` log-uniform, `optim.weight_decay` uniform; PBT cannot change the model's shape, so
no arm searches it) with ASHA off: the budget is samples x epochs in every arm. PBT's copies
restart trials from a donor's checkpoint, so they add no epochs to that budget; epochs a
stopped Train run had begun past the interval are extra, and `epochs_trained` counts every
epoch each arm really trained (from the runs' histories), so the budget can be checked.

Each arm runs once per seed in `--seeds` (the seed draws the search's configs; for pbt, its
starting population). The order alternates over the seeds (random, tpe, pbt, then reversed,
...), so a machine that warms up or slows down favours no arm; each sweep gets a fresh storage
root. All arms use the same worker settings: 1 worker per trial at `--cpus-per-worker` CPUs.
PBT runs its whole population at once (it compares and copies between live trials); random and
TPE run `--search-concurrency` trials at a time (default 1). A searcher learns only from
finished trials: with every trial started at once, TPE would choose all its configs before
seeing any result — random search with another seed. One at a time, TPE's trials after its
random start-up (relay's: max(2, samples // 4)) are chosen from the results before them.
Random search draws the same configs at any concurrency; it runs as TPE does, so the two
arms' walls compare.

Prints each sweep's best val loss, wall time and epochs, then per arm the median and spread
(min-max over seeds), and ends with one JSON line: per arm `best_median` / `_min` / `_max`,
`wall_s_*`, `epochs_trained_*`, and `best_vs_random` (median best of the arm / median best of
random: below 1 is better, since the metric is val_loss, minimised).

Smoke run: `--samples 2 --epochs 2 --interval 1 --seeds 0 --size debug` (start-ups dominate).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness import alternated, print_results, scratch, side_spreads, spread_text
from relay.config import sweep_from_dict
from relay.records import history, registry
from relay.runtime import cluster
from relay.tuning import sweep

ARMS = ("random", "tpe", "pbt")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[3])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--size", default="debug")
    parser.add_argument("--model", default="{}", help="JSON model overrides")
    parser.add_argument("--samples", type=int, default=4, help="trials per sweep (population)")
    parser.add_argument("--epochs", type=int, default=8, help="train.epochs of every trial")
    parser.add_argument("--interval", type=int, default=2, help="pbt.interval")
    parser.add_argument("--seeds", default="0,1,2", help="one sweep per arm and seed")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    parser.add_argument(
        "--search-concurrency",
        type=int,
        default=1,
        help="trials at a time for random and tpe (pbt: its whole population)",
    )
    parser.add_argument("--lr-range", default="1e-4,3e-2", help="log-uniform low,high")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.arms = args.arms.split(",")
    if unknown := set(args.arms) - set(ARMS):
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(ARMS)}")
    return args


def arm_order(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Each seed runs every arm; every other seed reverses the order."""
    return [(arm, seeds[r]) for r, arm in alternated(arms, len(seeds))]


def sweep_spec(args, storage: Path, arm: str, seed: int) -> dict:
    low, high = (float(x) for x in args.lr_range.split(","))
    return {
        "name": arm,
        "train": {
            "task": args.task,
            "size": args.size,
            "model": json.loads(args.model),
            "epochs": args.epochs,
            "storage": str(storage),
            "scaling": {
                "resources_per_worker": {"CPU": args.cpus_per_worker},
                "threads_per_worker": 1,
            },
        },
        "search": {
            "optim.lr": {"loguniform": [low, high]},
            "optim.weight_decay": {"uniform": [0.0, 0.1]},
        },
        "search_alg": arm,
        "num_samples": args.samples,
        "seed": seed,
        "metric": "val_loss",
        "mode": "min",
        "workers_per_trial": 1,
        "max_concurrent_trials": args.samples if arm == "pbt" else args.search_concurrency,
        "asha": {"enabled": False},
        "pbt": {"interval": args.interval},
    }


def epochs_trained(storage: Path) -> int:
    """Every epoch any run of the sweep trained, restarts and stopped runs included."""
    return sum(
        sum(1 for e in history.read_raw(record["run_dir"]) if "train_loss" in e)
        for record in registry.list_runs(storage)
    )


def run_sweep(args, storage: Path, arm: str, seed: int) -> dict:
    cfg = sweep_from_dict(sweep_spec(args, storage, arm, seed))
    started = time.perf_counter()
    result = sweep.run(cfg, out=None)
    wall = time.perf_counter() - started
    trained = epochs_trained(storage)
    exploits = sum(len(t.get("segments") or [None]) - 1 for t in result.trials)
    print(
        f"  {arm:<6} seed {seed}  {wall:6.1f} s  {trained:3d} epochs  "
        f"best {cfg.metric} {result.best['best_score']:.4f}"
        + (f"  ({exploits} exploits)" if arm == "pbt" else ""),
        flush=True,
    )
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": wall,
        "best": result.best["best_score"],
        "best_config": result.best["config"],
        "epochs_trained": trained,
        "exploits": exploits,
        "metric": cfg.metric,
    }


def main() -> int:
    args = parse_args()
    order = arm_order(args.arms, args.seeds)
    print(f"{len(order)} sweeps: {', '.join(f'{a}/{s}' for a, s in order)}", flush=True)
    cluster.connect()
    with scratch("search") as tmp:
        runs = [
            run_sweep(args, Path(tmp) / f"{i}-{arm}-{seed}", arm, seed)
            for i, (arm, seed) in enumerate(order)
        ]

    keys = ("best", "wall_s", "epochs_trained")
    arms = side_spreads(runs, "arm", args.arms, keys, flat=True)
    budget = args.samples * args.epochs
    print(
        f"\n{args.samples} trials x {args.epochs} epochs of {args.task}/{args.size} per sweep "
        f"(budget {budget} epochs), seeds {args.seeds}; median (min-max)"
    )
    print(f"{'':16}" + "".join(f"{arm:>26}" for arm in args.arms))
    for key, fmt in zip(keys, ("{:.4f}", "{:.1f}", "{:.0f}"), strict=True):
        cells = [spread_text(s, fmt, f"{key}_") for s in arms.values()]
        print(f"{key:<16}" + "".join(f"{c:>26}" for c in cells))
    figures = {
        "metric": runs[0]["metric"],
        "arms": arms,
        "best_vs_random": (
            {
                arm: arms[arm]["best_median"] / arms["random"]["best_median"]
                for arm in args.arms
                if arm != "random"
            }
            if "random" in arms
            else {}
        ),
        "budget_epochs": budget,
        "order": [f"{a}/{s}" for a, s in order],
        "sweeps": runs,
        "trials": args.samples,
        "epochs": args.epochs,
        "pbt_interval": args.interval,
        "seeds": args.seeds,
        "task": args.task,
        "size": args.size,
        "model": json.loads(args.model),
        "cpus_per_worker": args.cpus_per_worker,
        "search_concurrency": args.search_concurrency,
    }
    print_results(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
