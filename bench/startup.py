""".venv/bin/python bench/startup.py [--repeats 3] [--workers 2] [--sides relay ray_defaults]

Per-run start-up: what relay adds between `fit()` and the first training step over Ray Train's
own floor, and what relay's run switches (`relay.runtime.cluster.RUN_SWITCHES`) save, in one bench
run.

Each round is a fresh child process (`--child SIDE`) that starts its own local Ray cluster
(`relay.runtime.cluster.connect`) and, after one uncounted warm-up run (a 1-worker floor: the first
Train run after `ray.init` pays for cold caches), runs in this order:

  floor   a bare `TorchTrainer` with the same workers and resources per worker as relay's run,
          whose loop only reports once (no data, no model): `fit()` → the loop's first line.
  run     `relay.training.driver.fit` of a small task (digits, debug size, 1 epoch): `fit()` → the
  end
          of the first training step (the efficiency report's `startup.total_s`, which starts
          when relay's fit() starts: connect, prepare, worker group, model and data, first step).
  trial   a 1-trial sweep through `relay.tuning.sweep.run` (the same task, 1 epoch): inside the Tune
          trial, relay's `fit()` → the end of its first step, from that trial's run record.
  trials_actor, trials_group
          a sweep of 4 one-worker trials, one at a time (the same task, 1 epoch each), its
          trials trained in their Tune actors (`in_actor`, relay's default for one worker) or
          each by a TorchTrainer of its own (`in_actor: false`). Per trial after the first:
          `gap` (the previous trial's run finished → this trial's first epoch begins: all a
          sequential sweep pays per trial) and `startup` (its fit() → first epoch begins).

A Train callback (`Marks`, here) stamps, on the controller, when it started and when its worker
group began and finished starting (placement group, worker actors, torch process group): so
each row splits into controller / worker group / launch (worker group ready → the loop's first
line) / model and data / first step. The trial's controller gets the callback through
`RAY_TRAIN_CALLBACKS` (its module imported as `bench.startup` from the repository root, which
relay's local runtime env puts on the workers' PYTHONPATH).

Sides (`--sides`), alternated over the repeats (A B B A A B ...) so a load that drifts weighs on
both alike; each side is the environment its child process (and so its cluster) starts with:
  relay          relay's switches, as `connect()` sets them.
  ray_defaults   every RUN_SWITCHES variable set explicitly to Ray's default (so connect()
                 leaves it): Ray's behaviour.
  no_<VAR>       relay's switches except VAR at Ray's default: what that one switch saves
                 (e.g. `--sides relay no_RAY_TRAIN_ENABLE_PREEMPTION_WATCHER --runs run`).
Every child also counts the actors its cluster created (Ray's state API), by class: the
switches' effect made visible (e.g. no PreemptionWatcher on the relay side).

Prints per side the median (min–max) over repeats of each figure and component, then one JSON
line: `trial_startup_s` (relay side, median), `floor_s` (the bare TorchTrainer on Ray's
defaults; on the relay side when that side is not run), `run_startup_s`, each side's figures,
and per figure what the relay side saves over each other side (median difference). Default:
3 repeats × 2 sides, about 7 minutes on a 2-core machine (a round: ~70 s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import alternated_sides, print_results, scratch, spread
from relay.runtime.cluster import RUN_SWITCHES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Ray 2.60's value for each relay switch: every one turns off ("0") what Ray has on by default
# (ray/train/v2/_internal/constants.py, ray/train/constants.py).
RAY_DEFAULTS = {key: "1" for key in RUN_SWITCHES}
MARKS_ENV = "RELAY_BENCH_STARTUP_MARKS"
RUNS = ("floor", "run", "trial", "trials_actor", "trials_group")
TRIALS = 4  # per trials_* sweep


# --- on the controller: when it and its worker group started ----------------------------------


def _marks_base():
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    return ControllerCallback, WorkerGroupCallback


class Marks(*_marks_base()):
    """Appends {"event", "time"} lines to `<marks dir>/<Train run name>.jsonl`; constructed
    where fit() runs (the directory from MARKS_ENV there), called on the controller."""

    def __init__(self) -> None:
        self.directory = os.environ.get(MARKS_ENV)
        self.run_name = None

    def _stamp(self, event: str) -> None:
        if self.directory and self.run_name:
            with open(Path(self.directory) / f"{self.run_name}.jsonl", "a") as f:
                f.write(json.dumps({"event": event, "time": time.time()}) + "\n")

    def after_controller_start(self, train_run_context) -> None:
        self.run_name = train_run_context.get_run_config().name
        self._stamp("controller_started")

    def before_worker_group_start(self, worker_group_context) -> None:
        self._stamp("worker_group_begins")

    def after_worker_group_start(self, worker_group) -> None:
        self._stamp("worker_group_ready")


def read_marks(directory: Path, run_name: str) -> dict[str, float]:
    """The first time of each event (a restarted group would stamp again; none is expected)."""
    marks: dict[str, float] = {}
    path = directory / f"{run_name}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        marks.setdefault(record["event"], record["time"])
    return marks


def components(fit_at: float, marks: dict[str, float], loop_at: float) -> dict[str, float]:
    """fit() → controller up → worker group begins → ready → the loop's first line."""
    return {
        "controller_s": marks["controller_started"] - fit_at,
        "worker_group_s": marks["worker_group_ready"] - marks["controller_started"],
        "launch_s": loop_at - marks["worker_group_ready"],
    }


