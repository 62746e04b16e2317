""".venv/bin/python bench/checkpoint_upload.py [--layers 16] [--width 2048] [--repeats 3]

What a checkpoint every epoch costs training, copied to storage while training waits
(`checkpoint.upload: sync`) or while it goes on (`async`), against no checkpoint between epochs.

Workload: the memory wall's model (bench/memory_wall.py: digits with `hidden: [2048] x 16`,
63.1 M parameters, ~963 MiB of weights and Adam moments per whole replica) under fsdp on 2
workers (1 CPU each), sharded checkpoints (each rank writes ~half of it), `--epochs` epochs at
batch 64. Storage and the workers' staging directories are on this machine's local disk, so a
copy is a local file copy: with remote storage (S3, NFS) the copy is slower and async has more
to hide.

Three sides, the same config but for the checkpoint settings, alternated over `--repeats`:
  none   `checkpoint.every: epochs`: only the last epoch saves (nothing between epochs)
  sync   every epoch saves and training waits for the copy
  async  every epoch saves; the copy runs beside the next epoch (the last one's is waited for)
Figures per side, from rank 0's epoch records (relay.records.history) of epochs 2..N:
  throughput  training samples/s (the training passes only); none's over async's, minus 1, is
              the step-time hit of a copy running beside training (the issue's goal: <= 5%)
  stall       the time between one epoch's record and the next one's beyond the next epoch's
              own work (`epoch_s`): what a checkpoint (and the report) held training up, per
              epoch
Medians over the epochs of a run, then median and range over repeats.

The last stdout line is one JSON object. About 8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from foreign_cpu import busy_text, fit_watched, warn_if_busy

from harness import alternated_sides, median_of, print_results, relay_home, side_spreads

SIDES = ("none", "sync", "async")


def run_config(args: argparse.Namespace, storage: Path, side: str) -> dict:
    checkpoint: dict[str, Any] = {"keep": 2}
    if side == "none":
        checkpoint["every"] = args.epochs
    else:
        checkpoint["upload"] = side
    return {
        "name": f"upload-{side}",
        "task": "digits",
        "size": "default",
        "model": {"hidden": [args.width] * args.layers, "dropout": 0.0},
        "epochs": args.epochs,
        "batch_size": 64,
        "optim": {"lr": 1e-4},
        "parallel": {"strategy": "fsdp"},
        "checkpoint": checkpoint,
        "scaling": {
            "num_workers": 2,
            "resources_per_worker": {"CPU": 1},
            "threads_per_worker": 1,
        },
        "storage": str(storage),
    }


def measure_run(args: argparse.Namespace, storage: Path, side: str) -> dict[str, Any]:
    from relay.records import history

    result, wall_s, others = fit_watched(run_config(args, storage, side), args.show_progress)
    records = history.read(result.run_dir)
    later = records[1:]  # epoch 1 pays for warm-up, and no copy runs beside it
    stalls = [
        after["time"] - before["time"] - after["epoch_s"]
        for before, after in itertools.pairwise(records)
    ]
    return {
        "side": side,
        "samples_per_s": median_of(later, "samples_per_s"),
        "stall_s": statistics.median(stalls),
        "stalls_s": [round(s, 3) for s in stalls],
        "wall_s": round(wall_s, 1),
        "foreign_cpu_cores": others.cores,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="checkpoint copies: sync vs async vs none")
    parser.add_argument("--layers", type=int, default=16, help="hidden layers (default: 16)")
    parser.add_argument("--width", type=int, default=2048, help="hidden width (default: 2048)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (default: 3)")
    parser.add_argument("--show-progress", action="store_true", help="relay's lines on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with relay_home("upload") as storage:
        # Alternate the order too, so no side always runs first (on a cold page cache).
        for side in alternated_sides(SIDES, args.repeats):
            run = measure_run(args, storage, side)
            runs.append(run)
            print(
                f"{side}: {run['samples_per_s']:,.0f} samples/s, stall "
                f"{run['stall_s']:.2f} s per epoch ({run['stalls_s']}); wall "
                f"{run['wall_s']} s; others' CPU {busy_text(run['foreign_cpu_cores'])}",
                flush=True,
            )

    sides = side_spreads(runs, "side", SIDES, ("samples_per_s", "stall_s"))
    baseline = sides["none"]["samples_per_s"]["median"]

    def hit(side: str) -> float:
        """How much longer a training step took than with nothing between epochs."""
        return baseline / sides[side]["samples_per_s"]["median"] - 1.0

    print_results(
        {
            "bench": "checkpoint_upload",
            "model": {"hidden": [args.width] * args.layers},
            "strategy": "fsdp",
            "workers": 2,
            "epochs": args.epochs,
            "repeats": args.repeats,
            "async_step_time_hit": hit("async"),
            "sync_step_time_hit": hit("sync"),
            "stall_s": {side: sides[side]["stall_s"]["median"] for side in SIDES},
            "sides": sides,
            "runs": runs,
            "busy_runs": warn_if_busy(runs),
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
