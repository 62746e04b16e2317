"""The efficiency report: how well a run used its cluster, measured — not estimated — on the
workers at the end of training, and completed by the driver.

    total speed ∝ per-device speed × device count × multi-device speedup

Each factor gets a number: throughput overall and per worker; the step split into compute,
gradient communication and the rest (timed by running the same micro-step with and without
gradient synchronisation); model FLOPs utilisation against the workers' measured matmul peak;
memory per rank; start-up; and, when a 1-worker run of the same config exists, speedup and
scaling efficiency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relay.console import human_bytes

if TYPE_CHECKING:  # the driver imports this module; torch and Ray load only on the workers
    from pathlib import Path

    from relay import parallel
    from relay.config import RunConfig
    from relay.loop import Epochs
    from relay.tasks import Task
    from relay.tasks.base import Batch

# --- on the workers (every rank calls `measure`: it is a collective) ---------------------------


# Bumped whenever a figure's definition changes: speedups compare reports of one version only.
REPORT_VERSION = 2


def measure(
    task: Task,
    engine: parallel.Engine,
    epochs: Epochs,
    batch: Batch,
    cfg: RunConfig,
    memory_at_start: int,
):
    """Measure this process's training and return the combined report on rank 0 (None on the
    others). Runs after the last epoch, so it costs a few extra steps and changes no weights.
    `memory_at_start`: what the rank held before it built anything (`current_memory()`)."""

    from relay import parallel

    state = engine.state_bytes()  # gradients of the last step are still allocated
    timings = engine.time_micro_steps(lambda: task.loss_and_stats(engine.model, batch)[0])
    memory = parallel.peak_memory()
    dtype = engine.compute_dtype
    parallel.barrier()  # every rank measures its peak at once: the cores are shared as in training
    peak = parallel.matmul_peak_flops(dtype)
    flops_per_sample = model_flops_per_sample(task, batch) if parallel.is_main() else None
    ranks = parallel.gather_objects(
        {
            "rank": parallel.rank(),
            **state,
            "peak_memory_bytes": memory["bytes"],
            "memory_at_start_bytes": memory_at_start,
            "matmul_peak_flops": peak,
            "probe_samples": len(next(iter(batch.values()))),
            **timings,
        }
    )
    if not parallel.is_main():
        return None
    return _combine(task, epochs, cfg, ranks, flops_per_sample, memory["kind"], dtype)


def model_flops_per_sample(task: Task, batch: Batch) -> float:
    """FLOPs of one forward + backward per sample, counted by torch on a plain copy of the
    model (so activation recomputation does not count: this is *model* FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    from relay import parallel

    model = task.build_model().to(parallel.device())
    with FlopCounterMode(display=False) as counter:
        loss, stats = task.loss_and_stats(model, batch)
        loss.backward()
    return counter.get_total_flops() / float(stats["count"])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _combine(task, epochs, cfg, ranks, flops_per_sample, memory_kind, dtype) -> dict[str, Any]:
    world = len(ranks)
    steady = epochs.steady()
    samples_per_s = steady["samples"] / steady["seconds"]
    units_per_s = steady["units"] / steady["seconds"]
    step_s = steady["seconds"] / steady["steps"]
    local_s = _mean([r["local_step_s"] for r in ranks])
    synced_s = _mean([r["synced_step_s"] for r in ranks])
    # The probe is one full micro-batch; training steps average in each epoch's shorter last
    # batch, so compute scales to the mean samples per micro-batch actually trained.
    mean_micro_batch = steady["samples"] / world / steady["steps"] / cfg.parallel.grad_accum
    compute_s = local_s * cfg.parallel.grad_accum * mean_micro_batch / ranks[0]["probe_samples"]
    comm_s = max(0.0, synced_s - local_s) if world > 1 else 0.0
    peak_total = sum(r["matmul_peak_flops"] for r in ranks)
    achieved = flops_per_sample * samples_per_s
    return {
        "report_version": REPORT_VERSION,
        "workers": world,
        "strategy": cfg.parallel.strategy,
        "mixed_precision": cfg.parallel.mixed_precision,
        "grad_accum": cfg.parallel.grad_accum,
        "throughput": {
            # Over the training passes of the epochs counted (the first is left out as
            # warm-up when there are more); validation and checkpoints are not counted.
            "samples": steady["samples"],
            "train_s": steady["seconds"],
            "epochs_counted": steady["passes"],
            "warmup_excluded": steady["warmup_excluded"],
            "samples_per_s": samples_per_s,
            "samples_per_s_per_worker": samples_per_s / world,
            "unit": task.throughput_unit,
            "units_per_s": units_per_s,
            "units_per_s_per_worker": units_per_s / world,
        },
        "step": {
            "optimizer_steps": steady["steps"],
            "step_s": step_s,
            "compute_s": compute_s,
            "comm_s": comm_s,
            "other_s": max(0.0, step_s - compute_s - comm_s),
            "comm_fraction": comm_s / (compute_s + comm_s) if compute_s + comm_s else 0.0,
            # fsdp's parameter all-gathers run in both timings, so they count as compute.
            "method": "same micro-batch timed with and without gradient synchronisation",
        },
        "flops": {
            "model_flops_per_sample": flops_per_sample,
            "achieved_flops_per_s": achieved,
            "matmul_peak_flops_per_s": peak_total,
            "peak_dtype": str(dtype).removeprefix("torch."),
            "mfu": achieved / peak_total,
        },
        "memory": {
            "kind": memory_kind,
            "per_rank": [
                {
                    key: r[key]
                    for key in (
                        "rank",
                        "peak_memory_bytes",
                        "memory_at_start_bytes",
                        "param_bytes",
                        "grad_bytes",
                        "optimizer_bytes",
                    )
                }
                for r in ranks
            ],
        },
    }


# --- on the driver ----------------------------------------------------------------------------


def startup(times: dict[str, float], returned: dict[str, Any]) -> dict[str, float] | None:
    """Start-up breakdown from the driver's clock marks and the workers' (same clock on one
    machine; NTP-close across nodes). After a restart, the worker marks are the last group's."""
    marks = ("loop_started_at", "data_ready_at", "first_step_at")
    if any(returned.get(mark) is None for mark in marks):
        return None
    loop_at, data_at, first_step_at = (returned[mark] for mark in marks)
    return {
        "connect_s": times["connected"] - times["started"],
        "prepare_s": times["fit_called"] - times["connected"],  # task data, datasets, trainer
        "worker_group_s": loop_at - times["fit_called"],  # controller, actors, process group
        "model_and_data_s": data_at - loop_at,  # model, strategy wrapping, the shard's rows
        "first_step_s": first_step_at - data_at,  # incl. compilation with `compile`
        "total_s": first_step_at - times["started"],
    }


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a config that decide per-worker work (not its name, workers or storage)."""
    ignored = {"name", "storage", "fault_injection", "checkpoint", "failure"}
    out = {k: v for k, v in config.items() if k not in ignored}
    out["scaling"] = {k: v for k, v in config["scaling"].items() if k != "num_workers"}
    return out


def find_reference(storage: Path, cfg: RunConfig, run_id: str) -> dict[str, Any] | None:
    """The newest finished 1-worker run of the same config, with an efficiency report."""
    from relay import registry

    wanted = _comparable(cfg.model_dump(mode="json"))
    for record in registry.list_runs(storage):
        report = record.get("efficiency") or {}
        if (
            record.get("run_id") != run_id
            and record.get("status") == "finished"
            and report.get("report_version") == REPORT_VERSION
            and report.get("workers") == 1
            and _comparable(record.get("config", {})) == wanted
        ):
            return record
    return None


def add_reference(report: dict[str, Any], reference: dict[str, Any] | None) -> None:
    if reference is None:
        report["reference"] = None
        return
    ref_rate = reference["efficiency"]["throughput"]["samples_per_s"]
    speedup = report["throughput"]["samples_per_s"] / ref_rate
    report["reference"] = {
        "run_id": reference["run_id"],
        "samples_per_s": ref_rate,
        "speedup": speedup,
        "scaling_efficiency": speedup / report["workers"],
    }


# --- for people -------------------------------------------------------------------------------


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} FLOP/s"


def format_report(report: dict[str, Any]) -> str:
    t, s, f, m = report["throughput"], report["step"], report["flops"], report["memory"]
    lines = [
        f"efficiency: {report['workers']} workers, {report['strategy']}, "
        f"precision {report['mixed_precision']}, grad_accum {report['grad_accum']}",
    ]
    if report.get("startup"):
        u = report["startup"]
        lines.append(
            f"  start-up     {u['total_s']:.1f} s = connect {u['connect_s']:.1f} + prepare "
            f"{u['prepare_s']:.1f} + worker group {u['worker_group_s']:.1f} + model and data "
            f"{u['model_and_data_s']:.1f} + first step {u['first_step_s']:.1f}"
        )
    unit = t["unit"]
    rate = f"{t['samples_per_s']:,.0f} samples/s ({t['samples_per_s_per_worker']:,.0f}/worker)"
    if unit != "samples":
        rate += f", {t['units_per_s']:,.0f} {unit}/s ({t['units_per_s_per_worker']:,.0f}/worker)"
    if t["warmup_excluded"]:
        rate += f"; {t['epochs_counted']} epochs, the first left out as warm-up"
    lines.append(f"  throughput   {rate}")
    lines.append(
        f"  step         {s['step_s'] * 1e3:.1f} ms = compute {s['compute_s'] * 1e3:.1f} + "
        f"grad comm {s['comm_s'] * 1e3:.1f} + other {s['other_s'] * 1e3:.1f} "
        f"(comm {s['comm_fraction']:.0%} of compute+comm)"
    )
    lines.append(
        f"  MFU          {f['mfu']:.1%}: {_flops(f['achieved_flops_per_s'])} of a measured "
        f"{f['peak_dtype']} matmul peak of {_flops(f['matmul_peak_flops_per_s'])}"
    )
    for r in m["per_rank"]:
        lines.append(
            f"  rank {r['rank']:<7} peak {human_bytes(r['peak_memory_bytes'])} ({m['kind']}; "
            f"{human_bytes(r['memory_at_start_bytes'])} at start); "
            f"params {human_bytes(r['param_bytes'])}, grads {human_bytes(r['grad_bytes'])}, "
            f"optimizer {human_bytes(r['optimizer_bytes'])}"
        )
    ref = report.get("reference")
    if ref:
        lines.append(
            f"  scaling      {ref['speedup']:.2f}x over 1 worker ({ref['run_id']}): "
            f"{ref['scaling_efficiency']:.0%} efficiency"
        )
    else:
        lines.append("  scaling      no 1-worker run of this config yet to compare with")
    return "\n".join(lines)
