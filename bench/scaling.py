""".venv/bin/python bench/scaling.py [--epochs 6] [--batch-size 512] [--samples 15360]
   .venv/bin/python bench/scaling.py --hosts [--repeats 3]      (root: network namespaces)

Data-parallel scaling of one training config from 1 to 2 CPU workers, relay next to plain
torchrun, in one run.

Method: the same config is trained at 1 and 2 workers by relay (`relay.training.driver.fit`, one
embedded Ray cluster, one temporary storage dir) and by plain torchrun (bench/torchrun_ddp.py
at 1 and 2 processes, launched by bench/torchrun.py), in one bench run. The torchrun side runs
relay's own epoch code (`relay.training.epochs.Epochs` over `relay.parallel.Engine`, same DDP
options,
same batching, same training-pass clock) without Ray: its speedup is the independent figure
relay's is compared against. Every worker (process) reserves one CPU
(`resources_per_worker {CPU: 1}`) and runs one intra-op thread (`threads_per_worker 1`), and
the batch per worker is the same at 1 and 2 (weak scaling per step: each worker does the same
work per step, 2 workers need half as many steps per epoch).

Order: `--repeats` rounds (default 5) of relay 1w, torchrun 1p, torchrun 2p, relay 2w, every
other round reversed (relay 2w, torchrun 2p, torchrun 1p, relay 1w). Each side's 1- and 2-worker
runs sit symmetrically around the middle of a round and each position is taken by both sides
over the rounds, so a load that drifts during the bench weighs on both speedups alike. Figures
are medians over the rounds, each with its spread (min-max); a speedup is the median 2-worker
samples/s over the median 1-worker samples/s, its spread the per-round quotients. relay's first
run starts Ray, so every torchrun run shares the machine with the same idle Ray cluster as
relay's runs do; all relay runs share one storage dir, so a 2-worker efficiency report finds an
earlier 1-worker run as its reference (`relay_reference_speedup`, information only: it is
relay's own division, not evidence).

Workload: `regression` (synthetic, seeded) with `{"features": 1024, "hidden": [2048, 2048]}`:
an MLP 1024 -> 2048 -> 2048 -> 1 of 6.3 M parameters, batch 512 per worker. Chosen over
`digits` (1,438 rows, 64 inputs) because every layer is a large dense GEMM (the first one too:
1024 inputs, not 64), and the synthetic data set can be made as large as needed, so an epoch has
~12 full steps per worker at 2 workers instead of 2-3 with a ragged last batch. At batch 512 a
step is ~0.2 s of matmul on one thread of this machine, AdamW ~20 ms, and the gradient all-reduce
moves 25 MB: compute dominates, so the fraction of the matmul peak means something. charlm's
FLOPs include attention, layer norms, softmax and embeddings that run far from the matmul peak
on a CPU.

Figures (relay's from its efficiency report unless marked "steady"):
  samples/s        global training samples / seconds of the training passes the report
                   counts: epochs 2..N (relay leaves epoch 1 out as warm-up when a run has more
                   than one; `report_epochs_counted`), never validation, reporting or
                   checkpoints. torchrun's `report_samples_per_s` is the same figure from the
                   same code (`Epochs.steady()` on its rank 0). "steady": the median of the
                   per-epoch samples/s of epochs 2..N (relay: from the run's history; torchrun:
                   from rank 0's per-epoch records): less swayed by one slow epoch.
  speedup_2w       relay: samples/s at 2 workers / at 1 worker (report figures; ideal 2.0,
                   target >= 1.85). speedup_2w_steady: the same from the steady figures.
  torchrun_speedup_2w
                   plain torchrun, 2 processes / 1 process, the same definition as
                   speedup_2w (samples over seconds of the training passes of epochs 2..N,
                   from `Epochs.steady()` on rank 0, the code relay's report uses);
                   torchrun_speedup_2w_steady: from the steady medians, as speedup_2w_steady.
  speedup_vs_torchrun
                   speedup_2w / torchrun_speedup_2w: what relay's side costs in scaling, the
                   issue's figure (goal >= 0.97).
  relay_vs_torchrun_1w, relay_vs_torchrun_2w
                   relay's median samples/s over torchrun's at 1 and at 2 workers (the
                   speedup_2w definition): where a speedup gap comes from, the 1- or the
                   2-worker side.
  fraction_of_measured_matmul_peak
                   the 2-worker run's achieved model FLOP/s (forward + backward FLOPs per
                   sample counted by torch, times samples/s) over the sum of the workers'
                   measured matmul rates (relay's report: the best square size tried, fp32,
                   both workers measuring at once) — a fraction of a peak measured on this
                   machine, not of a datasheet peak, so not MFU as papers report it (target
                   >= 0.4). _1w: the same for the 1-worker run.
  step split       per optimizer step: compute (forward + backward without gradient sync),
                   comm (the same micro-step with sync minus without: what the all-reduce costs
                   beyond what backward hides) and other (optimizer, data, timers: step time
                   minus both, 0 when the probe timings exceed it); comm_fraction = comm /
                   (compute + comm). Measured by relay after the last epoch, on one batch.
  training_cpu_cores, support_cpu_cores
                   CPU used while the workers train (from the end of epoch 1 to the end of the
                   last, sampled from /proc every second), per side and worker count, medians
                   over the rounds: by the training processes (Ray Train workers, torchrun's
                   ranks) and by the rest of the bench's own process tree (Ray's daemons and
                   actors, the driver, torchrun's launcher: the support). Both sides run beside
                   the same idle Ray cluster, so the support difference is what a relay run
                   adds.
What limits speedup_2w on this 2-core machine: not the cores themselves (two plain one-thread
processes side by side each keep their full matmul rate and step rate) but whatever else needs a
core. At 1 worker that runs on the idle second core; at 2 it comes out of compute: gloo's
all-reduce of 25 MB per step and its threads (both sides), and on relay's side a Train run's own
processes. Measured 2026-12-05 (`support_cpu_cores`, and per thread from /proc/<pid>/task/*/sched
and schedstat during a 2-worker run): relay's support takes ~0.11 cores where torchrun's takes
~0.07, and relay's training threads wait for a core ~0.10 s per second where torchrun's wait
~0.07 s, preempted ~650 times a second instead of ~400. The extra comes from Ray's Python
processes of a run — the TrainController, SynchronizationActor, PlacementGroupCleaner and the
cluster's _AutoscalingCoordinatorActor — and the main thread of each Train worker: Ray's core
worker wakes every Python worker's main thread every 10 ms to check for signals (strace shows a
10 ms timerfd; "CoreWorker.CheckSignal", not configurable), ~6 ms of CPU per second per process,
each wake-up preempting a training thread. None of these can be switched off without losing what
fault tolerance needs (health checks, report barriers, placement-group clean-up). Measured and
dropped: the controller's poll at 2 s instead of relay's 0.1 s (no difference beyond the noise,
3 alternated pairs) and nice 19 for those processes and the workers' non-training threads (no
change in the training threads' run-queue wait).

Figures are noisy when something else is using the CPUs: each run records the CPU that processes
outside the bench's own process tree used while it ran (`foreign_cpu_cores`, sampled from /proc
every second), and the bench warns and counts `busy_runs` when that averages over 0.25 cores.

The 2-host point (`--hosts`): what the network hop costs. A cluster of two hosts on this
machine, each a network namespace with its own raylet and object store, linked by veth pairs
through a bridge (netns_cluster), runs the same 2-worker config as above (submitted with
`ray job submit` of jobs/train.py from host 0) placed two ways: both workers on host 0 (each asks
for the custom resource `host0`; gloo over loopback) and one worker per host (each asks for a
`worker_slot`, of which each host has one; gloo over the veth link, the only way between the
namespaces). The sides alternate over `--repeats`; `two_hosts_vs_one_host` is the median
samples/s (the efficiency report's, epochs 2..N) of one worker per host over both on one host.
Both sides share the machine's 2 cores, so this measures the hop (veth + bridge + the TCP stack
of two namespaces instead of loopback), not two machines' worth of compute; host 1's eth0 byte
count per run shows the gradients crossed it.

The last stdout line is one JSON object with the figures above, the per-run tables and the
set-up. The bench sets RELAY_HOME and the runs' storage to a temporary dir (deleted at the end),
starts its own local Ray cluster (RAY_ADDRESS=local) and shuts Ray down at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from foreign_cpu import ForeignCPU, busy_text, fit_watched, warn_if_busy
from torchrun import run_torchrun

from harness import (
    alternated,
    cpu_differences,
    median_of,
    print_results,
    relay_home,
    scratch,
    spread,
    spread_text,
)
from harness import cpu_text as harness_cpu_text

# Command-line marks of the processes that train, on either side; the rest of the bench's own
# process tree (Ray's daemons and actors, the driver, torchrun's launcher) supports them.
TRAINING = (b"RayTrainWorker", b"torchrun_ddp.py")
SIDES = ("relay", "torchrun")

DEFAULT_TASK = "regression"
DEFAULT_MODEL = {"features": 1024, "hidden": [2048, 2048], "samples": 15_360}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="1 -> 2 worker scaling, relay vs plain torchrun: speedup, matmul peak fraction."
    )
    parser.add_argument("--task", default=DEFAULT_TASK, help="task name (default: regression)")
    parser.add_argument("--size", default="default", help="task size preset (default: default)")
    parser.add_argument(
        "--model",
        type=json.loads,
        default=None,
        help=f"model overrides as JSON (default for regression: {json.dumps(DEFAULT_MODEL)})",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="regression only: rows generated (overrides the model's samples)",
    )
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (default: 6)")
    parser.add_argument(
        "--batch-size", type=int, default=512, help="batch size per worker (default: 512)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW lr (default: 1e-3)")
    parser.add_argument(
        "--show-progress", action="store_true", help="relay's per-epoch lines on stderr"
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="the 2-host point instead: 1 worker on each of 2 namespace hosts vs 2 on one (root)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds of runs, alternated (default: 5); --hosts: runs per side (default: 3)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (epoch 1 is warm-up)")
    if args.repeats is None:
        args.repeats = 3 if args.hosts else 5
    if args.model is None:
        args.model = dict(DEFAULT_MODEL) if args.task == DEFAULT_TASK else {}
    if args.samples is not None:
        args.model["samples"] = args.samples
    return args


def run_config(args: argparse.Namespace, storage: Path, workers: int) -> dict[str, Any]:
    return {
        "name": f"scaling-{workers}w",
        "task": args.task,
        "size": args.size,
        "model": args.model,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "optim": {"name": "adamw", "lr": args.lr},
        "scaling": {
            "num_workers": workers,
            "resources_per_worker": {"CPU": 1},
            "threads_per_worker": 1,
        },
        # One checkpoint, at the end: checkpoints are outside the training pass anyway.
        "checkpoint": {"every": args.epochs, "keep": 1},
        "storage": str(storage),
    }


def train(cfg_dict: dict[str, Any], show_progress: bool) -> dict[str, Any]:
    from relay.observe.doctor.heartbeat import placement

    result, wall_s, others = fit_watched(cfg_dict, show_progress, TRAINING)
    report = result.efficiency
    flops = report["flops"]
    per_epoch = [m["samples_per_s"] for m in result.history]
    return {
        "side": "relay",
        "run_id": result.run_id,
        "workers": report["workers"],
        "wall_s": wall_s,
        "foreign_cpu_cores": others.cores,
        # From the end of epoch 1 to the end of the last, as the torchrun side's window.
        "cpu_cores_epochs_2_n": others.between(
            result.history[0]["time"], result.history[-1]["time"]
        ),
        "startup_s": result.startup_s,
        "samples_per_s": report["throughput"]["samples_per_s"],
        "steady_samples_per_s": statistics.median(per_epoch[1:]),
        "epoch_samples_per_s": per_epoch,
        "train_s": report["throughput"]["train_s"],
        "report_epochs_counted": report["throughput"].get("epochs_counted"),
        "optimizer_steps": report["step"]["optimizer_steps"],
        "step": {k: report["step"][k] for k in ("step_s", "compute_s", "comm_s", "other_s")},
        "comm_fraction": report["step"]["comm_fraction"],
        # relay's efficiency report may name the figure for what it is; read whichever name exists.
        "peak_fraction": flops["fraction_of_measured_matmul_peak"],
        "model_flops_per_sample": flops["model_flops_per_sample"],
        "achieved_flops_per_s": flops["achieved_flops_per_s"],
        "matmul_peak_flops_per_s": flops["matmul_peak_flops_per_s"],
        "reference": report.get("reference"),
        "last": result.history[-1] if result.history else {},
        "cpu": [rank["cpu"] for rank in placement(Path(result.run_dir))],
    }


def train_torchrun(cfg_dict: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The same config under plain torchrun, watched for others' CPU like relay's runs."""
    import relay.config

    cfg = relay.config.from_dict(cfg_dict)
    # The torchrun processes are ours: children of this one.
    with ForeignCPU(training=TRAINING) as others:
        run = run_torchrun(cfg, out_dir, f"torchrun-{cfg.scaling.max_workers}p")
    return {
        "side": "torchrun",
        **run,
        "epoch_samples_per_s": run["samples_per_s"],
        "foreign_cpu_cores": others.cores,
        "cpu_cores_epochs_2_n": others.between(run["epoch_ends"][0], run["epoch_ends"][-1]),
    }


