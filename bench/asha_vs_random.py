""".venv/bin/python bench/asha_vs_random.py [--samples 6] [--epochs 6] [--repeats 2] [--task charlm]
   .venv/bin/python bench/asha_vs_random.py --seeds 0,1,2 --repeats 1    (several searches)
   .venv/bin/python bench/asha_vs_random.py --strategy promote    (ASHA by promotions)

ASHA vs no early stopping over the same random search, on one embedded Ray cluster.

The search is a real random search over several fields (for charlm: `optim.lr` log-uniform,
`batch_size` and the model width `model.d_model` chosen), sampled by the sweep's own Tune search
with a fixed `seed`: every sweep of either arm draws the same trial configs in the same order,
so the only difference between the arms is the scheduler. The bench checks that the configs are
identical across all its sweeps and stops if they are not.

The arms alternate over `--repeats` (full, asha, asha, full, full, asha, ...: each repeat
reverses the order of the one before), so a machine that warms up or slows down during the
bench favours neither arm; each sweep gets a fresh storage root. Each trial is a full relay
trial — a TorchTrainer with its own worker group — so the per-trial start-up is paid in both
arms; it is reported separately, because it bounds what early stopping can save.

Default workload, shrunk so that the 4 sweeps finish in about 8 minutes on a quiet 2-core
machine (estimated, not timed in full: an epoch takes 2.5-5.5 s in plain torch, one thread, and a
trial's start-up 13-35 s): charlm (4-block GPT, width 64 or 128) on a 40 kB slice of the
stdlib corpus, 1 worker per trial (two trials side by side), 6 trials of at most 6 epochs. Smoke
run: `--samples 3 --epochs 2 --repeats 2 --size debug` (~5 minutes: start-ups dominate).

One seed draws one set of configs, and training is deterministic, so repeats of a seed differ
in wall time only: `best_metric_gap` of one seed says how ASHA fared on that one draw. With
`--seeds`, each seed is a search of its own (both arms, `--repeats` sweeps each, the arms
alternating over all the sweeps of the bench); `wall_ratio` and `best_metric_gap` are then the
medians of the per-seed figures, each with its spread, and `per_seed` lists them.

Whether any early stopping can keep the best config is a property of the task: `rank_of_best`
(per seed) names the trial that ends best without stopping and its rank among all trials after
each epoch, from the no-stopping arm's curves (`curves`: each trial's metric per epoch, in every
sweep), and `first_epoch_kept` is the first epoch after which it ranks in the top
samples/reduction_factor, what a rung there keeps. A rung placed earlier stops the best config
whatever the scheduler; the grace period bounds the epochs every trial costs.

Prints, per arm, the median and spread (min–max over repeats) of wall time, epochs trained and
best metric, and ends with one JSON line: `wall_ratio` (median ASHA wall / median no-stopping
wall) and `best_metric_gap` (|median best ASHA - median best no-stopping| / |median best
no-stopping|), with every sweep's own figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from harness import alternated, print_results, scratch, side_spreads, spread, spread_text
from relay.config import sweep_from_dict
from relay.records import history, registry
from relay.runtime import cluster
from relay.tuning import sweep

# The searched fields besides the learning rate: batch size and the model's width.
SEARCH = {
    "charlm": {"batch_size": {"choice": [16, 32]}, "model.d_model": {"choice": [64, 128]}},
    "digits": {"batch_size": {"choice": [32, 64]}, "model.hidden": {"choice": [[64], [256]]}},
}
ARMS = ("full", "asha")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--task", default="charlm", choices=sorted(SEARCH))
    parser.add_argument("--size", default="default")
    parser.add_argument("--model", default='{"corpus_bytes": 40000}', help="JSON model overrides")
    parser.add_argument("--samples", type=int, default=6, help="trials per sweep")
    parser.add_argument("--epochs", type=int, default=6, help="train.epochs: a full trial")
    parser.add_argument("--repeats", type=int, default=2, help="sweeps per arm (>= 2)")
    parser.add_argument("--workers", type=int, default=1, help="DDP workers per trial")
    parser.add_argument("--grace", type=int, default=1)
    parser.add_argument("--reduction-factor", type=float, default=3.0)
    parser.add_argument(
        "--strategy",
        default="stop",
        choices=["stop", "promote"],
        help="asha.strategy of the ASHA arm: Ray's stopping rule, or promotions (pausing)",
    )
    parser.add_argument("--lr-range", default="1e-5,3e-2", help="log-uniform low,high")
    parser.add_argument(
        "--seeds", default="0", help="comma-separated seeds of the search's draws: one search each"
    )
    args = parser.parse_args()
    args.seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.repeats < 1 or args.repeats * len(args.seeds) < 2:
        parser.error(
            "--repeats: at least 2 sweeps per arm in all, so each arm runs first and second"
        )
    return args


def sweep_spec(args, storage: Path, asha: bool, seed: int) -> dict:
    low, high = (float(x) for x in args.lr_range.split(","))
    return {
        "name": "asha" if asha else "full",
        "train": {
            "task": args.task,
            "size": args.size,
            "model": json.loads(args.model),
            "epochs": args.epochs,
            "storage": str(storage),
            "checkpoint": {"keep": 1},
        },
        "search": {"optim.lr": {"loguniform": [low, high]}, **SEARCH[args.task]},
        "num_samples": args.samples,
        "seed": seed,
        "workers_per_trial": args.workers,
        "asha": {
            "enabled": asha,
            "grace_period": args.grace,
            "reduction_factor": args.reduction_factor,
            "strategy": args.strategy,
        },
    }


def trial_runs(storage: Path, trials: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Per trial: its run's record and the epochs the run trained (its history)."""
    records = [registry.get_run(storage, trial["run_id"]) for trial in trials]
    return [(record, history.read(record["run_dir"])) for record in records]


