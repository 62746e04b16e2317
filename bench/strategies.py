""".venv/bin/python bench/strategies.py [--epochs 4] [--batch-size 16] [--model JSON]

Memory and speed of relay's parallel strategies (ddp, zero1, fsdp), each in fp32 and bf16, on the
same 2-worker charlm run: 6 runs in one benchmark, on one embedded Ray cluster.

Method: one config, changed only in `parallel.strategy` and `parallel.mixed_precision`, trained
with `relay.training.driver.fit` (2 workers, each reserving one CPU and running one intra-op
thread; same
seed, data split, per-worker batch and epochs). Every figure is read from the run itself: its
history (per-epoch samples/s, final validation loss) and relay's efficiency report (measured on
the workers after the last epoch).

Workload: charlm with `{"d_model": 256, "n_layer": 4, "n_head": 4, "block_size": 128,
"dropout": 0.0, "corpus_bytes": 48000}`: a 3.26 M-parameter GPT, so model state (fp32 weights,
gradients and two AdamW moments: ~52 MB per full replica) is large enough to show sharding, and
335 training windows give 11 steps of batch 16 per worker per epoch (~6 s of training in fp32,
~3 s in bf16, on this 2-core machine). The preset `default` (128 wide) holds 0.8 M parameters;
its full 2 MB corpus would take minutes per epoch. About 4-5 minutes in all.

Per run:
  state/rank   the bytes that parameters, gradients and optimizer state really occupy on each
               rank after the last training step, as the report measures them
               (relay.training.footprint:
               every live tensor followed to its storage, each storage counted once: FSDP's
               padded shards, DDP's gradient buckets, ZeRO's partition). ddp holds everything;
               zero1 shards the optimizer state (by whole parameters); fsdp shards all three.
  peak RSS     the rank's process peak resident memory (the report's `peak_memory_bytes` on
               CPU): it includes the Ray worker process itself (torch, Ray, Ray Data: ~0.5 GB
               with a tiny model), activations, and on rank 0 the full state gathered for the
               final checkpoint.
  RSS growth   peak RSS minus the RSS the worker had when its training loop started (the
               report's `peak_growth_bytes`): what training added, per rank.
  samples/s    steady training throughput: the median of per-epoch samples/s (global training
               samples / seconds of that epoch's training pass) over epochs 2..N, from the run's
               history; epoch 1 (warm-up) is left out. tokens/s = samples/s x block_size (each
               sample predicts block_size characters). The report's own figure (samples /
               seconds over the passes it counts: epochs 2..N in current relay) is in the JSON
               as `report_samples_per_s`.
  val loss     validation loss (nats/char) after the last epoch: strategies should agree within
               rounding in fp32; bf16 differs a little, and fsdp's bf16 differs from ddp's and
               zero1's (FSDP's MixedPrecisionPolicy casts every parameter, embeddings and
               LayerNorms included, to bf16; autocast keeps those ops in fp32).
  comm         the report's gradient-communication share of compute + comm (the same
               micro-step timed with and without gradient sync).
  matmul frac  the report's `fraction_of_measured_matmul_peak`: model FLOP/s over the dense
               matmul rate the workers measured at once in the run's compute dtype (fp32 runs:
               fp32; bf16 runs: bf16). Not MFU against a vendor's peak.

The last stdout line is one JSON object, the ratios taken in fp32 and per rank:
  fsdp_state_ratio_per_rank       fsdp / ddp measured state bytes, rank by rank
  fsdp_state_ratio                the fullest rank's: max over ranks, fsdp / ddp (ideal 0.5 on
                                  2 ranks, plus padding; target <= 0.55)
  fsdp_rss_growth_ratio_per_rank  fsdp / ddp peak RSS growth, rank by rank
  fsdp_rss_growth_ratio           max over ranks, fsdp / ddp (growth includes activations,
                                  Ray Data and the checkpoint gather: far from 0.5 for a small
                                  model)
  zero1_*                         the same for zero1
and bf16_speedup = bf16 / fp32 steady samples/s under ddp (null, with `bf16_skipped` saying
why, where the CPU has no fast bf16 matmul), bf16_speedup_by_strategy, and the
raw table. bf16 pays off on a
CPU only with native bf16 matmuls (AVX512-BF16 / AMX); it is slower where they are missing.
The bench sets RELAY_HOME and the runs' storage to a temporary dir (deleted at the end), starts
its own local Ray cluster (RAY_ADDRESS=local) and shuts Ray down at the end. Figures are noisy
when something else is using the CPUs: each run records the CPU that processes outside the
bench's own process tree used while it ran (`foreign_cpu_cores`, sampled from /proc every
second), and the bench warns and counts `busy_runs` when that averages over 0.25 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from foreign_cpu import busy_text, fit_watched, warn_if_busy

from harness import print_results, relay_home

DEFAULT_MODEL = {
    "d_model": 256,
    "n_layer": 4,
    "n_head": 4,
    "block_size": 128,
    "dropout": 0.0,
    "corpus_bytes": 48_000,
}
STRATEGIES = ("ddp", "zero1", "fsdp")
PRECISIONS = ("none", "bf16")
# bf16 runs only where this CPU multiplies bf16 at least this fraction as fast as fp32: without
# native bf16 instructions (AVX512-BF16 / AMX) torch emulates it ~40x slower, and the three bf16
# runs would take most of an hour to show only that.
BF16_MIN_RATE = 0.5


def matmul_rates() -> dict[str, float]:
    """GFLOP/s of a 512-square matmul on one thread, fp32 and bf16 (best of 3)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
        rates[name] = 2 * 512**3 / best / 1e9
    torch.set_num_threads(threads)
    return rates


