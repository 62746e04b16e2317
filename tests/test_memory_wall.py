"""The memory wall, enforced by the OS: each worker process may allocate 512 MiB for training
(`scaling.memory_per_worker`), and the model's fp32 weights, gradients and Adam state take
~963 MiB — about twice that. ddp, which keeps all of it on every rank, must fail cleanly
naming the rank; fsdp on 4 workers (1/4 of it per rank, meta-initialised, sharded checkpoints)
must train, lose a worker, and resume under the same limit. An out-of-memory ends the run at
once (no restart would get past it); a killed worker restarts as any failure does."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support import process_gone, train_worker_pids

import relay
from relay.checkpoints import checkpoint
from relay.config import from_dict
from relay.records import history, registry
from relay.runtime import worker_memory
from relay.training import plan
from relay.training.efficiency.on_workers import PROBE_PASS_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT = "512MiB"
WIDE = [2048] * 16  # a 63.1M-parameter MLP: 16 bytes/parameter ~ 963 MiB


def _config(
    name: str, strategy: str, workers: int, cpus: float, epochs: int, failures: int, **fields
):
    return from_dict(
        {
            "name": name,
            "task": "digits",
            "size": "default",
            "model": {"hidden": WIDE, "dropout": 0.0},
            "epochs": epochs,
            "batch_size": 64,
            "optim": {"lr": 1e-4},
            "parallel": {"strategy": strategy},
            "scaling": {
                "num_workers": workers,
                "resources_per_worker": {"CPU": cpus},
                "memory_per_worker": LIMIT,
            },
            "failure": {"max_failures": failures},
            "checkpoint": {"keep": None},
            **fields,
        }
    )


def planned_parameters(cfg) -> int:
    return plan.plan(cfg, 1, device_memory=64 << 30)["model"]["parameters"]


def _only_run(storage: Path, name: str) -> dict:
    (run,) = [r for r in registry.list_runs(storage) if r["run_id"].startswith(f"{name}-")]
    return run


def _groups_left(run_id: str) -> list[Path]:
    cgroups = Path("/sys/fs/cgroup/memory")
    return list(cgroups.rglob(f"{worker_memory.PREFIX}{run_id}-rank*")) if cgroups.exists() else []


def test_ddp_past_the_limit_fails_naming_the_rank_and_the_way_out(ray_cluster, relay_home):
    # Restarts allowed, but an out-of-memory at the limit ends the run at once: the same
    # wall would be met on every try.
    cfg = _config("wall-ddp", "ddp", workers=2, cpus=1, epochs=1, failures=2)
    started = time.monotonic()
    with pytest.raises(worker_memory.OutOfMemory) as failed:
        relay.train(cfg, out=None)
    message = str(failed.value)
    assert message.startswith("out of memory on rank "), message
    assert "512.0MiB (scaling.memory_per_worker)" in message
    assert "every rank holds the whole model (63.1M parameters" in message
    assert "parallel.strategy: fsdp" in message and "relay plan" in message
    assert time.monotonic() - started < 300  # failed, not hung

    run = _only_run(relay_home, "wall-ddp")
    assert run["status"] == "failed"
    assert "out of memory on rank" in run["error"]
    assert len(history.failure_times(run["run_dir"])) == 1  # one failure, no restart
    assert _groups_left(run["run_id"]) == []  # the per-rank cgroups are gone with the run


def test_fsdp_trains_checkpoints_and_resumes_under_the_same_limit(ray_cluster, relay_home):
    # 512 training rows: two steps an epoch on 4 ranks of 64. What is measured is a step's and
    # a forward's memory, which the epoch's length does not change; each step here takes seconds.
    cfg = _config(
        "wall-fsdp", "fsdp", workers=4, cpus=0.5, epochs=2, failures=1, data={"val_fraction": 0.665}
    )
    killed: list[int] = []

    def kill_a_worker_after_the_first_epoch():
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            runs = [
                r for r in registry.list_runs(relay_home) if r["run_id"].startswith("wall-fsdp")
            ]
            # Once Ray Train has registered epoch 1's checkpoint (every rank's shards in).
            if runs and (checkpoint.latest_registered(runs[0]["run_dir"]) or (None, None))[1]:
                pids = train_worker_pids()
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    killed.append(pids[-1])
                    return
            time.sleep(0.5)

    killer = threading.Thread(target=kill_a_worker_after_the_first_epoch, daemon=True)
    killer.start()
    result = relay.train(cfg, out=None, register=False)  # no registry check here
    killer.join(timeout=5)

    assert killed and process_gone(killed[0])
    run_dir = Path(result.run_dir)
    assert history.failure_times(run_dir), "the kill restarted the worker group"
    epochs = [e["epoch"] for e in history.read_raw(run_dir)]
    # The restarted group took up from epoch 1's checkpoint: no epoch trained twice.
    assert epochs == [1, 2], epochs
    # A step of this model takes seconds: the efficiency report timed one step per pass (after
    # a warm-up one), not three, so it cost the run a few steps' time.
    assert result.efficiency["step"]["probe_steps_per_pass"] == 1
    assert result.efficiency["step"]["step_s"] > PROBE_PASS_S, result.efficiency["step"]
    assert result.memory["mechanism"] in ("cgroup", "rlimit")
    assert result.memory["bytes"] == 512 * 2**20

    # Every rank stayed under the limit, holding a quarter of the model's state (plus FSDP's
    # padding) — what ddp could not.
    per_rank = result.efficiency["memory"]["per_rank"]
    assert len(per_rank) == 4
    for rank in per_rank:
        assert rank["peak_growth_bytes"] < 512 * 2**20, rank
        assert rank["state_bytes"] < 963 * 2**20 / 4 * 1.05, rank
    # Start-up — the resumed attempt's: built on the meta device, its quarter of the weights
    # and Adam state loaded from the shards — held far less than the whole state that a ddp
    # rank loads (16 bytes/parameter): the kernel's high-water mark of each rank. (Measured
    # here: ~0.34 of it on rank 0, a quarter plus DCP's read buffers.)
    whole_state = 16 * planned_parameters(cfg)
    for rank in per_rank:
        assert 0 < rank["startup_growth_bytes"] < 0.5 * whole_state, (rank, whole_state)
    # `relay plan` for this config, term by term, against what each rank measured: state from
    # the live tensors' storages, activations from the memory one forward added (the plan
    # counts them through autograd's saved-tensor hooks in this process). Within 15%: the plan
    # is the fullest rank's (FSDP pads the last rank less), and the kernel counts pages.
    planned = plan.plan(cfg, 4, device_memory=64 << 30)["strategies"]["fsdp"]
    for rank in per_rank:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert rank[key] == pytest.approx(planned[key], rel=0.15), (key, rank, planned)
        assert rank["activation_bytes"] <= 1.15 * planned["activation_bytes"], (rank, planned)
    # Activations are resident pages a forward adds: a rank whose forward lands on pages it
    # already had resident counts less (seen once in CI: rank 0 at 9.8 MB, the others at ~17 MB,
    # within 15% of the plan). So the fullest rank is held to the plan, and none may exceed it.
    fullest = max(rank["activation_bytes"] for rank in per_rank)
    assert fullest == pytest.approx(planned["activation_bytes"], rel=0.15), (per_rank, planned)
    last = Path(result.last_checkpoint)
    assert checkpoint.read_meta(last)["format"] == "sharded"
    shards = sorted(p.name for p in (last / checkpoint.SHARDS).iterdir())
    assert shards == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert _groups_left(result.run_id) == []
