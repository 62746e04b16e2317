"""The plain-torchrun side of bench/train_overhead.py: relay's epoch, without Ray.

.venv/bin/torchrun --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
    bench/torchrun_ddp.py --config '<RunConfig as JSON>' --out timings.json

Each process does what one relay Train worker does (relay/loop.py, relay/data.py,
relay/parallel.py) with Ray taken out: one intra-op thread, the same seed, the same task model
wrapped in DDP over gloo, the same optimizer and constant schedule stepped per batch, a shard of
floor(rows / world) training rows (and validation rows) per rank, reshuffled each epoch with the
same seeded generator, the task's `loss_and_stats` per step, statistics summed on the host and
all-reduced once per pass, a validation pass per epoch, and samples/s = global training samples /
seconds of the training pass. No checkpoints, no reports: that is the point of the comparison.

Rank 0 writes per-epoch timings and absolute `time.time()` stamps (process start, end of each
epoch) as JSON to `--out`. It imports no Ray, so start-up is torch + the task only.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: they are part of start-up

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from relay.tasks import build_task  # noqa: E402

IMPORTED = time.time()


def build_optimizer(optim: dict, params) -> torch.optim.Optimizer:
    """relay.loop.build_optimizer, from the config dict (that module imports Ray)."""
    if optim["name"] == "sgd":
        return torch.optim.SGD(
            params, lr=optim["lr"], momentum=optim["momentum"], weight_decay=optim["weight_decay"]
        )
    cls = torch.optim.AdamW if optim["name"] == "adamw" else torch.optim.Adam
    return cls(params, lr=optim["lr"], weight_decay=optim["weight_decay"])


def shard(columns: dict, dtypes: dict, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's floor(n / world) contiguous rows, as tensors (relay's cached shard)."""
    n = len(next(iter(columns.values())))
    per_rank = n // world
    lo = rank * per_rank
    out = {}
    for name, array in columns.items():
        tensor = torch.as_tensor(array[lo : lo + per_rank].copy())
        out[name] = tensor.to(dtype=dtypes.get(name, tensor.dtype))
    return out


def batches(tensors: dict, batch_size: int, shuffle: bool, seed: int, epoch: int):
    """relay.data.ShardBatches.epoch in cache mode."""
    n = len(next(iter(tensors.values())))
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(n, generator=generator)
    else:
        order = torch.arange(n)
    for start in range(0, n, batch_size):
        index = order[start : start + batch_size]
        yield {name: tensor[index] for name, tensor in tensors.items()}


def sum_across_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    names = sorted(values)
    packed = torch.stack([values[n].detach().double().cpu() for n in names])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(names, packed.tolist(), strict=True))


def run_epoch(task, model, data, *, optimizer=None, scheduler=None, grad_clip=None) -> dict:
    """relay.loop._run_epoch, line for line."""
    training = optimizer is not None
    model.train(training)
    sums = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    with torch.set_grad_enabled(training):
        for batch in data:
            loss, stats = task.loss_and_stats(model, batch)
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if grad_clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                scheduler.step()
            for name, value in stats.items():
                sums[name] = sums[name].to(value.device) + value.detach().double()
    return sum_across_ranks(sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a relay RunConfig, as JSON")
    parser.add_argument("--out", required=True, help="where rank 0 writes its timings (JSON)")
    args = parser.parse_args()
    cfg = json.loads(args.config)

    dist.init_process_group("gloo")
    joined = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    # relay.parallel.set_threads: one intra-op thread per CPU a worker reserves (default 1).
    reserved = (cfg["scaling"]["resources_per_worker"] or {}).get("CPU", 1.0)
    torch.set_num_threads(cfg["scaling"]["threads_per_worker"] or max(1, int(reserved)))

    torch.manual_seed(cfg["seed"])
    task = build_task(cfg["task"], cfg["size"], cfg["model"], cfg["data"]["path"])
    model = DistributedDataParallel(task.build_model())
    optimizer = build_optimizer(cfg["optim"], model.parameters())
    # relay's schedule with the default config: a constant multiplier, stepped per batch.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    split = task.load_data(cfg["data"]["val_fraction"], cfg["seed"])
    dtypes = task.input_columns()
    train_data = shard(split.train, dtypes, rank, world)
    val_data = shard(split.val, dtypes, rank, world)
    batch_size, shuffle, seed = cfg["batch_size"], cfg["data"]["shuffle"], cfg["seed"]
    ready = time.time()

    epochs = []
    for epoch in range(1, cfg["epochs"] + 1):
        started = time.perf_counter()
        train = run_epoch(
            task,
            model,
            batches(train_data, batch_size, shuffle, seed, epoch),
            optimizer=optimizer,
            scheduler=scheduler,
            grad_clip=cfg["optim"]["grad_clip"],
        )
        train_s = time.perf_counter() - started
        val = run_epoch(task, model, batches(val_data, batch_size, False, seed, epoch))
        epochs.append(
            {
                "epoch": epoch,
                **{f"train_{k}": v for k, v in task.summarize(train).items()},
                **{f"val_{k}": v for k, v in task.summarize(val).items()},
                "samples_per_s": train["count"] / train_s,
                "train_s": train_s,
                "epoch_s": time.perf_counter() - started,
                "train_samples": train["count"],
                "ended_at": time.time(),
            }
        )

    if rank == 0:
        result = {
            "process_start": PROCESS_START,
            "first_epoch_end": epochs[0]["ended_at"],
            "process_start_to_first_epoch_s": epochs[0]["ended_at"] - PROCESS_START,
            # Where start-up went, seconds from process start (rank 0).
            "startup_s": {
                "imports": IMPORTED - PROCESS_START,
                "process_group": joined - PROCESS_START,
                "model_and_data": ready - PROCESS_START,
            },
            "world_size": world,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "epochs": epochs,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()  # rank 1 must not tear gloo down while rank 0 still writes
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo's threads occasionally abort the process there
    # ("terminate called without an active exception", SIGABRT) after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