MiB = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="ddp / zero1 / fsdp x fp32 / bf16: state per rank, throughput, loss."
    )
    parser.add_argument("--size", default="default", help="charlm size preset (default: default)")
    parser.add_argument(
        "--model",
        type=json.loads,
        default=None,
        help=f"charlm model overrides as JSON (default: {json.dumps(DEFAULT_MODEL)})",
    )
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (default: 4)")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="batch size per worker (default: 16)"
    )
    parser.add_argument("--workers", type=int, default=2, help="workers (default: 2)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW lr (default: 1e-3)")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="run the bf16 side even where this CPU has no fast bf16 matmul",
    )
    parser.add_argument(
        "--show-progress", action="store_true", help="relay's per-epoch lines on stderr"
    )
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (epoch 1 is warm-up)")
    args.model = DEFAULT_MODEL if args.model is None else args.model
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies: {', '.join(sorted(unknown))}")
    return args


def run_config(args: argparse.Namespace, storage: Path, strategy: str, precision: str) -> dict:
    return {
        "name": f"strategies-{strategy}-{precision}",
        "task": "charlm",
        "size": args.size,
        "model": args.model,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "optim": {"name": "adamw", "lr": args.lr, "weight_decay": 0.1, "grad_clip": 1.0},
        "data": {"val_fraction": 0.1},
        "scaling": {
            "num_workers": args.workers,
            "resources_per_worker": {"CPU": 1},
            "threads_per_worker": 1,
        },
        "parallel": {"strategy": strategy, "mixed_precision": precision},
        # One checkpoint, at the end: the benchmark is about training, not checkpointing.
        "checkpoint": {"every": args.epochs, "keep": 1},
        "storage": str(storage),
    }


def train(cfg_dict: dict[str, Any], block_size: int, show_progress: bool) -> dict[str, Any]:
    result, wall_s, others = fit_watched(cfg_dict, show_progress)
    report = result.efficiency
    ranks = report["memory"]["per_rank"]
    state = [r["state_bytes"] for r in ranks]
    per_epoch = [m["samples_per_s"] for m in result.history]
    steady = statistics.median(per_epoch[1:])
    return {
        "strategy": report["strategy"],
        "precision": report["mixed_precision"],
        "run_id": result.run_id,
        "state_bytes_rank0": state[0],
        "state_bytes_per_rank": state,
        "param_bytes_rank0": ranks[0]["param_bytes"],
        "grad_bytes_rank0": ranks[0]["grad_bytes"],
        "optimizer_bytes_rank0": ranks[0]["optimizer_bytes"],
        "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
        "peak_growth_bytes_per_rank": [r["peak_growth_bytes"] for r in ranks],
        "samples_per_s": steady,
        "tokens_per_s": steady * block_size,
        "epoch_samples_per_s": per_epoch,
        "report_samples_per_s": report["throughput"]["samples_per_s"],
        "report_tokens_per_s": report["throughput"]["units_per_s"],
        "comm_fraction": report["step"]["comm_fraction"],
        "step": {k: report["step"][k] for k in ("step_s", "compute_s", "comm_s", "other_s")},
        "fraction_of_measured_matmul_peak": report["flops"]["fraction_of_measured_matmul_peak"],
        "matmul_peak": report["flops"]["matmul_peak"],
        "val_loss": result.history[-1]["val_loss"],
        "replicas_in_sync": result.replicas_in_sync,
        "wall_s": wall_s,
        "foreign_cpu_cores": others.cores,
    }