# --- in a child: one cluster, one side ------------------------------------------------------


def floor_run(workers: int, resources: dict | None, storage: Path, name: str) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    def loop(config: dict) -> dict:
        import time

        import ray.train

        first_line_at = time.time()
        ray.train.report({"step": 0})
        return {"first_line_at": first_line_at}

    trainer = TorchTrainer(
        loop,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker=resources),
        run_config=ray.train.RunConfig(name=name, storage_path=str(storage), callbacks=[Marks()]),
    )
    fit_at = time.time()
    result = trainer.fit()
    loop_at = result.return_value["first_line_at"]
    marks = read_marks(Path(os.environ[MARKS_ENV]), name)
    return {"total_s": loop_at - fit_at, **components(fit_at, marks, loop_at)}


def relay_parts(record: dict, marks: dict[str, float]) -> dict:
    """A relay run's start-up from its record (the efficiency report) and the controller marks."""
    from datetime import datetime

    startup = record["efficiency"]["startup"]
    started = datetime.fromisoformat(record["started_at"]).timestamp()
    fit_at = started + startup["connect_s"] + startup["prepare_s"]  # TorchTrainer.fit()
    loop_at = fit_at + startup["worker_group_s"]
    return {
        "total_s": startup["total_s"],  # relay's fit() → the end of the first step
        "prepare_s": startup["connect_s"] + startup["prepare_s"],
        **components(fit_at, marks, loop_at),
        "model_and_data_s": startup["model_and_data_s"],
        "first_step_s": startup["first_step_s"],
        "to_loop_s": loop_at - started,  # relay's fit() → the loop's first line: the floor's span
    }


def task_settings(workers: int, storage: Path) -> dict:
    return {
        "name": "startup",
        "task": "digits",
        "size": "debug",
        "epochs": 1,
        "storage": str(storage),
        "scaling": {"num_workers": workers},
        "checkpoint": {"keep": 1},
    }


def relay_run(workers: int, storage: Path) -> dict:
    import relay.config
    from relay.records import registry
    from relay.training import driver

    cfg = relay.config.from_dict(task_settings(workers, storage))
    result = driver.fit(cfg, out=None, register=False, callbacks=[Marks()])
    record = registry.get_run(storage, result.run_id)
    return relay_parts(record, read_marks(Path(os.environ[MARKS_ENV]), result.run_id))


def trial_run(workers: int, storage: Path) -> dict:
    from relay.config import sweep_from_dict
    from relay.records import registry
    from relay.tuning import sweep

    spec = {
        "name": "startup",
        "train": task_settings(workers, storage),
        "search": {"optim.lr": {"choice": [1e-3]}},
        "num_samples": 1,
        "asha": {"enabled": False},
    }
    result = sweep.run(sweep_from_dict(spec), out=None)
    (trial,) = result.trials
    record = registry.get_run(storage, trial["run_id"])
    return relay_parts(record, read_marks(Path(os.environ[MARKS_ENV]), trial["run_id"]))


