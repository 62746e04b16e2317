""".venv/bin/python bench/ingest.py [--repeats 3] [--epochs 3] [--batch-size 64]

How fast data reaches 2 trainer workers, three ways, in one run, over the same rows:

- `ray_data`: relay's file ingest (relay/training/data/sources.py → `TorchTrainer(datasets=)` →
  `data.ShardBatches`, streaming): Parquet files of text lines, tokenised on Ray Data's tasks
  by charlm's `preprocess` (lines packed into windows of block_size + 1 bytes);
- `in_memory`: the same windows, tokenised up front, through relay's object-store ingest
  (`ingest.put_split` → each rank's rows held as tensors);
- `dataloader`: plain PyTorch: 2 trainer processes, each with a `torch.utils.data.DataLoader`
  of 1 worker process (2 reader processes in all, as Ray Data's tasks get the 2 CPUs the
  trainers leave), reading its half of the same Parquet files with pyarrow and running the same
  `preprocess`; shuffled as relay shuffles streamed files (a new seeded file order each epoch,
  batches drawn at random from a buffer of 4 batches' rows), so both sides do the same work.

The ranks only iterate their batches (no model): what is timed is delivery. Each side runs
`--epochs` epochs per repeat, the first left out as warm-up; a side's rate is rows delivered to
both ranks / the slower rank's seconds, per epoch; the median (min–max) over repeats × epochs is
reported, the sides alternating over repeats.

Then one real run: `relay train` of charlm debug (2 workers, streaming the same Parquet) and
its `input_wait_share` (time the ranks waited for a batch / the training pass), median over the
epochs after the first.

Ends with one JSON line: per side the rate, `ray_data_vs_dataloader` (median rates) and
`ray_data_vs_in_memory`, and `trainer_idle_share`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from harness import alternated_sides, print_results, scratch, spread
from relay.config import RunConfig, from_dict
from relay.runtime import cluster
from relay.tasks import build_task
from relay.training import driver
from relay.training.data import ingest
from relay.training.data.raydata import SHUFFLE_BUFFER_BATCHES

SIDES = ("ray_data", "in_memory", "dataloader")
FILES = 8
WORKERS = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    return parser.parse_args()


def write_corpus(root: Path, limit: int) -> Path:
    """Lines of Python's own standard library as Parquet files with one `text` column."""
    from relay.tasks.charlm import default_corpus, read_corpus

    lines = read_corpus(default_corpus(), limit).decode("utf-8", errors="replace").split("\n")
    out = root / "corpus"
    out.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(lines)), FILES)):
        table = pa.table({"text": [lines[j] for j in part]})
        pq.write_table(table, out / f"part-{i}.parquet")
    return out


def run_config(corpus: Path, args, epochs: int) -> RunConfig:
    return from_dict(
        {
            "name": "bench-ingest",
            "task": "charlm",
            "size": "debug",
            "epochs": epochs,
            "batch_size": args.batch_size,
            "scaling": {"num_workers": WORKERS, "resources_per_worker": {"CPU": 1}},
            # Validation files are the train files: the bench times the train part only.
            "data": {"format": "parquet", "path": str(corpus), "val": str(corpus)},
        }
    )


# --- relay's two ingests, inside a real worker group ------------------------------------------


def _deliver(loop_config: dict) -> list[dict] | None:
    """Each rank iterates its train batches for the epochs; rank 0 returns every rank's
    seconds and rows per epoch."""
    import torch.distributed as dist

    from relay.training.data import ingest as worker_ingest

    batches = worker_ingest.open_batches(
        loop_config["data"],
        "train",
        batch_size=loop_config["batch_size"],
        dtypes={"tokens": torch.long},
        device=torch.device("cpu"),
        cache=False,
        shuffle=True,
        seed=0,
    )
    batches.load()
    mine = []
    for epoch in range(1, loop_config["epochs"] + 1):
        dist.barrier()
        started, rows = time.perf_counter(), 0
        for batch in batches.epoch(epoch):
            rows += len(batch["tokens"])
        mine.append({"seconds": time.perf_counter() - started, "rows": rows})
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks if dist.get_rank() == 0 else None


def through_relay(cfg: RunConfig, data: ingest.RunData, epochs: int) -> list[dict]:
    import ray.train
    from ray.train.torch import TorchTrainer

    result = TorchTrainer(
        _deliver,
        train_loop_config={
            "data": data.loop_data(),
            "batch_size": cfg.batch_size,
            "epochs": epochs,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=WORKERS, resources_per_worker={"CPU": 1}
        ),
        run_config=ray.train.RunConfig(
            name=f"bench-ingest-{time.time_ns()}", storage_path=tempfile.gettempdir()
        ),
        datasets=data.datasets,
    ).fit()
    return _per_epoch(result.return_value)


def _per_epoch(ranks: list[list[dict]]) -> list[dict]:
    """Rows delivered to all ranks and the slower rank's seconds, epoch by epoch."""
    return [
        {
            "rows": sum(rank[e]["rows"] for rank in ranks),
            "seconds": max(rank[e]["seconds"] for rank in ranks),
        }
        for e in range(len(ranks[0]))
    ]


def in_memory_data(cfg: RunConfig) -> ingest.RunData:
    """The same windows, tokenised on the driver, put in the object store as relay puts them."""
    task = build_task(cfg.task, cfg.size)
    lines = pq.read_table(cfg.data.path)["text"].to_numpy(zero_copy_only=False)
    windows = task.preprocess({"text": lines})
    put = ingest.PutSplit(
        ingest.data_source(cfg),
        ingest.PutColumns.put(windows),
        ingest.PutColumns.put({"tokens": windows["tokens"][:WORKERS]}),
    )
    return ingest.RunData(ingest.Ingest.OBJECT_STORE, put.train.rows, put=put)


