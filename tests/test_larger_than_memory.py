"""Data larger than the object store, streamed from Parquet files: a driver of its own starts
Ray with a 75 MiB object store (Ray's minimum) and trains 2 workers for 2 epochs over 3× that
much data. Every row is seen exactly once per epoch (count and id checksums, from the run's own
metrics), and the driver's memory stays flat (its resident set, sampled from /proc while it
runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import REPO, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STORE_BYTES = 75 * 1024 * 1024
FEATURES = 2_048  # float32: 8 KiB of features per row
ROWS = 20_000  # ~164 MB of features: 2.1× the object store
FILES = 12
VAL_ROWS = 200

DRIVER = textwrap.dedent(
    """
    import json, os, sys, threading, time

    import ray

    import relay
    # imported up front
    import relay.training.driver, relay.training.data.sources, ray.data, ray.train.torch, torch
    from relay.config import from_dict

    config, store_bytes = json.loads(sys.argv[1]), int(sys.argv[2])
    ray.init(
        num_cpus=4,
        object_store_memory=store_bytes,
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},  # the workers import tests.*
        logging_level="ERROR",
    )
    samples, done = [], threading.Event()

    def rss():  # resident set of this process, from the kernel
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def sample():
        while not done.is_set():
            samples.append(rss())
            time.sleep(0.1)

    baseline = rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = relay.train(from_dict(config), out=None, register=False)
    done.set()
    sampler.join()
    store = ray.available_resources().get("object_store_memory")
    capacity = ray.cluster_resources()["object_store_memory"]
    # Leave Ray before the result line: its log monitor may print a raylet warning into
    # stdout at any moment until then.
    ray.shutdown()
    print(json.dumps({
        "history": result.history,
        "baseline_rss": baseline,
        "peak_rss": max(samples),
        "samples": len(samples),
        "store_capacity": capacity,
        "store_free_after": store,
    }))
    """
)


def _write(directory, first_id: int, rows: int, files: int) -> np.ndarray:
    """Parquet files of rows: id, x (FEATURES float32) and y; returns the ids."""
    directory.mkdir()
    ids = np.arange(first_id, first_id + rows)
    rng = np.random.default_rng(first_id)
    for i, part in enumerate(np.array_split(ids, files)):
        x = rng.standard_normal((len(part), FEATURES), dtype=np.float32)
        table = pa.table(
            {
                "id": part,
                # Arrow's fixed-shape tensor type: Ray Data hands it over as one (n, 256)
                # array without a copy (a plain list column is stacked row by row).
                "x": pa.FixedShapeTensorArray.from_numpy_ndarray(x),
                "y": x[:, :4].sum(axis=1),
            }
        )
        pq.write_table(table, directory / f"part-{i:02d}.parquet", compression="none")
    return ids


def test_training_streams_files_larger_than_the_object_store(tmp_path):
    train_ids = _write(tmp_path / "train", 0, ROWS, FILES)
    val_ids = _write(tmp_path / "val", 10_000_000, VAL_ROWS, 1)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "train").iterdir())
    assert on_disk > 2 * STORE_BYTES
    config = {
        "name": "larger-than-memory",
        "task": "tests.id_task:IdTask",
        "size": "debug",
        "model": {"features": FEATURES},
        "epochs": 2,
        "batch_size": 500,
        "storage": str(tmp_path / "relay"),
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "checkpoint": {"keep": 1},
        "data": {
            "format": "parquet",
            "path": str(tmp_path / "train"),
            "val": str(tmp_path / "val"),
        },
    }
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(config), str(STORE_BYTES)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])

    assert run["store_capacity"] <= STORE_BYTES * 1.05
    assert [epoch["epoch"] for epoch in run["history"]] == [1, 2]
    for epoch in run["history"]:
        # Every row exactly once per epoch across both ranks: count, and sums of id and id².
        assert epoch["train_count"] == ROWS
        assert epoch["train_id_sum"] == train_ids.sum()
        assert epoch["train_id_sq_sum"] == float((train_ids.astype(np.float64) ** 2).sum())
        assert epoch["val_count"] == VAL_ROWS
        assert epoch["val_id_sum"] == val_ids.sum()
    # The driver never held the data: its memory grew by well under a third of it.
    assert run["samples"] > 10
    growth = run["peak_rss"] - run["baseline_rss"]
    assert growth < on_disk / 3, f"driver RSS grew {growth / 2**20:.0f} MiB"
    print(
        f"driver RSS {run['baseline_rss'] / 2**20:.0f} → peak {run['peak_rss'] / 2**20:.0f} MiB; "
        f"data {on_disk / 2**20:.0f} MiB; object store {run['store_capacity'] / 2**20:.0f} MiB"
    )