def startup_seconds(runs: list[tuple[dict, list[dict]]]) -> list[float]:
    """Per trial run (from trial_runs) never resumed: from its fit() starting to its first
    training step. (A resumed run's record keeps its last start, after its first epochs: ASHA
    by promotions resumes the trials it promotes.)"""
    out = []
    for record, epochs in runs:
        if epochs and not record.get("resumes"):
            started = datetime.fromisoformat(record["started_at"]).timestamp()
            out.append(epochs[0]["time"] - epochs[0]["epoch_s"] - started)
    return out


def rank_of_best(curves: list[list[float]], mode: str) -> dict:
    """From complete curves (the no-stopping arm): which trial ends best, and its rank among
    all trials after each epoch (1 = best). Early stopping by rungs keeps the eventual best only
    if a rung's ranking puts it in the rung's top 1/reduction_factor, so this says, from the
    task itself rather than from any scheduler, the first epoch a rung could be placed at."""
    sign = 1 if mode == "min" else -1
    finals = [sign * min(sign * v for v in curve) for curve in curves]  # each trial's best
    best = min(range(len(curves)), key=lambda i: sign * finals[i])
    ranks = [
        1 + sum(sign * curve[e] < sign * curves[best][e] for curve in curves)
        for e in range(min(len(curve) for curve in curves))
    ]
    return {"best_trial": best, "rank_by_epoch": ranks}


def trial_index(trial: dict) -> int:
    return int(trial["trial_id"].rsplit("_", 1)[-1])  # Tune's ids end in the draw's number


def run_sweep(args, storage: Path, arm: str, seed: int) -> dict:
    cfg = sweep_from_dict(sweep_spec(args, storage, asha=arm == "asha", seed=seed))
    started = time.perf_counter()
    result = sweep.run(cfg, out=None)
    wall = time.perf_counter() - started
    trials = sorted(result.trials, key=trial_index)
    runs = trial_runs(storage, trials)
    startup = startup_seconds(runs)
    curves = [[epoch[cfg.metric] for epoch in epochs] for _, epochs in runs]  # per epoch trained
    print(
        f"  seed {seed} {arm:<5} {wall:6.1f} s  {sum(t['epochs_run'] for t in trials):3d} epochs  "
        f"best {cfg.metric} {result.best['best_score']:.4f}",
        flush=True,
    )
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": wall,
        "best": result.best["best_score"],
        "best_config": result.best["config"],
        "epochs_trained": sum(t["epochs_run"] for t in trials),
        "epochs_per_trial": [t["epochs_run"] for t in trials],
        "trials_stopped_early": sum(t["status"] == "stopped" for t in trials),
        "startup_s": statistics.median(startup),  # the median trial's
        "configs": [t["config"] for t in trials],
        "curves": curves,  # per trial, the metric after each epoch it trained
        "metric": cfg.metric,
        "mode": cfg.mode,
    }


def describe(config: dict) -> str:
    return " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items()
    )


KEYS = ("wall_s", "epochs_trained", "best", "startup_s")


