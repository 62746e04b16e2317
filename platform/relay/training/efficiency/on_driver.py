"""The efficiency report completed on the driver: the start-up of the worker group that finished
(from the driver's clock marks and the group's), and speedup and scaling efficiency against the
newest 1-worker run of the same config.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.training.efficiency.on_workers import REPORT_VERSION

if TYPE_CHECKING:
    from relay.config import RunConfig

# --- on the driver ----------------------------------------------------------------------------


def startup(
    times: dict[str, float],
    returned: dict[str, Any],
    failed_at: list[float] = (),
    epochs_ended_at: list[float] = (),
) -> dict[str, Any] | None:
    """Start-up of the worker group that finished training, from the driver's clock marks and
    that group's (same clock on one machine; NTP-close across nodes).

    Without a restart the group started when `fit()` was called. When a group failed during
    this `fit()` and another took over, the last group started when the controller found the
    failure (`failed_at`, `history.failure_times`): the earlier groups' start-up and training
    are not this group's start-up. `restarts` counts those failures; `restarted_after_s` is how far
    into `fit()` the last began. Should a group have been replaced with no failure stamped, its
    start is bounded by the last epoch another group ended (`epochs_ended_at`) this `fit()`.
    `connect_s` and `prepare_s` are the driver's, paid once per `fit()`.
    """
    marks = ("loop_started_at", "data_ready_at", "first_step_at")
    if any(returned.get(mark) is None for mark in marks):
        return None
    loop_at, data_at, first_step_at = (returned[mark] for mark in marks)
    fit_at = times["fit_called"]
    failures = [t for t in failed_at if fit_at <= t <= loop_at]
    earlier_epochs = [t for t in epochs_ended_at if fit_at <= t <= loop_at]
    group_started = max([fit_at, *failures, *earlier_epochs])
    parts = {
        "connect_s": times["connected"] - times["started"],
        "prepare_s": fit_at - times["connected"],  # task data, datasets, trainer
        "worker_group_s": loop_at - group_started,  # controller, actors, process group
        "model_and_data_s": data_at - loop_at,  # model, strategy wrapping, the shard's rows
        "first_step_s": first_step_at - data_at,  # incl. compilation with `compile`
    }
    restarted = group_started > fit_at
    return {
        **parts,
        "total_s": sum(parts.values()),
        "restarts": len(failures) if failures else int(restarted),
        "restarted_after_s": group_started - fit_at if restarted else None,
    }


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a config that decide per-worker work (not its name, workers or storage)."""
    ignored = {"name", "storage", "fault_injection", "checkpoint", "failure"}
    out = {k: v for k, v in config.items() if k not in ignored}
    out["scaling"] = {k: v for k, v in config["scaling"].items() if k != "num_workers"}
    return out


def find_reference(storage: Path, cfg: RunConfig, run_id: str) -> dict[str, Any] | None:
    """The newest finished 1-worker run of the same config, with an efficiency report."""
    from relay.records import registry

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
