"""The plain-torchrun baseline: relay's epoch code, run by torchrun instead of Ray.

.venv/bin/torchrun --nnodes 1 --nproc_per_node N --master_addr 127.0.0.1 --master_port PORT \
    bench/torchrun_ddp.py --config '<RunConfig as JSON>' --out timings.json

Each process runs what one relay Train worker runs (relay/training/worker_loop.py's
`train_loop_per_worker`),
by importing the same code rather than restating it: `relay.parallel.Engine` (the same
strategy wrapping, DDP options, precision, gradient accumulation and clipping),
`relay.training.epochs.Epochs` (the same passes, with the training-pass clock stopped at the same
point,
before the cross-rank sum of the statistics), the optimizer and LR schedule from the shared
builders with the real number of steps per epoch, and `relay.training.epochs.CachedBatches` (relay's
`data.cache` mode: the shard held as tensors, a seeded permutation per epoch). Threads per
process, seed and every setting come from the RunConfig, as in relay.

What differs is what Ray does: the process group comes from torchrun; each rank's shard is a
contiguous slice of floor(rows / world) rows of the task's split instead of Ray Data's
`streaming_split(equal=True)` (the same number of rows, other rows); nothing is reported or
checkpointed (that is the point of the comparison). `data.cache: false` (streaming from Ray
Data) has no equivalent here and is refused.

Rank 0 writes per-epoch metrics and timings and absolute `time.time()` stamps (process start,
end of each epoch), plus `steady` (Epochs.steady(): the training passes of epochs 2..N, as
relay's efficiency report counts them), as JSON to `--out`. It imports no Ray (relay.training.epochs
and relay.parallel are Ray-free), so start-up is torch + the task only.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: they are part of start-up

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import NoReturn  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from relay import parallel  # noqa: E402
from relay.config import ConfigError, RunConfig, from_dict  # noqa: E402
from relay.tasks import build_task  # noqa: E402
from relay.tasks.base import Columns  # noqa: E402
from relay.training.epochs import (  # noqa: E402
    CachedBatches,
    Epochs,
    build_scheduler,
    optimizer_spec,
    steps_per_epoch,
    to_tensors,
)

IMPORTED = time.time()


def load_config(text: str) -> RunConfig:
    """The RunConfig from `--config`, or exit 2 with a message naming what is wrong."""
    try:
        cfg = from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        _refuse(f"not valid JSON ({exc})")
    except ConfigError as exc:
        _refuse(str(exc))
    if not cfg.data.caches or cfg.data.from_files:
        _refuse("data.cache: false and data from files stream from Ray Data; the baseline caches")
    return cfg


def _refuse(message: str) -> NoReturn:
    print(f"torchrun_ddp.py --config: {message}", file=sys.stderr)
    sys.exit(2)


def shard(columns: Columns, rank: int, world: int) -> Columns:
    """This rank's floor(n / world) rows: as many as Ray Data's equal split gives it."""
    per_rank = len(next(iter(columns.values()))) // world
    return {name: array[rank * per_rank : (rank + 1) * per_rank] for name, array in columns.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a relay RunConfig, as JSON")
    parser.add_argument("--out", required=True, help="where rank 0 writes its timings (JSON)")
    args = parser.parse_args()
    cfg = load_config(args.config)

    gpu = cfg.scaling.use_gpu
    dist.init_process_group("nccl" if gpu else "gloo")
    joined = time.time()
    rank, world = parallel.rank(), parallel.world_size()
    # Ray Train's get_device() under relay; here this process's GPU by torchrun's local rank.
    parallel.set_device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if gpu else "cpu")
    # The CPUs a relay worker reserves (ScalingConfig.cpus_per_worker): threads default to them.
    reserved = (cfg.scaling.resources_per_worker or {}).get("CPU", 1.0)
    parallel.set_threads(cfg.scaling.threads_per_worker, reserved)

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    engine = parallel.Engine(task.build_model(), cfg.parallel, *optimizer_spec(cfg.optim))

    split = task.load_data(cfg.data.val_fraction, cfg.seed)
    train_rows = len(next(iter(split.train.values())))
    steps = steps_per_epoch(train_rows, world, cfg.batch_size, cfg.parallel.grad_accum)
    scheduler = build_scheduler(cfg.schedule, engine.optimizer, steps, cfg.epochs)

    def batches(columns: Columns, shuffle: bool) -> CachedBatches:
        tensors = to_tensors(shard(columns, rank, world), task.input_columns(), parallel.device())
        return CachedBatches(tensors, batch_size=cfg.batch_size, shuffle=shuffle, seed=cfg.seed)

    train_data, val_data = batches(split.train, cfg.data.shuffle), batches(split.val, False)
    ready = time.time()

    epochs = Epochs(task, engine, scheduler, cfg)
    per_epoch = []
    for epoch in range(1, cfg.epochs + 1):
        metrics = epochs.epoch(epoch, train_data.epoch(epoch), val_data.epoch(epoch))
        this_pass = epochs.passes[-1]
        per_epoch.append(
            {
                **metrics,
                "train_s": this_pass["seconds"],
                "train_samples": this_pass["samples"],
                "steps": this_pass["steps"],
                "ended_at": time.time(),
            }
        )

    # What every rank computed with, as relay's workers record it (a collective: all ranks).
    cpu = parallel.gather_objects(parallel.cpu_setup())
    if rank == 0:
        result = {
            "process_start": PROCESS_START,
            "first_epoch_end": per_epoch[0]["ended_at"],
            "process_start_to_first_epoch_s": per_epoch[0]["ended_at"] - PROCESS_START,
            # Where start-up went, seconds from process start (rank 0).
            "startup_s": {
                "imports": IMPORTED - PROCESS_START,
                "process_group": joined - PROCESS_START,
                "model_and_data": ready - PROCESS_START,
            },
            "world_size": world,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpu": cpu,
            "steps_per_epoch": steps,
            "steady": epochs.steady(),
            "epochs": per_epoch,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    parallel.barrier()  # the other ranks must not tear gloo down while rank 0 still writes
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo's threads occasionally abort the process there
    # ("terminate called without an active exception", SIGABRT) after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