def sequential_trials(storage: Path, in_actor: bool) -> dict:
    """A sweep of TRIALS one-worker trials, one at a time: medians over trials 2..TRIALS."""
    from datetime import datetime
    from statistics import median

    from relay.config import sweep_from_dict
    from relay.records import registry
    from relay.tuning import sweep

    spec = {
        "name": f"startup-{'actor' if in_actor else 'group'}",
        "train": task_settings(1, storage),
        "search": {"optim.lr": {"grid": [1e-3 * (i + 1) for i in range(TRIALS)]}},
        "num_samples": 1,
        "max_concurrent_trials": 1,
        "asha": {"enabled": False},
        "in_actor": in_actor,
    }
    cfg = sweep_from_dict(spec)
    assert sweep.trains_in_actor(cfg) == in_actor
    result = sweep.run(cfg, out=None)
    records = [registry.get_run(storage, t["run_id"]) for t in result.trials]
    records.sort(key=lambda r: r["started_at"])

    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp).timestamp()

    later = list(itertools.pairwise(records))
    gaps = [at(r["started_at"]) + r["startup_s"] - at(prev["finished_at"]) for prev, r in later]
    return {
        "gap_s": median(gaps),
        "startup_s": median(r["startup_s"] for _, r in later),
        "first_startup_s": records[0]["startup_s"],
    }


def actor_counts() -> dict[str, int]:
    # From the GCS: the state API needs the dashboard, which relay's clusters do not start.
    from relay.runtime import ray_private

    return ray_private.actors_by_class()


def child(args: argparse.Namespace) -> None:
    """One side: start a cluster, warm up, measure each run once, write the figures."""
    from relay.runtime import cluster

    with scratch("startup") as tmp:
        marks, storage = Path(tmp) / "marks", Path(tmp) / "runs"
        marks.mkdir()
        storage.mkdir()
        os.environ[MARKS_ENV] = str(marks)
        # The trial's controller gets Marks from where Tune runs fit(): inherited by the cluster.
        os.environ["RAY_TRAIN_CALLBACKS"] = "bench.startup.Marks"
        started = time.time()
        cluster.connect()
        connect_s = time.time() - started
        import ray

        os.environ.pop("RAY_TRAIN_CALLBACKS")  # here Marks is passed to fit() directly
        resources = {"CPU": 1.0}  # relay's default per worker (ScalingConfig.cpus_per_worker)
        out: dict[str, Any] = {"side": args.child, "connect_s": connect_s}
        floor_run(1, resources, storage / "warmup", "warmup")  # 1 worker: cheaper, as warm
        for name in args.runs:
            if name == "floor":
                out["floor"] = floor_run(args.workers, resources, storage / "floor", "floor")
            elif name == "run":
                out["run"] = relay_run(args.workers, storage)
            elif name == "trial":  # Tune's trial actor calls fit(): RAY_TRAIN_CALLBACKS is set
                out["trial"] = trial_run(args.workers, storage)
            else:
                out[name] = sequential_trials(storage / name, in_actor=name == "trials_actor")
        out["actors"] = actor_counts()
        out["switches"] = {key: os.environ.get(key) for key in RAY_DEFAULTS}
        ray.shutdown()
    Path(args.out).write_text(json.dumps(out))


# --- the parent: sides alternated, figures summarised ---------------------------------------


def side_env(side: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *RAY_DEFAULTS)}
    env["RAY_ADDRESS"] = "local"
    env.pop("RAY_TRAIN_CALLBACKS", None)
    if side == "ray_defaults":
        env.update(RAY_DEFAULTS)
    elif side.startswith("no_"):
        key = side.removeprefix("no_")
        env[key] = RAY_DEFAULTS[key]
    return env


def run_child(side: str, args: argparse.Namespace, home: Path) -> dict:
    out = home / f"{side}-{time.monotonic_ns()}.json"
    env = {**side_env(side), "RELAY_HOME": str(home)}
    argv = [sys.executable, str(HERE / "startup.py"), "--child", side, "--out", str(out)]
    argv += ["--workers", str(args.workers), "--runs", *args.runs]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"the {side} child exited {proc.returncode}")
    return json.loads(out.read_text())


