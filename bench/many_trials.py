""".venv/bin/python bench/many_trials.py [--trials 100] [--repeats 2]

A random search of many short trials: relay's sweep against Optuna alone in one process running
the same epoch code (the floor a sweep of small models is held to).

  relay    `relay.tuning.sweep.run`: `--trials` random configs of optim.lr (log-uniform), one
           worker each (so each trains in its Tune trial's actor), 1 epoch of digits (debug
           size), ASHA off, as many at once as the cluster's CPUs hold (one per core).
  optuna   one Python process: an Optuna study (RandomSampler, the same range) whose objective
           trains the same epoch with relay's own code, imported, not restated
           (relay.parallel.Engine, relay.training.epochs: optimizer, schedule, cached batches,
           passes), on the split loaded once, torch using every core, trials one after another.

Each side is a fresh child process, timed from its start to its end (imports and, for relay,
its cluster's start included: what a user waits for). Sides alternate over the repeats (A B B A
...). Prints per side the median (min–max) wall and seconds per trial, then one JSON line:
`wall_ratio` (relay's median wall / optuna's), each side's figures, the best val_accuracy each
found.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness import alternated_sides, print_results, scratch, spread

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LR_RANGE = (1e-4, 1e-1)
TASK = {"task": "digits", "size": "debug", "epochs": 1, "batch_size": 32}


def relay_side(trials: int, storage: Path, seed: int) -> dict:
    from relay.config import sweep_from_dict
    from relay.tuning import sweep

    spec = {
        "name": "many-trials",
        "train": {**TASK, "storage": str(storage), "checkpoint": {"keep": 1}},
        "search": {"optim.lr": {"loguniform": list(LR_RANGE)}},
        "num_samples": trials,
        "seed": seed,
        "workers_per_trial": 1,
        "asha": {"enabled": False},
    }
    cfg = sweep_from_dict(spec)
    assert sweep.trains_in_actor(cfg)
    result = sweep.run(cfg, out=None)
    scores = [t["best_score"] for t in result.trials if t["best_score"] is not None]
    return {"trials": len(result.trials), "best": max(scores), "scored": len(scores)}


def optuna_side(trials: int, seed: int) -> dict:
    import optuna
    import torch

    from relay import parallel
    from relay.config import from_dict
    from relay.tasks import build_task
    from relay.training.epochs import (
        CachedBatches,
        Epochs,
        build_scheduler,
        optimizer_spec,
        steps_per_epoch,
        to_tensors,
    )

    base = from_dict(TASK)
    task = build_task(base.task, base.size, base.model, base.data.path)
    split = task.load_data(base.data.val_fraction, base.seed)  # once, as relay's sweep does
    train_rows = len(next(iter(split.train.values())))
    torch.set_num_threads(os.cpu_count() or 1)

    def batches(columns, shuffle: bool) -> CachedBatches:
        tensors = to_tensors(columns, task.input_columns(), parallel.device())
        return CachedBatches(tensors, batch_size=base.batch_size, shuffle=shuffle, seed=base.seed)

    def objective(trial) -> float:
        lr = trial.suggest_float("lr", *LR_RANGE, log=True)
        cfg = from_dict({**TASK, "optim": {"lr": lr}})
        torch.manual_seed(cfg.seed)
        engine = parallel.Engine(task.build_model(), cfg.parallel, *optimizer_spec(cfg.optim))
        steps = steps_per_epoch(train_rows, 1, cfg.batch_size, cfg.parallel.grad_accum)
        scheduler = build_scheduler(cfg.schedule, engine.optimizer, steps, cfg.epochs)
        epochs = Epochs(task, engine, scheduler, cfg)
        train, val = batches(split.train, cfg.data.shuffle), batches(split.val, False)
        metrics = {}
        for epoch in range(1, cfg.epochs + 1):
            metrics = epochs.epoch(epoch, train.epoch(epoch), val.epoch(epoch))
        return metrics["val_accuracy"]

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed))
    study.optimize(objective, n_trials=trials)
    return {
        "trials": len(study.trials),
        "best": study.best_value,
        "threads": torch.get_num_threads(),
    }


def child(side: str, trials: int, seed: int, out: Path) -> None:
    started = time.time()
    with scratch("many-trials") as tmp:
        if side == "relay":
            os.environ["RELAY_HOME"] = tmp
            os.environ["RAY_ADDRESS"] = "local"
            figures = relay_side(trials, Path(tmp) / "storage", seed)
            import ray

            ray.shutdown()
        else:
            figures = optuna_side(trials, seed)
    out.write_text(json.dumps({**figures, "in_process_s": time.time() - started}))


def run_child(side: str, args: argparse.Namespace, tmp: Path, seed: int) -> dict:
    out = tmp / f"{side}-{time.monotonic_ns()}.json"
    argv = [sys.executable, str(HERE / "many_trials.py"), "--child", side, "--out", str(out)]
    argv += ["--trials", str(args.trials), "--seed", str(seed)]
    began = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    wall_s = time.perf_counter() - began
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"the {side} child exited {proc.returncode}")
    return {"side": side, "seed": seed, "wall_s": wall_s, **json.loads(out.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--trials", type=int, default=100, help="trials per sweep (default 100)")
    parser.add_argument("--repeats", type=int, default=2, help="sweeps per side (default 2)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("relay", "optuna"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.trials, args.seed, Path(args.out))
        return 0
    sides = ["relay", "optuna"]
    sequence = alternated_sides(sides, args.repeats)
    print(f"{len(sequence)} sweeps of {args.trials} trials: {', '.join(sequence)}", flush=True)
    rounds = []
    with scratch("many-trials-parent") as tmp:
        for i, side in enumerate(sequence):
            seed = i // len(sides)  # each repeat's pair draws the same configs
            rounds.append(run_child(side, args, Path(tmp), seed))
            r = rounds[-1]
            print(
                f"  {side:<7} {r['wall_s']:6.1f} s  best val_accuracy {r['best']:.4f}", flush=True
            )
    figures = {}
    for side in sides:
        mine = [r for r in rounds if r["side"] == side]
        figures[side] = {
            "wall_s": spread(r["wall_s"] for r in mine),
            "per_trial_s": spread(r["wall_s"] / args.trials for r in mine),
            "best_val_accuracy": spread(r["best"] for r in mine),
        }
        w = figures[side]["wall_s"]
        print(f"{side:<7} wall {w['median']:.1f} s ({w['min']:.1f}-{w['max']:.1f})")
    ratio = figures["relay"]["wall_s"]["median"] / figures["optuna"]["wall_s"]["median"]
    print(f"relay / optuna wall: {ratio:.2f}")
    print_results(
        {
            "wall_ratio": ratio,
            "trials": args.trials,
            "repeats": args.repeats,
            "task": "digits",
            "size": "debug",
            "epochs": 1,
            "optuna_threads": rounds[[r["side"] for r in rounds].index("optuna")]["threads"],
            "sides": figures,
            "rounds": rounds,
            "order": sequence,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