def label(run: dict[str, Any]) -> str:
    return f"{run['strategy']} {'fp32' if run['precision'] == 'none' else run['precision']}"


def describe(run: dict[str, Any]) -> str:
    peak = max(run["peak_memory_bytes_per_rank"])
    growth = max(run["peak_growth_bytes_per_rank"])
    return (
        f"{label(run)}: state/rank {max(run['state_bytes_per_rank']) / MiB:.2f} MiB, peak RSS "
        f"{peak / MiB:,.0f} MiB (+{growth / MiB:,.0f} MiB), {run['samples_per_s']:,.1f} "
        f"samples/s "
        f"({run['tokens_per_s']:,.0f} tokens/s), val loss {run['val_loss']:.4f}, "
        f"wall {run['wall_s']:.1f} s, "
        f"others' CPU {busy_text(run['foreign_cpu_cores'])}"
    )


def table(runs: list[dict[str, Any]]) -> str:
    header = (
        "run",
        "state r0/r1",
        "params",
        "grads",
        "optim",
        "peak RSS r0/r1",
        "RSS growth r0/r1",
        "samples/s",
        "tokens/s",
        "comm",
        "matmul frac",
        "val loss",
    )
    rows = [header]
    for run in runs:
        peaks = "/".join(f"{b / MiB:,.0f}" for b in run["peak_memory_bytes_per_rank"])
        growth = "/".join(f"{b / MiB:,.0f}" for b in run["peak_growth_bytes_per_rank"])
        state = "/".join(f"{b / MiB:.2f}" for b in run["state_bytes_per_rank"])
        rows.append(
            (
                label(run),
                f"{state} MiB",
                f"{run['param_bytes_rank0'] / MiB:.2f}",
                f"{run['grad_bytes_rank0'] / MiB:.2f}",
                f"{run['optimizer_bytes_rank0'] / MiB:.2f}",
                f"{peaks} MiB",
                f"{growth} MiB",
                f"{run['samples_per_s']:,.1f}",
                f"{run['tokens_per_s']:,.0f}",
                f"{run['comm_fraction']:.0%}",
                f"{run['fraction_of_measured_matmul_peak']:.1%}",
                f"{run['val_loss']:.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    with relay_home("strategies") as storage:  # relay starts its own embedded cluster
        import relay.config
        from relay.tasks import build_task

        cfg = relay.config.from_dict(run_config(args, storage, "ddp", "none"))
        task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
        split = task.load_data(cfg.data.val_fraction, cfg.seed)
        rows = len(next(iter(split.train.values())))
        params = sum(p.numel() for p in task.build_model().parameters())
        block_size = task.hp.block_size
        print(
            f"charlm ({cfg.size}, model {json.dumps(cfg.model)}: {params / 1e6:.2f} M params), "
            f"{rows} train windows, {args.workers} workers x batch {cfg.batch_size} "
            f"(1 CPU, 1 thread each), {cfg.epochs} epochs",
            flush=True,
        )
        rates = matmul_rates()
        precisions = list(PRECISIONS)
        bf16_skipped = None
        if not args.bf16 and rates["bf16"] < BF16_MIN_RATE * rates["fp32"]:
            precisions.remove("bf16")
            bf16_skipped = (
                f"bf16 runs skipped: this CPU multiplies bf16 at {rates['bf16']:.1f} GFLOP/s "
                f"against {rates['fp32']:.1f} for fp32 (no native bf16; --bf16 runs them anyway)"
            )
            print(bf16_skipped, flush=True)
        runs: list[dict[str, Any]] = []
        for strategy in args.strategies:
            for precision in precisions:
                cfg_dict = run_config(args, storage, strategy, precision)
                runs.append(train(cfg_dict, block_size, args.show_progress))
                print(describe(runs[-1]), flush=True)
    wall_s = time.perf_counter() - started

    by = {(r["strategy"], r["precision"]): r for r in runs}

    def ratios(strategy: str, key: str) -> tuple[list[float] | None, float | None]:
        """(per rank, fullest rank) `key` of `strategy` over ddp's, in fp32."""
        if (strategy, "none") not in by or ("ddp", "none") not in by:
            return None, None
        ours, ddp = by[strategy, "none"][key], by["ddp", "none"][key]
        per_rank = [a / b for a, b in zip(ours, ddp, strict=True)]
        return per_rank, max(ours) / max(ddp)

    state_ratios = {s: ratios(s, "state_bytes_per_rank") for s in ("fsdp", "zero1")}
    growth_ratios = {s: ratios(s, "peak_growth_bytes_per_rank") for s in ("fsdp", "zero1")}

    bf16_speedups = {
        s: by[s, "bf16"]["samples_per_s"] / by[s, "none"]["samples_per_s"]
        for s in args.strategies
        if (s, "bf16") in by
    }
    print()
    print(table(runs))
    print(
        "\nsamples/s: median of epochs 2..N (steady); state: params + grads + optimizer state "
        "as stored (each storage once); peak RSS: whole worker process; RSS growth: peak "
        "minus the RSS at the training loop's start"
    )
    for strategy in ("fsdp", "zero1"):
        per_rank, fullest = state_ratios[strategy]
        if per_rank is None:
            continue
        growth_per_rank, growth = growth_ratios[strategy]
        target = " (target <= 0.55)" if strategy == "fsdp" else ""
        print(
            f"{strategy} / ddp (fp32) state: {fullest:.3f} fullest rank{target}, per rank "
            + "/".join(f"{r:.3f}" for r in per_rank)
            + f"; peak RSS growth: {growth:.2f}, per rank "
            + "/".join(f"{r:.2f}" for r in growth_per_rank)
        )
    print(
        (
            "bf16 / fp32 samples/s: " + ", ".join(f"{s} {v:.2f}x" for s, v in bf16_speedups.items())
            if bf16_speedups
            else bf16_skipped
        )
        + f"; wall time {wall_s:.1f} s"
    )

    busy = warn_if_busy(runs)

    summary = {
        "busy_runs": busy,
        "matmul_gflops_1thread": rates,
        "bf16_skipped": bf16_skipped,
        "fsdp_state_ratio": state_ratios["fsdp"][1],
        "fsdp_state_ratio_per_rank": state_ratios["fsdp"][0],
        "fsdp_rss_growth_ratio": growth_ratios["fsdp"][1],
        "fsdp_rss_growth_ratio_per_rank": growth_ratios["fsdp"][0],
        "zero1_state_ratio": state_ratios["zero1"][1],
        "zero1_state_ratio_per_rank": state_ratios["zero1"][0],
        "zero1_rss_growth_ratio": growth_ratios["zero1"][1],
        "zero1_rss_growth_ratio_per_rank": growth_ratios["zero1"][0],
        "state_measure": "relay.training.footprint: live storages of params, grads, "
        "optimizer state, "
        "each once, after the last training step",
        "rss_growth_measure": "peak RSS minus RSS at the training loop's start, per rank",
        "bf16_speedup": bf16_speedups.get("ddp"),
        "bf16_speedup_by_strategy": bf16_speedups,
        "throughput_measure": "median per-epoch samples/s over epochs 2..N (run history)",
        "runs": runs,
        "task": cfg.task,
        "size": cfg.size,
        "model": cfg.model,
        "params": params,
        "train_windows": rows,
        "workers": args.workers,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "wall_s": wall_s,
    }
    print_results(summary)


if __name__ == "__main__":
    main()
