""".venv/bin/python bench/train_overhead.py

What relay costs over plain `torchrun` for the same DDP training, measured in one run.

Both sides run one RunConfig (the same dict, validated by `relay.config.from_dict`) and the
same epoch code: relay's workers and the torchrun processes both drive
`relay.training.epochs.Epochs`
over `relay.parallel.Engine` (DDP over gloo with the same options, e.g.
`gradient_as_bucket_view`), build the optimizer and LR schedule with the same builders, iterate
the cached shard with `relay.training.epochs.CachedBatches`, and stop the training-pass clock at
the same
point (inside `Epochs.train`, before the statistics' all-reduce). Same task model, data split,
seed, workers, intra-op threads, per-worker batch size, epochs, per-epoch shuffle and
validation pass:

  relay     `relay.train(cfg)`: a 2-worker Ray Train V2 TorchTrainer, runs stored in a temp dir,
            relay's defaults otherwise (a checkpoint every epoch, report poll every 0.1 s).
  torchrun  `torchrun --nproc_per_node 2` of bench/torchrun_ddp.py (launched by
            bench/torchrun.py): the same epochs without Ray, so no reports and no checkpoints,
            and each rank's shard a contiguous slice of floor(rows / 2) rows instead of Ray
            Data's equal split (the same number of rows, not the same rows).

Figures:
  steady samples/s       median over epochs 2..N (all repeats pooled) of per-epoch samples/s =
                         global training samples / seconds of that epoch's training pass (what
                         relay reports as `samples_per_s`); epoch 1 is left out (warm-up).
  end-to-end samples/s   the same samples over the wall time between the ends of epoch 1 and
                         epoch N: also counts validation, reporting and checkpointing.
  between epochs         median of (end of epoch k - end of epoch k-1 - epoch_s of epoch k):
                         what relay spends outside its epochs (report, checkpoint, poll wait).
  time to first epoch    relay: from just before `relay.train(cfg)` to the first line of the
                         run's `history.jsonl` (rank 0 appends it at the end of epoch 1; a thread
                         polls every 20 ms). The first relay run starts Ray itself (Ray is not
                         initialised, nor even imported, before it: `import ray` and `ray.init`
                         are included); later repeats find Ray up (the "Ray up" row).
                         torchrun: from just before the `torchrun` subprocess is launched to
                         rank 0's `time.time()` at the end of epoch 1.
The last stdout line is one JSON object: throughput_ratio = relay / torchrun steady samples/s,
first_epoch_ratio = relay (cold, Ray started by the call) / torchrun seconds to end of epoch 1,
plus the raw figures and the set-up.

Default workload: `digits` with `--model '{"hidden": [2048, 2048]}'` (a 4.3 M-parameter MLP,
1,438 training rows, batch 64 per worker: 12 steps per worker per epoch). On this 2-core machine
one step of that model on one thread takes ~40 ms, so an epoch trains for ~0.5-1 s, long enough
for per-epoch samples/s to mean something; the preset `digits` sizes train an epoch in ~20 ms,
where timer and collective noise dominate. charlm's default size would take minutes per epoch on
two threads. With 8 epochs and 2 repeats the whole benchmark takes ~1.5-2 minutes.

Run order (`--order`): "abba" (default) runs torchrun, relay, relay, torchrun, ... so that a
load that drifts while the benchmark runs weighs on both sides alike; the first torchrun run
precedes Ray, later ones share the machine with the idle Ray cluster (its daemons). "sequential"
runs every torchrun repeat before Ray starts. `RAY_ADDRESS` is ignored: relay starts its own local
cluster, shut down at the end. Figures are noisy when something else is using the CPUs (per-run
steady figures are printed as the runs finish, to show the spread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torchrun import run_torchrun

import relay
import relay.config
from harness import alternated_sides, cpu_differences, cpu_text, print_results, scratch
from relay.observe.doctor.heartbeat import placement
from relay.tasks import build_task

DEFAULT_MODEL = {"digits": {"hidden": [2048, 2048]}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="relay.train vs plain torchrun: throughput and time to first epoch."
    )
    parser.add_argument("--task", default="digits", help="task name (default: digits)")
    parser.add_argument("--size", default="default", help="task size preset (default: default)")
    parser.add_argument(
        "--model",
        type=json.loads,
        default=None,
        help='model overrides as JSON; default: {"hidden": [2048, 2048]} for digits, else {}',
    )
    parser.add_argument("--epochs", type=int, default=8, help="epochs per run (default: 8)")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="batch size per worker (default: 64)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each side (default: 2); relay's first run starts Ray, later ones find it up",
    )
    parser.add_argument(
        "--order",
        choices=("abba", "sequential"),
        default="abba",
        help="abba (default): torchrun, relay, relay, torchrun, ...; "
        "sequential: every torchrun run before Ray starts, then the relay runs",
    )
    parser.add_argument("--lr", type=float, default=None, help="AdamW lr (default: relay's)")
    parser.add_argument(
        "--show-progress", action="store_true", help="let relay print its per-epoch lines"
    )
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (epoch 1 is warm-up)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.model is None:
        args.model = DEFAULT_MODEL.get(args.task, {})
    return args


def steady(values: list[float]) -> float:
    return statistics.median(values)


# --- relay ----------------------------------------------------------------------------------


class HistoryWatch:
    """Notes the wall time at which each line of a run's history.jsonl first appears."""

    def __init__(self, storage: Path, interval: float = 0.02) -> None:
        self._pattern = "runs/*/history.jsonl"
        self._storage = storage
        self._interval = interval
        self._stop = threading.Event()
        self.seen: list[float] = []  # time.time() when line i was first seen complete
        self._thread = threading.Thread(target=self._poll, name="history-watch", daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._check()
            self._stop.wait(self._interval)

    def _check(self) -> None:
        now = time.time()
        for path in self._storage.glob(self._pattern):
            try:
                lines = path.read_text().count("\n")
            except OSError:
                continue
            while len(self.seen) < lines:
                self.seen.append(now)

    def __enter__(self) -> HistoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_relay(cfg_dict: dict[str, Any], storage: Path, show_progress: bool) -> dict[str, Any]:
    cold = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    cfg = relay.config.from_dict({**cfg_dict, "storage": str(storage)})
    storage.mkdir(parents=True, exist_ok=True)
    with HistoryWatch(storage) as watch:
        called = time.time()
        result = relay.train(cfg, out=sys.stdout if show_progress else None)
        wall_s = time.time() - called
    history = result.history
    if len(watch.seen) < len(history):
        raise RuntimeError(f"saw {len(watch.seen)} history lines, the run has {len(history)}")
    report = result.efficiency or {}
    steps = report.get("step", {}).get("optimizer_steps")
    counted = report.get("throughput", {}).get("epochs_counted")
    return {
        "ray_was_up": not cold,
        # Optimizer steps per rank per epoch (the report's counted passes): torchrun's must match.
        "steps_per_epoch": steps / counted if steps and counted else None,
        "first_epoch_s": watch.seen[0] - called,
        "wall_s": wall_s,
        "samples_per_s": [m["samples_per_s"] for m in history],
        "epoch_ends": watch.seen[: len(history)],
        "epoch_s": [m["epoch_s"] for m in history],
        "last": history[-1],
        "run_dir": result.run_dir,
        "cpu": [rank["cpu"] for rank in placement(Path(result.run_dir))],
    }


# --- report ---------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]], train_samples: float) -> dict[str, Any]:
    per_epoch = [s for run in runs for s in run["samples_per_s"][1:]]
    end_to_end = [
        train_samples
        * (len(run["epoch_ends"]) - 1)
        / (run["epoch_ends"][-1] - run["epoch_ends"][0])
        for run in runs
    ]
    # Wall time between the ends of consecutive epochs beyond the epoch's own train+val time:
    # reporting, checkpointing, waiting for the controller's poll.
    gaps = [
        end - previous - took
        for run in runs
        for previous, end, took in zip(
            run["epoch_ends"], run["epoch_ends"][1:], run["epoch_s"][1:], strict=False
        )
    ]
    return {
        "steady_samples_per_s": steady(per_epoch),
        "between_epochs_s": steady(gaps),
        "end_to_end_samples_per_s": steady(end_to_end),
        "epoch1_samples_per_s": steady([run["samples_per_s"][0] for run in runs]),
        "first_epoch_s": [run["first_epoch_s"] for run in runs],
        "wall_s": [run["wall_s"] for run in runs],
    }


def metric_text(last: dict[str, Any], metric: str) -> str:
    value = last.get(metric)
    return f"{metric} {value:.4f}" if isinstance(value, float) else ""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.pop("RAY_ADDRESS", None)  # always a fresh local cluster: the cold start is measured

    settings: dict[str, Any] = {
        "name": "bench",
        "task": args.task,
        "size": args.size,
        "model": args.model,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
    }
    if args.lr is not None:
        settings["optim"] = {"lr": args.lr}
    cfg = relay.config.from_dict(settings)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    split = task.load_data(cfg.data.val_fraction, cfg.seed)
    rows = len(next(iter(split.train.values())))
    workers = cfg.scaling.num_workers
    train_samples = float(rows // workers * workers)
    params = sum(p.numel() for p in task.build_model().parameters())
    print(
        f"{cfg.task} ({cfg.size}, model {json.dumps(cfg.model)}: {params / 1e6:.2f} M params), "
        f"{rows} train rows, {workers} workers x batch {cfg.batch_size}, {cfg.epochs} epochs, "
        f"{args.repeats} repeat(s), optim {cfg.optim.name} lr {cfg.optim.lr}",
        flush=True,
    )

    with scratch("overhead") as tmp:
        tmp_dir = Path(tmp)
        torchrun_runs: list[dict[str, Any]] = []
        relay_runs: list[dict[str, Any]] = []

        def torchrun_once() -> None:
            run = run_torchrun(cfg, tmp_dir, f"torchrun-{len(torchrun_runs)}")
            torchrun_runs.append(run)
            print(
                f"torchrun #{len(torchrun_runs)}: first epoch {run['first_epoch_s']:.2f} s, "
                f"steady {steady(run['samples_per_s'][1:]):,.0f} samples/s, "
                f"wall {run['wall_s']:.1f} s",
                flush=True,
            )

        def relay_once() -> None:
            run = run_relay(settings, tmp_dir / f"relay-{len(relay_runs)}", args.show_progress)
            relay_runs.append(run)
            state = "Ray up" if run["ray_was_up"] else "Ray started"
            print(
                f"relay #{len(relay_runs)} ({state}): first epoch {run['first_epoch_s']:.2f} s, "
                f"steady {steady(run['samples_per_s'][1:]):,.0f} samples/s, "
                f"wall {run['wall_s']:.1f} s",
                flush=True,
            )

        if args.order == "sequential":
            order = [torchrun_once] * args.repeats + [relay_once] * args.repeats
        else:  # T R R T T R ...: a load that drifts during the run hits both sides alike
            order = alternated_sides([torchrun_once, relay_once], args.repeats)
        try:
            for step in order:
                step()
        finally:
            if "ray" in sys.modules:
                sys.modules["ray"].shutdown()

    # Same work on both sides: as many optimizer steps per epoch (the schedule's and the
    # passes' count), and the same training samples.
    relay_steps = relay_runs[0]["steps_per_epoch"]
    torchrun_steps = torchrun_runs[0]["steps_per_epoch"]
    if relay_steps is not None and relay_steps != torchrun_steps:
        print(f"warning: relay took {relay_steps} steps per epoch, torchrun {torchrun_steps}")
    if torchrun_runs[0]["train_samples"] != train_samples:
        print(
            f"warning: torchrun trained {torchrun_runs[0]['train_samples']:.0f} samples per "
            f"epoch, relay {train_samples:.0f}"
        )
    tr = summarize(torchrun_runs, train_samples)
    rl = summarize(relay_runs, train_samples)
    tr_first = steady(tr["first_epoch_s"])
    rl_first_cold = relay_runs[0]["first_epoch_s"]
    warm = [r["first_epoch_s"] for r in relay_runs if r["ray_was_up"]]
    rl_first_warm = steady(warm) if warm else None

    metric = task.metric
    rows_out = [
        ("", "relay", "torchrun", "relay/torchrun"),
        (
            "steady samples/s (median ep 2..N)",
            f"{rl['steady_samples_per_s']:,.0f}",
            f"{tr['steady_samples_per_s']:,.0f}",
            f"{rl['steady_samples_per_s'] / tr['steady_samples_per_s']:.3f}",
        ),
        (
            "end-to-end samples/s (ep 1 end..N end)",
            f"{rl['end_to_end_samples_per_s']:,.0f}",
            f"{tr['end_to_end_samples_per_s']:,.0f}",
            f"{rl['end_to_end_samples_per_s'] / tr['end_to_end_samples_per_s']:.3f}",
        ),
        (
            "between epochs (wall - epoch_s, median)",
            f"{rl['between_epochs_s']:.3f} s",
            f"{tr['between_epochs_s']:.3f} s",
            "",
        ),
        (
            "epoch 1 samples/s",
            f"{rl['epoch1_samples_per_s']:,.0f}",
            f"{tr['epoch1_samples_per_s']:,.0f}",
            f"{rl['epoch1_samples_per_s'] / tr['epoch1_samples_per_s']:.3f}",
        ),
        (
            "time to end of epoch 1 (Ray started)",
            f"{rl_first_cold:.2f} s",
            f"{tr_first:.2f} s",
            f"{rl_first_cold / tr_first:.2f}",
        ),
    ]
    if rl_first_warm is not None:
        rows_out.append(
            (
                "time to end of epoch 1 (Ray up)",
                f"{rl_first_warm:.2f} s",
                f"{tr_first:.2f} s",
                f"{rl_first_warm / tr_first:.2f}",
            )
        )
    rows_out.append(
        (
            "wall time per run (median)",
            f"{steady(rl['wall_s']):.1f} s",
            f"{steady(tr['wall_s']):.1f} s",
            f"{steady(rl['wall_s']) / steady(tr['wall_s']):.2f}",
        )
    )
    rows_out.append(
        (
            "last epoch",
            metric_text(relay_runs[-1]["last"], metric),
            metric_text(torchrun_runs[-1]["last"], metric),
            "",
        )
    )
    widths = [max(len(r[i]) for r in rows_out) for i in range(4)]
    print()
    for row in rows_out:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    first = torchrun_runs[0]["startup_s"]
    print(
        f"\ntorchrun #1 start-up (rank 0, seconds after its process started): imports done "
        f"{first['imports']:.2f}, process group {first['process_group']:.2f}, model+data "
        f"{first['model_and_data']:.2f}, end of epoch 1 "
        f"{torchrun_runs[0]['process_start_to_first_epoch_s']:.2f}"
    )
    for name, runs in (("relay", relay_runs), ("torchrun", torchrun_runs)):
        print(f"{name} ran with: {cpu_text(runs[0]['cpu'])}")
    differs = cpu_differences({"relay": relay_runs[0]["cpu"], "torchrun": torchrun_runs[0]["cpu"]})
    if differs:
        print(f"warning: the sides' ranks ran with different {', '.join(differs)}")
    print("per-epoch samples/s:")
    for name, runs in (("relay", relay_runs), ("torchrun", torchrun_runs)):
        for i, run in enumerate(runs):
            values = " ".join(f"{v:,.0f}" for v in run["samples_per_s"])
            print(f"  {name} #{i + 1}: {values}")

    summary = {
        "throughput_ratio": rl["steady_samples_per_s"] / tr["steady_samples_per_s"],
        "first_epoch_ratio": rl_first_cold / tr_first,
        "first_epoch_ratio_ray_up": rl_first_warm / tr_first if rl_first_warm else None,
        "end_to_end_throughput_ratio": (
            rl["end_to_end_samples_per_s"] / tr["end_to_end_samples_per_s"]
        ),
        "relay_steady_samples_per_s": rl["steady_samples_per_s"],
        "torchrun_steady_samples_per_s": tr["steady_samples_per_s"],
        "relay_end_to_end_samples_per_s": rl["end_to_end_samples_per_s"],
        "torchrun_end_to_end_samples_per_s": tr["end_to_end_samples_per_s"],
        "relay_between_epochs_s": rl["between_epochs_s"],
        "torchrun_between_epochs_s": tr["between_epochs_s"],
        "relay_first_epoch_s": rl_first_cold,
        "relay_first_epoch_s_ray_up": rl_first_warm,
        "torchrun_first_epoch_s": tr_first,
        "relay_first_epoch_s_all": rl["first_epoch_s"],
        "torchrun_first_epoch_s_all": tr["first_epoch_s"],
        "relay_wall_s": rl["wall_s"],
        "torchrun_wall_s": tr["wall_s"],
        "relay_samples_per_s": [r["samples_per_s"] for r in relay_runs],
        "torchrun_samples_per_s": [r["samples_per_s"] for r in torchrun_runs],
        "task": cfg.task,
        "size": cfg.size,
        "model": cfg.model,
        "params": params,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "workers": workers,
        "train_samples_per_epoch": train_samples,
        "repeats": args.repeats,
        "relay_steps_per_epoch": relay_steps,
        "torchrun_steps_per_epoch": torchrun_steps,
        "torchrun_threads": torchrun_runs[0]["threads"],
        # What each side's ranks computed with (first run), and where they differed.
        "cpu_setup": {"relay": relay_runs[0]["cpu"], "torchrun": torchrun_runs[0]["cpu"]},
        "cpu_setup_differs": differs,
        # The one config both sides ran (relay's runs add only their storage dir).
        "config": cfg.model_dump(mode="json"),
    }
    print_results(summary)


if __name__ == "__main__":
    main()