def cpu_text(run: dict[str, Any]) -> str:
    cores = run["cpu_cores_epochs_2_n"]
    if cores is None:
        return "CPU in epochs 2..N n/a"
    return (
        f"CPU in epochs 2..N: training {cores['training']:.2f} cores, support "
        f"{cores['support']:.3f}, others {cores['foreign']:.3f}"
    )


def describe_torchrun(run: dict[str, Any]) -> str:
    return (
        f"torchrun, {run['workers']} process(es): {run['report_samples_per_s']:,.0f} samples/s "
        f"(steady {run['steady_samples_per_s']:,.0f}), {run['steps_per_epoch']} steps/epoch, "
        f"wall {run['wall_s']:.1f} s, others' CPU {busy_text(run['foreign_cpu_cores'])}; "
        f"{cpu_text(run)}; {harness_cpu_text(run['cpu'])}"
    )


def describe(run: dict[str, Any]) -> str:
    s = run["step"]
    return (
        f"relay, {run['workers']} worker(s): {run['samples_per_s']:,.0f} samples/s "
        f"(steady {run['steady_samples_per_s']:,.0f}), "
        f"{run['peak_fraction']:.1%} of measured matmul peak, step "
        f"{s['step_s'] * 1e3:.0f} ms = compute {s['compute_s'] * 1e3:.0f} + comm "
        f"{s['comm_s'] * 1e3:.0f} + other {s['other_s'] * 1e3:.0f}, "
        f"{run['optimizer_steps']} steps, wall {run['wall_s']:.1f} s, "
        f"others' CPU {busy_text(run['foreign_cpu_cores'])}; {cpu_text(run)}; "
        f"{harness_cpu_text(run['cpu'])}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.hosts:
        hosts_main(args)
        return
    started = time.perf_counter()
    with relay_home("scaling") as storage:  # relay starts its own embedded cluster
        import relay.config
        from relay.tasks import build_task

        cfg = relay.config.from_dict(run_config(args, storage, 1))
        task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
        params = sum(p.numel() for p in task.build_model().parameters())
        rows = len(next(iter(task.load_data(cfg.data.val_fraction, cfg.seed).train.values())))
        print(
            f"{cfg.task} ({cfg.size}, model {json.dumps(cfg.model)}: {params / 1e6:.2f} M "
            f"params), {rows} train rows, batch {cfg.batch_size}/worker, {cfg.epochs} epochs, "
            "1 CPU and 1 thread per worker",
            flush=True,
        )
        runs: list[dict[str, Any]] = []
        order = scaling_order(args.repeats)
        for repeat, side, workers in order:
            cfg_dict = run_config(args, storage, workers)
            if side == "relay":
                run = train(cfg_dict, args.show_progress)
                print(describe(run), flush=True)
            else:
                run = train_torchrun(cfg_dict, storage)
                print(describe_torchrun(run), flush=True)
            runs.append({**run, "repeat": repeat})
    wall_s = time.perf_counter() - started

    def picked(side: str, workers: int) -> list[dict[str, Any]]:
        return [r for r in runs if r["side"] == side and r["workers"] == workers]

    def speedups(side: str, key: str) -> dict[str, Any]:
        """Median 2w / median 1w, and the per-round quotients for its spread."""
        one, two = picked(side, 1), picked(side, 2)
        rounds = [b[key] / a[key] for a, b in zip(one, two, strict=True)]
        return {
            "median": median_of(two, key) / median_of(one, key),
            "min": min(rounds),
            "max": max(rounds),
            "rounds": rounds,
        }

    relay_speedup = speedups("relay", "samples_per_s")
    relay_steady = speedups("relay", "steady_samples_per_s")
    torchrun_speedup = speedups("torchrun", "report_samples_per_s")
    torchrun_steady = speedups("torchrun", "steady_samples_per_s")
    speedup, torchrun_speedup_2w = relay_speedup["median"], torchrun_speedup["median"]
    relay_vs_torchrun = {
        w: median_of(picked("relay", w), "samples_per_s")
        / median_of(picked("torchrun", w), "report_samples_per_s")
        for w in (1, 2)
    }

    def cpu_median(side: str, workers: int, share: str) -> float | None:
        values = [
            r["cpu_cores_epochs_2_n"][share]
            for r in picked(side, workers)
            if r["cpu_cores_epochs_2_n"] is not None
        ]
        return statistics.median(values) if values else None

    cpu = {
        share: {side: {w: cpu_median(side, w, share) for w in (1, 2)} for side in SIDES}
        for share in ("training", "support")
    }
    one, two = median_run(picked("relay", 1)), median_run(picked("relay", 2))
    reference = two["reference"] or {}
    relay_reference_speedup = reference.get("speedup")
    print()
    print(f"medians (min-max) of {args.repeats} alternated rounds")
    for side, key in (("relay", "samples_per_s"), ("torchrun", "report_samples_per_s")):
        for workers in (1, 2):
            rates = spread(r[key] for r in picked(side, workers))
            print(f"  {side} {workers} worker(s): {spread_text(rates, '{:,.0f}')} samples/s")
    print(
        f"speedup 2 workers / 1 worker, relay: {spread_text(relay_speedup)} (report throughput), "
        f"{spread_text(relay_steady)} (steady, median epochs 2..N); target >= 1.85"
    )
    print(
        f"speedup 2 processes / 1 process, plain torchrun of the same epochs: "
        f"{spread_text(torchrun_speedup)} (same figure as relay's report), "
        f"{spread_text(torchrun_steady)} (steady)"
    )
    print(
        f"relay's speedup / torchrun's: {speedup / torchrun_speedup_2w:.3f}; relay / torchrun "
        f"samples/s: {relay_vs_torchrun[1]:.3f} at 1 worker, {relay_vs_torchrun[2]:.3f} at 2"
    )
    print(
        "CPU while the workers train (epochs 2..N, medians), training processes / the rest of "
        "the bench's process tree: "
        + "; ".join(
            f"{side} {w}w {cores_text(cpu['training'][side][w], 2)} / "
            f"{cores_text(cpu['support'][side][w], 3)}"
            for side in SIDES
            for w in (1, 2)
        )
    )
    if relay_reference_speedup is not None:
        print(f"(relay's own report: {relay_reference_speedup:.3f}x over {reference['run_id']})")
    print(
        f"fraction of measured matmul peak (median runs): {two['peak_fraction']:.1%} at 2 "
        f"workers (target >= 40%), {one['peak_fraction']:.1%} at 1 worker; "
        f"comm {two['comm_fraction']:.0%} of compute+comm at 2 workers"
    )
    for run in runs:
        values = " ".join(f"{v:,.0f}" for v in run["epoch_samples_per_s"])
        print(
            f"  per-epoch samples/s, round {run['repeat']}, {run['side']} {run['workers']} "
            f"worker(s): {values}"
        )
    print(f"wall time {wall_s:.1f} s")

    busy = warn_if_busy(runs)

    summary = {
        "busy_runs": busy,
        "repeats": args.repeats,
        "speedup_2w": speedup,
        "speedup_2w_min": relay_speedup["min"],
        "speedup_2w_max": relay_speedup["max"],
        "speedup_2w_steady": relay_steady["median"],
        "torchrun_speedup_2w": torchrun_speedup_2w,
        "torchrun_speedup_2w_min": torchrun_speedup["min"],
        "torchrun_speedup_2w_max": torchrun_speedup["max"],
        "torchrun_speedup_2w_steady": torchrun_steady["median"],
        "speedup_vs_torchrun": speedup / torchrun_speedup_2w,
        "speedups_per_round": {
            "relay": relay_speedup["rounds"],
            "torchrun": torchrun_speedup["rounds"],
        },
        "relay_vs_torchrun_1w": relay_vs_torchrun[1],
        "relay_vs_torchrun_2w": relay_vs_torchrun[2],
        "relay_reference_speedup": relay_reference_speedup,
        # cores, medians over the rounds, keyed side -> workers
        "training_cpu_cores": cpu["training"],
        "support_cpu_cores": cpu["support"],
        "scaling_efficiency": speedup / 2,
        "torchrun_scaling_efficiency": torchrun_speedup_2w / 2,
        # The same figures under the name that says what they are (see relay/training/efficiency/).
        "fraction_of_measured_matmul_peak": two["peak_fraction"],
        "fraction_of_measured_matmul_peak_1w": one["peak_fraction"],
        "comm_fraction": two["comm_fraction"],
        "step_2w": two["step"],
        "step_1w": one["step"],
        # What each side's ranks computed with (first run of each worker count), and the
        # settings on which they differed: a ratio of unlike runs would say little.
        "cpu_setup": {side: {f"{w}w": picked(side, w)[0]["cpu"] for w in (1, 2)} for side in SIDES},
        "cpu_setup_differs": {
            f"{w}w": cpu_differences({side: picked(side, w)[0]["cpu"] for side in SIDES})
            for w in (1, 2)
        },
        "runs": [r for r in runs if r["side"] == "relay"],
        "torchrun_runs": [r for r in runs if r["side"] == "torchrun"],
        "order": [f"{side} {workers}w" for _, side, workers in order],
        "task": cfg.task,
        "size": cfg.size,
        "model": cfg.model,
        "params": params,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "wall_s": wall_s,
    }
    print_results(summary)


SIDES = ("relay", "torchrun")


def cores_text(cores: float | None, digits: int) -> str:
    return "n/a" if cores is None else f"{cores:.{digits}f}"


def scaling_order(repeats: int) -> list[tuple[int, str, int]]:
    """(round, side, workers): relay 1w first (it starts Ray); every other round reversed."""
    base = [("relay", 1), ("torchrun", 1), ("torchrun", 2), ("relay", 2)]
    return [(r, side, workers) for r, (side, workers) in alternated(base, repeats)]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput (the lower of the middle two for an even count)."""
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    return ordered[(len(ordered) - 1) // 2]


# --- the 2-host point ---------------------------------------------------------------------------

# Where each side's two workers may go (scaling.resources_per_worker, besides 1 CPU each).
PLACEMENTS = {"one_host": {"host0": 1}, "two_hosts": {"worker_slot": 1}}


def submit_run(cluster, cfg_dict: dict[str, Any], config_dir: Path) -> dict[str, Any]:
    """`ray job submit` of jobs/train.py CONFIG --json from host 0; the run's figures."""
    from relay.records import history, registry

    path = config_dir / f"{cfg_dict['name']}.yaml"
    path.write_text(json.dumps(cfg_dict))  # YAML reads JSON
    link_before = cluster.link_bytes(1)
    began = time.perf_counter()
    _, submit = cluster.submit_train(Path(__file__).resolve().parents[1], str(path), "--json")
    if submit.returncode != 0:
        raise RuntimeError(f"{cfg_dict['name']}: {submit.stdout[-3000:]}{submit.stderr[-3000:]}")
    result = cluster.train_result(submit)
    report = result["efficiency"]
    record = registry.get_run(cluster.storage, result["run_id"])
    epochs = history.read_raw(Path(record["run_dir"]))
    return {
        "run_id": result["run_id"],
        "wall_s": time.perf_counter() - began,
        "startup_s": result["startup_s"],
        "samples_per_s": report["throughput"]["samples_per_s"],
        "steady_samples_per_s": statistics.median(e["samples_per_s"] for e in epochs[1:]),
        "node_ips": [r["node_ip"] for r in record["placement"]],
        "step": {k: report["step"][k] for k in ("step_s", "compute_s", "comm_s", "other_s")},
        "comm_fraction": report["step"]["comm_fraction"],
        "host1_link_bytes": cluster.link_bytes(1) - link_before,
    }


def hosts_main(args: argparse.Namespace) -> None:
    # The namespace-cluster harness lives beside the tests, not among relay's modules.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
    from netns_cluster import NetnsCluster, netns_unavailable

    if reason := netns_unavailable():
        sys.exit(f"the 2-host point needs network namespaces: {reason}")
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with scratch("hosts") as tmp:
        storage = Path(tmp)
        with NetnsCluster(2, storage=storage, host_resources={"worker_slot": 1}) as cluster:
            print(f"{cluster.describe()}\nup in {cluster.up_in_s:.1f} s", flush=True)
            for repeat, side in alternated(list(PLACEMENTS), args.repeats):
                cfg_dict = run_config(args, storage, 2)
                cfg_dict["name"] = f"hosts-{side.replace('_', '-')}-{repeat}"
                cfg_dict["scaling"]["resources_per_worker"] |= PLACEMENTS[side]
                run = {"side": side, "repeat": repeat, **submit_run(cluster, cfg_dict, storage)}
                runs.append(run)
                print(
                    f"{side}: {run['samples_per_s']:,.0f} samples/s (steady "
                    f"{run['steady_samples_per_s']:,.0f}), ranks on {run['node_ips']}, "
                    f"host 1's link {run['host1_link_bytes'] / 1e6:,.0f} MB, step "
                    f"{run['step']['step_s'] * 1e3:.0f} ms (comm "
                    f"{run['step']['comm_s'] * 1e3:.0f}), wall {run['wall_s']:.1f} s",
                    flush=True,
                )

    def median(side: str, key: str) -> float:
        return median_of((r for r in runs if r["side"] == side), key)

    ratio = median("two_hosts", "samples_per_s") / median("one_host", "samples_per_s")
    ratio_steady = median("two_hosts", "steady_samples_per_s") / median(
        "one_host", "steady_samples_per_s"
    )
    print(
        f"\none worker per host / both on one host, samples/s (medians of {args.repeats}): "
        f"{ratio:.3f} (report), {ratio_steady:.3f} (steady)"
    )
    summary = {
        "two_hosts_vs_one_host": ratio,
        "two_hosts_vs_one_host_steady": ratio_steady,
        "samples_per_s": {
            side: sorted(r["samples_per_s"] for r in runs if r["side"] == side)
            for side in PLACEMENTS
        },
        "comm_s": {
            side: statistics.median(r["step"]["comm_s"] for r in runs if r["side"] == side)
            for side in PLACEMENTS
        },
        "runs": runs,
        "repeats": args.repeats,
        "task": args.task,
        "model": args.model,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "wall_s": time.perf_counter() - started,
    }
    print_results(summary)


if __name__ == "__main__":
    main()
