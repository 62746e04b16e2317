"""Launching the plain-torchrun baseline (bench/torchrun_ddp.py) on one RunConfig: shared by
bench/train_overhead.py and bench/scaling.py."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(cfg, out_dir: Path, name: str) -> dict[str, Any]:
    """`torchrun --nproc_per_node <cfg.scaling.num_workers>` of the baseline on `cfg` (a
    relay RunConfig); its per-epoch figures as rank 0 wrote them, plus the launch timings.

    first_epoch_s: from just before the launch to rank 0's `time.time()` at the end of epoch 1.
    steady_samples_per_s: the median of the per-epoch samples/s of epochs 2..N (relay's
    history gives the same figure). report_samples_per_s: the samples of the training passes
    of epochs 2..N over their seconds (`Epochs.steady()`, as relay's efficiency report)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    out = out_dir / f"{name}.json"
    cmd = [
        str(torchrun),
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(cfg.scaling.max_workers),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(HERE / "torchrun_ddp.py"),
        "--config",
        json.dumps(cfg.model_dump(mode="json")),
        "--out",
        str(out),
    ]
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall_s = time.time() - launched
    try:
        data = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        data = None
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        if data is None:
            raise RuntimeError(f"torchrun failed with exit status {proc.returncode}")
        # Rank 0 wrote every epoch's timings before the failure: a crash at teardown.
        print(f"warning: torchrun exited {proc.returncode} after writing its timings", flush=True)
    epochs = data["epochs"]
    per_epoch = [e["samples_per_s"] for e in epochs]
    steady = data["steady"]
    return {
        "workers": data["world_size"],
        "threads": data["threads"],
        "cpu": data["cpu"],  # per rank: threads, allowed cores, niceness (parallel.cpu_setup)
        "first_epoch_s": data["first_epoch_end"] - launched,
        "process_start_to_first_epoch_s": data["process_start_to_first_epoch_s"],
        "startup_s": data["startup_s"],
        "wall_s": wall_s,
        "samples_per_s": per_epoch,
        "steady_samples_per_s": statistics.median(per_epoch[1:] or per_epoch),
        "report_samples_per_s": steady["samples"] / steady["seconds"],
        "steps_per_epoch": data["steps_per_epoch"],
        "epoch_ends": [e["ended_at"] for e in epochs],
        "epoch_s": [e["epoch_s"] for e in epochs],
        "train_samples": epochs[0]["train_samples"],
        "last": epochs[-1],
    }
