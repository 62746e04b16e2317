"""The efficiency report for people: the lines `relay train` and `relay runs show` print."""

from __future__ import annotations

from typing import Any

from relay.observe.console import human_bytes

# --- for people -------------------------------------------------------------------------------


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} FLOP/s"


def _flops_line(f: dict[str, Any]) -> str:
    achieved = f"{_flops(f['achieved_flops_per_s'])} of {_flops(f['matmul_peak_flops_per_s'])}"
    if "matmul_peak" not in f:  # a report before v3 (`relay runs show` of an older run)
        return (
            f"  flops        {f['mfu']:.1%} of measured matmul peak: {achieved} "
            f"({f['peak_dtype']}, 1024-square; not a vendor peak)"
        )
    probe = f["matmul_peak"]
    sizes = "/".join(str(n) for n in sorted(set(probe["per_worker_best_size"])))
    return (
        f"  flops        {f['fraction_of_measured_matmul_peak']:.1%} of measured matmul peak: "
        f"{achieved} ({probe['dtype']}, best at {sizes}-square, all "
        f"{probe['workers_at_once']} workers at once; not a vendor peak)"
    )


def format_report(report: dict[str, Any]) -> str:
    t, s, f, m = report["throughput"], report["step"], report["flops"], report["memory"]
    lines = [
        f"efficiency: {report['workers']} workers, {report['strategy']}, "
        f"precision {report['mixed_precision']}, grad_accum {report['grad_accum']}",
    ]
    if report.get("startup"):
        u = report["startup"]
        restarted = ""
        if u.get("restarts"):
            restarted = (
                f" (the worker group that finished: restarted {u['restarted_after_s']:.1f} s "
                f"into fit after {u['restarts']} failure(s))"
            )
        lines.append(
            f"  start-up     {u['total_s']:.1f} s = connect {u['connect_s']:.1f} + prepare "
            f"{u['prepare_s']:.1f} + worker group {u['worker_group_s']:.1f} + model and data "
            f"{u['model_and_data_s']:.1f} + first step {u['first_step_s']:.1f}{restarted}"
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
        + (
            f"(comm {s['comm_fraction']:.0%} of compute+comm)"
            if s.get("comm_measured", True)
            else "(comm not measured: counted as compute)"
        )
    )
    lines.append(_flops_line(f))
    for r in m["per_rank"]:
        growth = r["peak_memory_bytes"] - r["memory_at_start_bytes"]  # reports before v3 lack it
        lines.append(
            f"  rank {r['rank']:<7} peak {human_bytes(r['peak_memory_bytes'])} ({m['kind']}; "
            f"+{human_bytes(growth)} over {human_bytes(r['memory_at_start_bytes'])} at start"
            + (
                f", +{human_bytes(r['startup_growth_bytes'])} building the model"
                if "startup_growth_bytes" in r  # reports of older runs lack it
                else ""
            )
            + "); "
            f"params {human_bytes(r['param_bytes'])}, grads {human_bytes(r['grad_bytes'])}, "
            f"optimizer {human_bytes(r['optimizer_bytes'])}"
            + (
                f", activations {human_bytes(r['activation_bytes'])}"
                if "activation_bytes" in r  # reports of older runs lack it
                else ""
            )
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
