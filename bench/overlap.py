""".venv/bin/python bench/overlap.py [--overlaps 0,1] [--repeats 2] [asha_vs_random's options]

Overlapped trials vs not: the wall time of one ASHA sweep when the sweep starts only the trials
the cluster's free resources hold (`overlap: 0`) and when it starts more (`overlap: 1`, ...),
so that a waiting trial's driver, controller and data are ready when a running trial ends and
only its worker group remains to start.

The sweeps are `bench/asha_vs_random.py`'s ASHA arm (its defaults: charlm, 6 trials of at most
6 epochs, 1 worker per trial, a seeded random search: every sweep draws the same configs, and
the bench stops if they differ), on one embedded Ray cluster, each with a fresh storage root.
The sides alternate over the repeats (0, 1, 1, 0, ...). What is compared is the sweep's wall
time (`sweep.run`, start to end), not `startup_s`: an overlapped trial's start-up includes its
wait for resources.

Ends with one JSON line: per side the median (min–max) wall time, epochs trained and best
metric, and `wall_ratio` (median wall with the largest overlap / with overlap 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import asha_vs_random as base  # bench/ is the script's directory, so on sys.path

from harness import alternated_sides, print_results, scratch, side_spreads, spread_text
from relay.config import sweep_from_dict
from relay.runtime import cluster
from relay.tuning import sweep


def parse_args() -> argparse.Namespace:
    sys.argv, own = base_argv(sys.argv)
    args = base.parse_args()
    args.overlaps = [int(x) for x in own.overlaps.split(",")]
    return args


def base_argv(argv: list[str]) -> tuple[list[str], argparse.Namespace]:
    """This bench's own option; the rest go to asha_vs_random's parser."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--overlaps", default="0,1", help="sweep.overlap values compared")
    own, rest = parser.parse_known_args(argv[1:])
    return [argv[0], *rest], own


def run_sweep(args, storage: Path, overlap: int) -> dict:
    spec = base.sweep_spec(args, storage, asha=True)
    cfg = sweep_from_dict({**spec, "name": f"overlap{overlap}", "overlap": overlap})
    started = time.perf_counter()
    result = sweep.run(cfg, out=None)
    wall = time.perf_counter() - started
    trials = sorted(result.trials, key=base.trial_index)
    epochs = sum(t["epochs_run"] for t in trials)
    print(
        f"  overlap {overlap}  {wall:6.1f} s  {epochs:3d} epochs  "
        f"best {cfg.metric} {result.best['best_score']:.4f}",
        flush=True,
    )
    return {
        "overlap": overlap,
        "wall_s": wall,
        "epochs_trained": epochs,
        "best": result.best["best_score"],
        "startup_s": statistics.median(base.startup_seconds(base.trial_runs(storage, trials))),
        "configs": [t["config"] for t in trials],
    }


def main() -> int:
    args = parse_args()
    sequence = alternated_sides(args.overlaps, args.repeats)
    print(f"{len(sequence)} ASHA sweeps, overlap in this order: {sequence}", flush=True)
    cluster.connect()
    with scratch("overlap") as tmp:
        runs = [run_sweep(args, Path(tmp) / f"{i}-{o}", o) for i, o in enumerate(sequence)]
    if any(r["configs"] != runs[0]["configs"] for r in runs):
        print("the sweeps drew different trial configs; the comparison would be unfair")
        return 1
    keys = ("wall_s", "epochs_trained", "best", "startup_s")
    by_overlap = side_spreads(runs, "overlap", args.overlaps, keys, flat=True)
    sides = {str(o): spreads for o, spreads in by_overlap.items()}
    print(f"\n{'':16}" + "".join(f"{'overlap ' + str(o):>24}" for o in args.overlaps))
    for key in keys:
        cells = [spread_text(s, "{:.4g}", f"{key}_") for s in sides.values()]
        print(f"{key:<16}" + "".join(f"{c:>24}" for c in cells))
    low, high = str(min(args.overlaps)), str(max(args.overlaps))
    figures = {
        "wall_ratio": sides[high]["wall_s_median"] / sides[low]["wall_s_median"],
        "compared": [int(low), int(high)],
        "sides": sides,
        "order": sequence,
        "sweeps": [{k: v for k, v in r.items() if k != "configs"} for r in runs],
        "trials": args.samples,
        "max_epochs": args.epochs,
        "repeats": args.repeats,
        "task": args.task,
        "size": args.size,
        "workers_per_trial": args.workers,
    }
    print_results(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
