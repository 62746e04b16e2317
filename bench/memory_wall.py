""".venv/bin/python bench/memory_wall.py [--layers 16] [--width 2048] [--repeats 5] [--skip-runs]

The memory wall on this machine: what each rank holds under ddp, zero1 and fsdp at 2 and 4
workers, next to `relay plan`'s prediction, and what a checkpoint costs to save gathered on
rank 0 (`checkpoint.format: full`) against written by every rank (`sharded`).

Workload: digits with a deep MLP (`hidden: [2048] x 16`, no dropout): 63.1 M parameters, whose
fp32 weights, gradients and Adam moments take ~963 MiB per whole replica — the model of the
memory-wall test (tests/test_memory_wall.py), where a 512 MiB limit per worker stops ddp and
not fsdp on 4 workers.

Part 1, runs: one `relay.training.driver.fit` per (strategy, workers) — 2 workers with 1 CPU each,
4
with 0.5 — of 1 epoch at batch 64, each worker under `scaling.memory_per_worker: 4GiB` (far
above what any of them needs: it is there so every run takes the same code path, including
the allocator setting a limit brings, see relay.runtime.worker_memory). Figures per rank, from the
run's efficiency report:
  growth   peak RSS minus RSS when the loop started: all that training added (model state,
           activations, gathered parameters, a full checkpoint's gather on rank 0, buffers)
  start-up the kernel's high-water mark of the resident set from the loop's start until the
           model is built and its state loaded, before any step, minus RSS at the start (fsdp
           builds on the meta device: each rank materialises its shards, one module whole at
           a time)
  state    the bytes parameters, gradients and optimizer state occupy (relay.training.footprint)
  plan     `relay plan`'s total for the same config and worker count (model state +
           gathered parameters + activations), computed here in the bench's process
  activations  what one forward of a training batch adds until its backward, measured on the
           rank (relay.training.efficiency.activation_bytes), against the plan's activations
Ratios: fsdp/ddp and zero1/ddp of the fullest rank's growth, at each worker count (the issue's
goal: fsdp/ddp <= 0.55 at 2 workers, <= 0.35 at 4) and of its start-up (the issue: "peak host
memory per rank at start proportional to 1/N of the model"), and growth/plan, state/plan-state and
activations/plan-activations (the issue's goal for the plan: within 15% per term).

Part 2, checkpoint save at 2 workers (no Ray: two processes with a gloo group, the same
`relay.parallel.Engine` the workers run, fsdp): the time from the collective's start until
every rank is done, of (a) gathered: `Engine.full_state()` (every shard to rank 0's CPU) then
`checkpoint.save_state` on rank 0, and (b) sharded: `Engine.save_sharded` (each rank writes
its own shards; rank 0 adds the index). Sides alternate, `--repeats` each, median and range.

The last stdout line is one JSON object. About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from foreign_cpu import busy_text, fit_watched, warn_if_busy

from harness import print_results, relay_home, scratch, spread

MiB = 1024 * 1024
RUNS = (("ddp", 2), ("zero1", 2), ("fsdp", 2), ("ddp", 4), ("zero1", 4), ("fsdp", 4))


def run_config(args: argparse.Namespace, storage: Path, strategy: str, workers: int) -> dict:
    return {
        "name": f"wall-{strategy}-{workers}",
        "task": "digits",
        "size": "default",
        "model": {"hidden": [args.width] * args.layers, "dropout": 0.0},
        "epochs": 1,
        "batch_size": 64,
        "optim": {"lr": 1e-4},
        "parallel": {"strategy": strategy},
        "scaling": {
            "num_workers": workers,
            "resources_per_worker": {"CPU": 2 / workers},
            "threads_per_worker": 1,
            "memory_per_worker": "4GiB",
        },
        "storage": str(storage),
    }


def planned(cfg_dict: dict, workers: int) -> dict[str, int]:
    import relay.config
    from relay.training import plan

    cfg = relay.config.from_dict(cfg_dict)
    report = plan.plan(cfg, workers, device_memory=64 << 30)
    row = report["strategies"][cfg.parallel.strategy]
    return {
        "total_bytes": row["total_bytes"],
        "model_state_bytes": row["model_state_bytes"],
        "activation_bytes": row["activation_bytes"],
    }


def measure_run(args: argparse.Namespace, storage: Path, strategy: str, workers: int) -> dict:
    cfg_dict = run_config(args, storage, strategy, workers)
    expected = planned(cfg_dict, workers)
    result, wall_s, others = fit_watched(cfg_dict, args.show_progress)
    ranks = result.efficiency["memory"]["per_rank"]
    growth = [r["peak_growth_bytes"] for r in ranks]
    startup = [r["startup_growth_bytes"] for r in ranks]
    state = [r["state_bytes"] for r in ranks]
    activations = [r["activation_bytes"] for r in ranks]
    return {
        "strategy": strategy,
        "workers": workers,
        "growth_bytes_per_rank": growth,
        "startup_growth_bytes_per_rank": startup,
        "state_bytes_per_rank": state,
        "plan_total_bytes": expected["total_bytes"],
        "plan_state_bytes": expected["model_state_bytes"],
        "growth_over_plan": max(growth) / expected["total_bytes"],
        "state_over_plan": max(state) / expected["model_state_bytes"],
        "activation_bytes_per_rank": activations,
        "plan_activation_bytes": expected["activation_bytes"],
        "activations_over_plan": max(activations) / expected["activation_bytes"],
        "memory_limit": result.memory,
        "wall_s": round(wall_s, 1),
        "foreign_cpu_cores": others.cores,
    }


# --- part 2: checkpoint save, two processes -----------------------------------------------------


def _save_worker(rank: int, args: argparse.Namespace, port: int, directory: str, out) -> None:
    import torch
    import torch.distributed as dist

    from relay import parallel
    from relay.checkpoints import checkpoint
    from relay.config import ParallelConfig
    from relay.tasks import build_task

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    task = build_task("digits", "default", {"hidden": [args.width] * args.layers}, None)
    engine = parallel.Engine(
        task.build_model(), ParallelConfig(strategy="fsdp"), torch.optim.Adam, {"lr": 1e-4}
    )
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    engine.zero_grad()
    with engine.micro_step():
        engine.backward(torch.nn.functional.cross_entropy(engine.model(x), y))
    engine.step()  # Adam's moments exist: the optimizer state is saved too

    def gathered(target: Path) -> None:
        weights, optimizer = engine.full_state()
        if parallel.is_main():
            checkpoint.save_state(
                target, weights=weights, optimizer=optimizer, scheduler=None, scaler=None,
                meta={"epoch": 1},
            )  # fmt: skip

    def sharded(target: Path) -> None:
        engine.save_sharded(target / checkpoint.SHARDS)

    sides = {"gathered": gathered, "sharded": sharded}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.repeats * 2):
        name = list(sides)[i % 2] if (i // 2) % 2 == 0 else list(sides)[1 - i % 2]  # ABBA
        target = Path(directory) / f"{name}-{i}"
        target.mkdir(exist_ok=True)
        dist.barrier()
        started = time.perf_counter()
        sides[name](target)
        dist.barrier()  # done when the slowest rank is
        times[name].append(time.perf_counter() - started)
        dist.barrier()
        if parallel.is_main():
            import shutil

            shutil.rmtree(target)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def measure_saves(args: argparse.Namespace) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    with scratch("save") as directory:
        processes = [
            context.Process(target=_save_worker, args=(r, args, port, directory, out))
            for r in range(2)
        ]
        for p in processes:
            p.start()
        times = out.get()
        for p in processes:
            p.join()
    summary = {
        name: {**spread(values, suffix="_s"), "all_s": [round(v, 3) for v in values]}
        for name, values in times.items()
    }
    summary["sharded_over_gathered"] = (
        summary["sharded"]["median_s"] / summary["gathered"]["median_s"]
    )
    return summary


def _worst(runs: list[dict[str, Any]], key: str) -> float | None:
    """The ratio furthest from 1 among the runs (None without runs)."""
    return max((r[key] for r in runs), key=lambda v: abs(v - 1.0), default=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="memory per rank by strategy; save times")
    parser.add_argument("--layers", type=int, default=16, help="hidden layers (default: 16)")
    parser.add_argument("--width", type=int, default=2048, help="hidden width (default: 2048)")
    parser.add_argument("--repeats", type=int, default=5, help="saves per side (default: 5)")
    parser.add_argument("--skip-runs", action="store_true", help="part 2 only")
    parser.add_argument("--show-progress", action="store_true", help="relay's lines on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    if not args.skip_runs:
        with relay_home("wall") as storage:
            for strategy, workers in RUNS:
                run = measure_run(args, storage, strategy, workers)
                runs.append(run)
                print(
                    f"{strategy} x{workers}: growth/rank "
                    + "/".join(f"{b / MiB:,.0f}" for b in run["growth_bytes_per_rank"])
                    + " MiB, start-up/rank "
                    + "/".join(f"{b / MiB:,.0f}" for b in run["startup_growth_bytes_per_rank"])
                    + " MiB, state/rank "
                    + "/".join(f"{b / MiB:,.0f}" for b in run["state_bytes_per_rank"])
                    + f" MiB; plan {run['plan_total_bytes'] / MiB:,.0f} MiB (state "
                    f"{run['plan_state_bytes'] / MiB:,.0f}); growth/plan "
                    f"{run['growth_over_plan']:.2f}, state/plan {run['state_over_plan']:.2f}, "
                    f"activations/plan {run['activations_over_plan']:.2f}; "
                    f"wall {run['wall_s']} s; others' CPU "
                    f"{busy_text(run['foreign_cpu_cores'])}",
                    flush=True,
                )
    saves = measure_saves(args)
    print(
        "checkpoint save at 2 workers (fsdp): gathered "
        f"{saves['gathered']['median_s']:.2f} s ({saves['gathered']['min_s']:.2f}-"
        f"{saves['gathered']['max_s']:.2f}), sharded {saves['sharded']['median_s']:.2f} s "
        f"({saves['sharded']['min_s']:.2f}-{saves['sharded']['max_s']:.2f})",
        flush=True,
    )
    by = {(r["strategy"], r["workers"]): r for r in runs}

    def ratio(strategy: str, workers: int, key: str = "growth_bytes_per_rank") -> float | None:
        if (strategy, workers) not in by or ("ddp", workers) not in by:
            return None
        ours, ddp = by[strategy, workers], by["ddp", workers]
        return max(ours[key]) / max(ddp[key])

    startup = "startup_growth_bytes_per_rank"

    print_results(
        {
            "bench": "memory_wall",
            "model": {"hidden": [args.width] * args.layers},
            "fsdp_over_ddp_growth_2": ratio("fsdp", 2),
            "fsdp_over_ddp_growth_4": ratio("fsdp", 4),
            "zero1_over_ddp_growth_2": ratio("zero1", 2),
            "zero1_over_ddp_growth_4": ratio("zero1", 4),
            # Building the model alone (fsdp: on the meta device, each rank materialising
            # its shards), before any step: the fullest rank's start-up peak over ddp's.
            "fsdp_over_ddp_startup_2": ratio("fsdp", 2, startup),
            "fsdp_over_ddp_startup_4": ratio("fsdp", 4, startup),
            # The plan's terms against the ranks' measured ones: the furthest from 1.
            "state_over_plan_worst": _worst(runs, "state_over_plan"),
            "activations_over_plan_worst": _worst(runs, "activations_over_plan"),
            "save_gathered_s": saves["gathered"]["median_s"],
            "save_sharded_s": saves["sharded"]["median_s"],
            "save_sharded_over_gathered": saves["sharded_over_gathered"],
            "saves": saves,
            "runs": runs,
            "busy_runs": warn_if_busy(runs) if runs else 0,
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