def summarise(rounds: list[dict], sides: list[str], runs: list[str]) -> dict:
    out: dict[str, Any] = {}
    for side in sides:
        mine = [r for r in rounds if r["side"] == side]
        figures: dict[str, Any] = {"connect_s": spread([r["connect_s"] for r in mine])}
        for run in runs:
            keys = mine[0][run].keys()
            figures[run] = {k: spread([r[run][k] for r in mine]) for k in keys}
        actors = Counter()
        for r in mine:
            actors.update(r["actors"])
        figures["actors_per_round"] = {k: v / len(mine) for k, v in sorted(actors.items())}
        out[side] = figures
    return out


def cell(s: dict[str, float]) -> str:
    return f"{s['median']:5.2f} ({s['min']:.2f}-{s['max']:.2f})"


def print_table(summary: dict, sides: list[str], runs: list[str]) -> None:
    width = 24
    print(
        f"\nmedian (min-max) seconds over repeats\n{'':30}"
        + "".join(f"{s:>{width}}" for s in sides)
    )
    print(
        f"{'connect (ray.init)':30}"
        + "".join(f"{cell(summary[s]['connect_s']):>{width}}" for s in sides)
    )
    for run in runs:
        for key in summary[sides[0]][run]:
            label = f"{run} {key.removesuffix('_s')}"
            print(f"{label:30}" + "".join(f"{cell(summary[s][run][key]):>{width}}" for s in sides))
    print("actors started per round (by class):")
    for side in sides:
        actors = ", ".join(f"{k} {v:g}" for k, v in summary[side]["actors_per_round"].items())
        print(f"  {side}: {actors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--repeats", type=int, default=3, help="rounds per side (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="Train workers of every run")
    parser.add_argument("--sides", nargs="+", default=["relay", "ray_defaults"])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the workers import `bench.startup` from here (relay's local runtime env)
    if args.child:
        child(args)
        return 0
    for side in args.sides:
        if side not in ("relay", "ray_defaults") and side.removeprefix("no_") not in RAY_DEFAULTS:
            parser.error(f"--sides: unknown side {side!r}")
    sequence = alternated_sides(args.sides, args.repeats)
    print(
        f"{len(sequence)} rounds: {', '.join(sequence)}; runs {', '.join(args.runs)}, "
        f"{args.workers} workers",
        flush=True,
    )
    rounds = []
    with scratch("startup-home") as home:
        for side in sequence:
            began = time.perf_counter()
            result = run_child(side, args, Path(home))
            rounds.append(result)
            shown = "  ".join(
                f"{run} {result[run].get('total_s', result[run].get('gap_s')):.2f} s"
                for run in args.runs
            )
            print(f"  {side:<14} {shown}  ({time.perf_counter() - began:.0f} s)", flush=True)
    summary = summarise(rounds, args.sides, args.runs)
    print_table(summary, args.sides, args.runs)
    base = summary.get("relay") or summary[args.sides[0]]
    floor_side = summary.get("ray_defaults", base)
    saved = {
        side: {
            run: summary[side][run]["total_s"]["median"] - base[run]["total_s"]["median"]
            for run in args.runs
            if "total_s" in base[run]
        }
        for side in args.sides
        if side != "relay"
    }
    if saved:
        print("relay's switches save (median total of the side - relay's):")
        for side, by_run in saved.items():
            print(f"  vs {side}: " + ", ".join(f"{run} {s:+.2f} s" for run, s in by_run.items()))
    figures = {
        "trial_startup_s": base["trial"]["total_s"]["median"] if "trial" in args.runs else None,
        "run_startup_s": base["run"]["total_s"]["median"] if "run" in args.runs else None,
        "floor_s": floor_side["floor"]["total_s"]["median"] if "floor" in args.runs else None,
        # One-worker trials after the first, in a sequential sweep (relay side): in their
        # actors, and each a TorchTrainer run.
        **{
            f"{run}_{key}": base[run][key]["median"]
            for run in ("trials_actor", "trials_group")
            if run in args.runs
            for key in ("gap_s", "startup_s")
        },
        "saved_s": saved,
        "sides": summary,
        "rounds": rounds,
        "order": sequence,
        "repeats": args.repeats,
        "workers": args.workers,
        "task": "digits",
        "size": "debug",
        "epochs": 1,
        "switches": {
            side: next(r["switches"] for r in rounds if r["side"] == side) for side in args.sides
        },
    }
    print_results(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