# --- plain PyTorch ---------------------------------------------------------------------------


class ParquetWindows(torch.utils.data.IterableDataset):
    """One rank's files, batch by batch: read with pyarrow in a new seeded order each epoch,
    tokenised by the task's `preprocess`, and batches of `batch_size` windows drawn at random
    from a buffer of relay's default `data.shuffle_buffer` of batches' rows."""

    def __init__(self, files: list[str], cfg_dict: dict, batch_size: int) -> None:
        self.files, self.cfg_dict, self.batch_size = files, cfg_dict, batch_size
        self.epoch = 0  # counted in the (persistent) worker process's copy

    def __iter__(self):
        self.epoch += 1
        rng = np.random.default_rng(self.epoch)
        task = build_task(self.cfg_dict["task"], self.cfg_dict["size"])
        buffer_rows = SHUFFLE_BUFFER_BATCHES * self.batch_size
        buffer = None
        for index in rng.permutation(len(self.files)):
            for record_batch in pq.ParquetFile(self.files[index]).iter_batches(batch_size=4_096):
                text = record_batch.column("text").to_numpy(zero_copy_only=False)
                tokens = task.preprocess({"text": text})["tokens"]
                buffer = tokens if buffer is None else np.concatenate([buffer, tokens])
                while len(buffer) >= buffer_rows:
                    order = rng.permutation(len(buffer))
                    yield torch.as_tensor(buffer[order[: self.batch_size]], dtype=torch.long)
                    buffer = buffer[order[self.batch_size :]]
        if buffer is not None:
            for lo in range(0, len(buffer), self.batch_size):
                yield torch.as_tensor(buffer[lo : lo + self.batch_size], dtype=torch.long)


def _dataloader_rank(rank: int, files: list[str], cfg_dict: dict, args, epochs: int, out):
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(
        ParquetWindows(files[rank::WORKERS], cfg_dict, args.batch_size),
        batch_size=None,
        num_workers=1,
        persistent_workers=True,
    )
    mine = []
    for _ in range(epochs):
        started, rows = time.perf_counter(), 0
        for batch in loader:
            rows += len(batch)
        mine.append({"seconds": time.perf_counter() - started, "rows": rows})
    out.put((rank, mine))


def through_dataloader(cfg: RunConfig, args, epochs: int) -> list[dict]:
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    files = sorted(str(p) for p in Path(cfg.data.path).glob("*.parquet"))
    cfg_dict = {"task": cfg.task, "size": cfg.size}
    ranks = [
        context.Process(target=_dataloader_rank, args=(r, files, cfg_dict, args, epochs, queue))
        for r in range(WORKERS)
    ]
    for process in ranks:
        process.start()
    results = dict(queue.get() for _ in ranks)
    for process in ranks:
        process.join()
    return _per_epoch([results[r] for r in range(WORKERS)])


# --- the run -------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    with scratch("ingest") as tmp:
        corpus = write_corpus(Path(tmp), args.corpus_bytes)
        cfg = run_config(corpus, args, args.epochs)
        # As `relay train` starts it for this config: one CPU more than the 2 workers reserve,
        # for Ray Data's tasks (ingest.cpus_to_start).
        cluster.connect(num_cpus=ingest.cpus_to_start(cfg))
        rates: dict[str, list[float]] = {side: [] for side in SIDES}
        rows: dict[str, list[int]] = {side: [] for side in SIDES}
        for side in alternated_sides(SIDES, args.repeats):
            if side == "ray_data":
                epochs = through_relay(cfg, ingest.prepare(cfg), args.epochs)
            elif side == "in_memory":
                epochs = through_relay(cfg, in_memory_data(cfg), args.epochs)
            else:
                epochs = through_dataloader(cfg, args, args.epochs)
            steady = epochs[1:] or epochs
            rates[side] += [e["rows"] / e["seconds"] for e in steady]
            rows[side] += [e["rows"] for e in steady]
            print(
                f"  {side:<11} "
                + "  ".join(f"{e['rows'] / e['seconds']:9,.0f}" for e in steady)
                + " rows/s",
                flush=True,
            )
        windows = ingest.prepare(cfg).train_rows
        run = run_config(corpus, args, epochs=3).model_dump()
        # A real run: validation is a fifth of the lines, by a hash of each line.
        run["data"] = {"format": "parquet", "path": str(corpus), "val_fraction": 0.2}
        train = from_dict({**run, "storage": str(Path(tmp) / "relay")})
        result = driver.fit(train, out=None, register=False)
    idle = [e["input_wait_share"] for e in result.history[1:]]
    sides = {side: spread(values) for side, values in rates.items()}
    figures = {
        "ray_data_vs_dataloader": sides["ray_data"]["median"] / sides["dataloader"]["median"],
        "ray_data_vs_in_memory": sides["ray_data"]["median"] / sides["in_memory"]["median"],
        "trainer_idle_share": statistics.median(idle),
        "trainer_idle_share_epochs": idle,
        "rows_per_s": sides,
        "rows_per_epoch": {side: sorted(set(values)) for side, values in rows.items()},
        "windows": windows,
        "corpus_bytes": args.corpus_bytes,
        "files": FILES,
        "workers": WORKERS,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "repeats": args.repeats,
    }
    print_results(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