def arm_spreads(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per arm, the median and spread of each of KEYS over its sweeps in `runs`."""
    return side_spreads(runs, "arm", ARMS, KEYS, flat=True)


def print_search(args, seed: int, configs: list[dict], arms: dict) -> None:
    print(
        f"\nseed {seed}: {args.samples} trials of {args.task}/{args.size}, at most "
        f"{args.epochs} epochs, {args.workers} worker(s) per trial, {args.repeats} sweep(s) "
        "per arm; median (min-max)"
    )
    for i, config in enumerate(configs):
        print(f"  trial {i}: {describe(config)}")
    print(f"{'':18}{'ASHA':>26}{'no stopping':>26}")
    for key, fmt in zip(KEYS, ("{:.1f}", "{:.0f}", "{:.4f}", "{:.1f}"), strict=True):
        cells = [spread_text(s, fmt, f"{key}_") for s in (arms["asha"], arms["full"])]
        print(f"{key:<18}{cells[0]:>26}{cells[1]:>26}")


def main() -> int:
    args = parse_args()
    seed_of_round = [seed for seed in args.seeds for _ in range(args.repeats)]
    # full, asha, asha, full, ... over all the sweeps, whichever seed each round draws with
    order = [(seed_of_round[r], arm) for r, arm in alternated(ARMS, len(seed_of_round))]
    print(
        f"{len(order)} sweeps, in this order: "
        + ", ".join(f"{arm} (seed {seed})" for seed, arm in order),
        flush=True,
    )
    cluster.connect()
    with scratch("asha") as tmp:
        runs = [
            run_sweep(args, Path(tmp) / f"{i}-{arm}", arm, seed)
            for i, (seed, arm) in enumerate(order)
        ]

    per_seed = []
    for seed in args.seeds:
        searches = [run for run in runs if run["seed"] == seed]
        configs = searches[0]["configs"]
        if any(run["configs"] != configs for run in searches):
            print(f"seed {seed}: the sweeps drew different trial configs; the comparison is unfair")
            for run in searches:
                print(f"  {run['arm']}: {run['configs']}")
            return 1
        arms = arm_spreads(searches)
        print_search(args, seed, configs, arms)
        full, asha = arms["full"], arms["asha"]
        complete = next(run for run in searches if run["arm"] == "full")
        ranking = rank_of_best(complete["curves"], complete["mode"])
        # what a rung keeps: the top 1/reduction_factor of the trials ranked there
        kept = max(1, math.floor(args.samples / args.reduction_factor))
        ranking["first_epoch_kept"] = next(
            (e + 1 for e, rank in enumerate(ranking["rank_by_epoch"]) if rank <= kept), None
        )
        print(
            f"the best trial without stopping is trial {ranking['best_trial']}; its rank among "
            f"{args.samples} after each epoch: {ranking['rank_by_epoch']} (a rung keeps the top "
            f"{kept}: first kept after epoch {ranking['first_epoch_kept']})"
        )
        per_seed.append(
            {
                "seed": seed,
                "wall_ratio": asha["wall_s_median"] / full["wall_s_median"],
                "best_metric_gap": abs(asha["best_median"] - full["best_median"])
                / abs(full["best_median"]),
                "asha": asha,
                "no_stopping": full,
                "rank_of_best": ranking,
                "trial_configs": configs,
            }
        )
    wall_ratios = [search["wall_ratio"] for search in per_seed]
    gaps = [search["best_metric_gap"] for search in per_seed]
    if len(per_seed) > 1:
        print(
            f"\nover {len(per_seed)} seeds, median (min-max): wall_ratio "
            f"{spread_text(spread(wall_ratios), '{:.3f}')}, "
            f"best_metric_gap {spread_text(spread(gaps), '{:.4f}')}"
        )
    arms = arm_spreads(runs)
    figures = {
        # one seed: median ASHA wall / median no-stopping wall, and the gap of the medians;
        # several: the medians of those per-seed figures
        "wall_ratio": statistics.median(wall_ratios),
        **spread(wall_ratios, prefix="wall_ratio_"),
        "best_metric_gap": statistics.median(gaps),
        **spread(gaps, prefix="best_metric_gap_"),
        "metric": runs[0]["metric"],
        "asha": arms["asha"],  # over every sweep of the arm, all seeds
        "no_stopping": arms["full"],
        "order": [f"{arm} (seed {seed})" for seed, arm in order],
        "sweeps": [{k: v for k, v in run.items() if k != "configs"} for run in runs],
        "per_seed": per_seed,
        "trials": args.samples,
        "max_epochs": args.epochs,
        "repeats": args.repeats,
        "seeds": args.seeds,
        "task": args.task,
        "size": args.size,
        "model": json.loads(args.model),
        "workers_per_trial": args.workers,
        "asha_settings": {
            "grace_period": args.grace,
            "reduction_factor": args.reduction_factor,
            "strategy": args.strategy,
        },
    }
    print_results(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
