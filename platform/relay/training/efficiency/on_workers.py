"""The efficiency report's measurements, on the workers at the end of training: every rank calls
`measure` (a collective), rank 0 combines the ranks' figures into the report the driver completes
(relay.training.efficiency.on_driver.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver imports this module; torch loads only on the workers
    import torch

    from relay import parallel
    from relay.config import RunConfig
    from relay.tasks import Task
    from relay.tasks.base import Batch
    from relay.training.epochs import Epochs

# --- on the workers (every rank calls `measure`: it is a collective) ---------------------------


# Bumped whenever a figure's definition changes: speedups compare reports of one version only.
# 3: state bytes measured per storage (footprint.py), peak growth, the matmul-peak fraction
# renamed from "mfu" with the peak the best of several sizes, attention FLOPs counted on CPU,
# start-up of the worker group that finished.
REPORT_VERSION = 3

# How the matmul peak is measured, on every worker at once with its own thread count: square
# matrices in the compute dtype, sizes doubling from the first; a size is timed `timings` times
# (each timing at least `min_timing_s` of back-to-back matmuls) and its best kept; the peak is
# the best size's. The sizes stop growing once one matmul takes over `max_matmul_s` (so the
# probe costs about a second). Several sizes, because the fastest one differs by machine and
# dtype: fp32 on a CPU peaks at the large ones, bf16 without native bf16 instructions at the
# small ones (its large matmuls are several times slower per FLOP).
PEAK_PROBE = {
    "matrix_sizes": [64, 128, 256, 512, 1024, 2048, 4096],
    "timings": 5,
    "min_timing_s": 0.005,
    "max_matmul_s": 0.05,
}


# The step split times the same micro-batch in passes of up to PROBE_STEPS forward/backwards
# (2 passes, or 4 when communication is measured: each timed pass after a warm-up one). A pass
# is held to about PROBE_PASS_S of training's own step time, never below one step: a model
# whose step takes seconds pays a few extra steps for its report, not a dozen.
PROBE_STEPS = 3
PROBE_PASS_S = 2.0


def probe_steps(micro_step_s: float) -> int:
    """Forward/backwards per timed pass for a training micro-step of `micro_step_s`."""
    return max(1, min(PROBE_STEPS, int(PROBE_PASS_S // max(micro_step_s, 1e-9))))


def _slowest_micro_step_s(epochs: Epochs, grad_accum: int) -> float:
    """Training's seconds per micro-step in the last pass, the slowest rank's (every rank gets
    the same figure, so all time the same number of steps: they run in lock-step)."""
    from relay import parallel

    last = epochs.passes[-1]
    mine = last["seconds"] / max(1, last["steps"] * grad_accum)
    return max(parallel.gather_objects(mine))


# The matmul peak measured in this process, by (device, dtype, torch threads): a process that
# trains run after run (a sweep's reused trial actor, in_process.py) probes its cores once, not
# once per trial (the probe is ~0.5 s, several times a small trial's epoch).
_peaks: dict[tuple[str, str, int], dict[str, float]] = {}


def matmul_peak(dtype: torch.dtype) -> dict[str, float]:
    """This worker's best dense matmul rate, as PEAK_PROBE says: {"flops_per_s", "size",
    "reused"}; "reused" is true when this process measured it for an earlier run."""
    import torch

    from relay import parallel

    key = (str(parallel.device()), str(dtype), torch.get_num_threads())
    if key in _peaks:
        return {**_peaks[key], "reused": True}
    _peaks[key] = _probe_matmul_peak(dtype)
    return {**_peaks[key], "reused": False}


def _probe_matmul_peak(dtype: torch.dtype) -> dict[str, float]:
    import math

    import torch

    from relay import parallel

    def timed(a, b, reps: int) -> float:
        parallel.synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            a @ b
        parallel.synchronize()
        return (time.perf_counter() - started) / reps

    best = {"flops_per_s": 0.0, "size": 0}
    for n in PEAK_PROBE["matrix_sizes"]:
        a = torch.randn(n, n, device=parallel.device(), dtype=dtype)
        b = torch.randn(n, n, device=parallel.device(), dtype=dtype)
        once = timed(a, b, 1)  # also the warm-up
        if once > PEAK_PROBE["max_matmul_s"] and best["size"]:
            break
        reps = max(1, math.ceil(PEAK_PROBE["min_timing_s"] / max(once, 1e-9)))
        seconds = min(timed(a, b, reps) for _ in range(PEAK_PROBE["timings"]))
        rate = 2 * n**3 / seconds
        if rate > best["flops_per_s"]:
            best = {"flops_per_s": rate, "size": n}
    return best


def measure(
    task: Task,
    engine: parallel.Engine,
    epochs: Epochs,
    batch: Batch,
    cfg: RunConfig,
    memory_at_start: int,
    startup_peak: int,
):
    """Measure this process's training and return the combined report on rank 0 (None on the
    others). Runs after the last epoch, so it costs a few extra steps and changes no weights.
    `memory_at_start`: what the rank held before it built anything (`current_memory()`);
    `startup_peak`: the most it held while building the model and loading its state."""

    from relay import parallel
    from relay.training import footprint

    # Gradients of the last step are still allocated: this is the state a step holds.
    state = footprint.state_bytes(engine.model, engine.optimizer)
    memory = parallel.peak_memory()  # training's: before the probes below add their own
    # fsdp's unsynchronised pass holds whole gradients (nothing reduce-scatters them): past a
    # worker's hard memory limit that would end it after training succeeded, so there only
    # the synchronised pass is timed.
    sync_only = bool(cfg.scaling.memory_per_worker) and cfg.parallel.strategy == "fsdp"
    steps = probe_steps(_slowest_micro_step_s(epochs, cfg.parallel.grad_accum))
    timings = engine.time_micro_steps(
        lambda: task.loss_and_stats(engine.model, batch)[0], steps=steps, sync_only=sync_only
    )
    dtype = engine.compute_dtype
    parallel.barrier()  # every rank measures its peak at once: the cores are shared as in training
    peak = matmul_peak(dtype)
    flops_per_sample = model_flops_per_sample(task, batch) if parallel.is_main() else None
    activations = activation_bytes(engine, lambda: task.loss_and_stats(engine.model, batch)[0])
    ranks = parallel.gather_objects(
        {
            "rank": parallel.rank(),
            **state,
            "peak_memory_bytes": memory["bytes"],
            "memory_at_start_bytes": memory_at_start,
            # What training added to the process at its peak (the process's own start-up,
            # torch and Ray, is in memory_at_start).
            "peak_growth_bytes": memory["bytes"] - memory_at_start,
            # What building the model and loading its state added at their peak, before any
            # step: fsdp on the meta device holds its shards and one module whole here.
            "startup_growth_bytes": startup_peak - memory_at_start,
            "activation_bytes": activations,
            "matmul_peak_flops": peak["flops_per_s"],
            "matmul_peak_size": peak["size"],
            "matmul_peak_reused": peak["reused"],
            "threads": _threads(),
            "probe_samples": len(next(iter(batch.values()))),
            "probe_steps": steps,
            **timings,
        }
    )
    if not parallel.is_main():
        return None
    return _combine(task, epochs, cfg, ranks, flops_per_sample, memory["kind"], dtype)


def activation_bytes(engine: parallel.Engine, loss_fn) -> int:
    """What one forward and loss add to this rank's memory until their backward: the tensors
    autograd keeps for backward (what `relay plan` predicts as activations), measured by the
    allocator on CUDA and by the kernel on CPU — resident pages, with glibc told to mmap every
    block over 64 KiB, so that a tensor's pages come and go with it (smaller blocks reuse the
    heap unseen; at 1 MiB an MLP's 512 KiB activations went half unseen). Under fsdp it also
    holds whatever the forward leaves gathered (the root's own parameters). Called last: glibc
    keeps that setting for the rest of the process."""
    from relay import parallel
    from relay.runtime import worker_memory

    if parallel.device().type == "cpu":
        worker_memory.return_freed_memory(threshold_bytes=64 << 10)
    engine.zero_grad()
    parallel.barrier()
    with engine.micro_step(sync=True):
        before = parallel.current_memory()
        loss = loss_fn()
        held = parallel.current_memory() - before
        engine.backward(loss)
    engine.zero_grad()
    return held


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _cpu_attention_flops() -> dict:
    """FlopCounterMode's formulas for CPU's attention kernel, which torch 2.13 does not count
    (it knows the CUDA kernels only): without them a transformer's attention matmuls would be
    missing from its model FLOPs on CPU. The same formulas as for the CUDA kernels: the full
    T x T products (causal masking does not halve them, as in PaLM's count)."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


def model_flops_per_sample(task: Task, batch: Batch) -> float:
    """FLOPs of one forward + backward per sample, counted by torch on a plain copy of the
    model (so activation recomputation does not count: this is *model* FLOPs). Matmuls,
    convolutions and attention count; elementwise ops and normalisation do not.

    The copy is made of fake tensors (torch's FakeTensorMode: shapes and devices, no storage),
    so rank 0 does not hold a whole second model beside its shards. Not the `meta` device:
    there attention runs as the math kernel's matmuls instead of CPU's flash kernel, whose
    backward also recomputes the scores — fake CPU tensors dispatch as real ones do (the same
    counts, tested). A forward that needs real values falls back to a real copy."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode  # no public equivalent
    from torch.utils.flop_counter import FlopCounterMode

    from relay import parallel

    def count(model: torch.nn.Module, batch: Batch) -> float:
        with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as counter:
            loss, stats = task.loss_and_stats(model, batch)
            loss.backward()
        return counter.get_total_flops() / float(stats["count"])

    try:
        with FakeTensorMode() as fake, torch.device(parallel.device()):
            fakes = {key: fake.from_tensor(value) for key, value in batch.items()}
            return count(task.build_model(), fakes)
    except Exception:  # e.g. data-dependent control flow in a model's forward
        return count(task.build_model().to(parallel.device()), batch)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _combine(task, epochs, cfg, ranks, flops_per_sample, memory_kind, dtype) -> dict[str, Any]:
    world = len(ranks)
    steady = epochs.steady()
    samples_per_s = steady["samples"] / steady["seconds"]
    return {
        "report_version": REPORT_VERSION,
        "workers": world,
        "strategy": cfg.parallel.strategy,
        "mixed_precision": cfg.parallel.mixed_precision,
        "grad_accum": cfg.parallel.grad_accum,
        "throughput": _throughput_part(task, steady, world),
        "step": _step_part(cfg, steady, ranks),
        "flops": _flops_part(ranks, flops_per_sample * samples_per_s, flops_per_sample, dtype),
        "memory": _memory_part(ranks, memory_kind),
    }


def _throughput_part(task, steady: dict[str, Any], world: int) -> dict[str, Any]:
    samples_per_s = steady["samples"] / steady["seconds"]
    units_per_s = steady["units"] / steady["seconds"]
    return {
        # Over the training passes of the epochs counted (the first is left out as warm-up
        # when there are more); validation and checkpoints are not counted.
        "samples": steady["samples"],
        "train_s": steady["seconds"],
        "epochs_counted": steady["passes"],
        "warmup_excluded": steady["warmup_excluded"],
        "samples_per_s": samples_per_s,
        "samples_per_s_per_worker": samples_per_s / world,
        "unit": task.throughput_unit,
        "units_per_s": units_per_s,
        "units_per_s_per_worker": units_per_s / world,
    }


def _step_part(cfg, steady: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """An optimizer step's time split into compute, gradient communication and the rest."""
    world = len(ranks)
    step_s = steady["seconds"] / steady["steps"]
    synced_s = _mean([r["synced_step_s"] for r in ranks])
    comm_measured = all(r["local_step_s"] is not None for r in ranks)
    local_s = _mean([r["local_step_s"] for r in ranks]) if comm_measured else synced_s
    # The probe is one full micro-batch; training steps average in each epoch's shorter last
    # batch, so compute scales to the mean samples per micro-batch actually trained.
    mean_micro_batch = steady["samples"] / world / steady["steps"] / cfg.parallel.grad_accum
    compute_s = local_s * cfg.parallel.grad_accum * mean_micro_batch / ranks[0]["probe_samples"]
    comm_s = max(0.0, synced_s - local_s) if world > 1 else 0.0
    return {
        "optimizer_steps": steady["steps"],
        "step_s": step_s,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "other_s": max(0.0, step_s - compute_s - comm_s),
        "comm_fraction": comm_s / (compute_s + comm_s) if compute_s + comm_s else 0.0,
        # fsdp's parameter all-gathers run in both timings, so they count as compute.
        "method": "same micro-batch timed with and without gradient synchronisation"
        if comm_measured
        else "not measured (fsdp under scaling.memory_per_worker): comm counts as compute",
        "comm_measured": comm_measured,
        "probe_steps_per_pass": ranks[0]["probe_steps"],
    }


def _flops_part(ranks, achieved: float, flops_per_sample: float, dtype) -> dict[str, Any]:
    peak_total = sum(r["matmul_peak_flops"] for r in ranks)
    return {
        "model_flops_per_sample": flops_per_sample,
        "achieved_flops_per_s": achieved,
        # Not MFU as papers use it (over the hardware vendor's peak): over the dense matmul
        # rate measured here, which a vendor's peak exceeds.
        "fraction_of_measured_matmul_peak": achieved / peak_total,
        "matmul_peak_flops_per_s": peak_total,
        "peak_dtype": str(dtype).removeprefix("torch."),
        "matmul_peak": {
            "dtype": str(dtype).removeprefix("torch."),
            "method": "square matmuls, best rate over sizes and timings (PEAK_PROBE), "
            "all workers at once, summed over workers",
            **PEAK_PROBE,
            "workers_at_once": len(ranks),
            "threads_per_worker": [r["threads"] for r in ranks],
            "per_worker_flops_per_s": [r["matmul_peak_flops"] for r in ranks],
            "per_worker_best_size": [r["matmul_peak_size"] for r in ranks],
            # True where the worker's process had measured it for an earlier run (a reused
            # sweep trial actor): the probe runs once per process, device, dtype and threads.
            "per_worker_reused": [r["matmul_peak_reused"] for r in ranks],
        },
    }


MEMORY_KEYS = (
    "rank",
    "peak_memory_bytes",
    "memory_at_start_bytes",
    "peak_growth_bytes",
    "startup_growth_bytes",
    "activation_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "state_bytes",
)


def _memory_part(ranks, memory_kind: str) -> dict[str, Any]:
    return {
        "kind": memory_kind,
        # State bytes: each storage that parameters, gradients (after the last training step)
        # and optimizer state use, counted once — padding and buckets included.
        "state_method": "live tensors' storages, each counted once (relay.training.footprint)",
        "activation_method": "memory one forward and loss of the probe batch add until "
        "their backward (relay.training.efficiency.activation_bytes)",
        "per_rank": [{key: r[key] for key in MEMORY_KEYS} for r in ranks],
    }
