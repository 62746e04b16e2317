"""What `relay sweeps` shows: each sweep read back from the storage path, without Ray.

    <storage>/sweeps/<sweep id>/sweep.json    the validated sweep config (written first)
    <storage>/sweeps/<sweep id>/result.json   Tune's verdict per trial (written when it ends)
    <storage>/runs/<sweep id>-<trial id>/     each trial's Train run: run.json (labels `sweep`,
                                              `trial_id`, `params`) and history.jsonl

A sweep with a result.json is "finished": its trials and statuses are Tune's. One without is
"incomplete" — still running, or its driver was killed — and is built from the trial runs'
records and histories. Nothing cheap tells those two apart (no driver leaves a trace that
says it is alive), so the view says both, with the time of the last write it found.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relay.records import history, registry

SPEC, RESULT = "sweep.json", "result.json"

# A trial's final metrics: the fields sweep.py keeps in result.json, plus the sweep's metric.
FINAL_METRICS = ("epoch", "train_loss", "val_loss", "samples_per_s")

STATUS_TEXT = {
    "completed": "completed",
    "stopped": "stopped early",
    "error": "error",
    "pending": "pending",
    "incomplete": "incomplete",
}


class SweepRecordError(Exception):
    """A sweep's file cannot be read; the message names the file."""


def sweeps_root(storage: Path) -> Path:
    return storage / "sweeps"


def asha_rungs(spec: dict[str, Any]) -> list[float] | None:
    """The epochs at which ASHA compares trials, as Ray's `_Bracket` (one bracket) places them:
    grace_period * reduction_factor**k, k = 0, 1, ... up to max_t. None when ASHA is off."""
    asha = spec["asha"]
    if not asha["enabled"] or spec.get("search_alg") == "pbt":  # PBT replaces ASHA
        return None
    min_t, rf, max_t = asha["grace_period"], asha["reduction_factor"], spec["train"]["epochs"]
    count = int(math.log(max_t / min_t) / math.log(rf) + 1)  # Ray's MAX_RUNGS, s = 0
    return [_plain(min_t * rf**k) for k in range(count)]


def _plain(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _read_json(path: Path, what: str) -> Any:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise SweepRecordError(f"{path}: unreadable {what} ({reason})") from None
    if not isinstance(data, dict):
        raise SweepRecordError(f"{path}: unreadable {what} (not a JSON object)")
    return data


def _tune_statuses(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """{trial id: {"status", "config"}} from Tune's newest experiment state: which trials Tune
    had created (some not started, so without a run record) and which it had ended. Tune's
    own format, not relay's: anything unexpected means "no information", never an error."""
    # Newest by the time in the name, as Tune picks it (Tune's sync rewrites every file, so
    # modification times tie).
    states = sorted(sweep_dir.glob("experiment_state-*.json"))
    if not states:
        return {}
    try:
        found = {}
        for entry in json.loads(states[-1].read_text())["trial_data"]:
            trial = json.loads(entry[0])
            found[trial["trial_id"]] = {
                "status": trial["status"],
                "config": (trial.get("config") or {}).get("params"),
            }
        return found
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return {}


def _trial_runs(storage: Path, sweep_id: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The sweep's trial runs by trial id: (run dir, record labelled with this sweep). A PBT
    trial has a run per stretch between exploits (`<trial run>-p<n>`): its newest is kept."""
    found = {}
    paths = registry.runs_root(storage).glob(f"{sweep_id}-*/{registry.RECORD}")
    for path in sorted(paths, key=_segment_number):
        record = _read_json(path, "run record")
        if record.get("sweep") == sweep_id and record.get("trial_id"):
            found[record["trial_id"]] = (path.parent, record)
    return found


def _segment_number(record_path: Path) -> int:
    match = re.search(r"-p(\d+)$", record_path.parent.name)
    return int(match.group(1)) if match else 0


def _best(values: list[float], mode: str) -> float | None:
    if not values:
        return None
    return max(values) if mode == "max" else min(values)


def _unfinished_trial(
    sweep: dict[str, Any],
    trial_id: str,
    record: dict[str, Any] | None,
    epochs: list[dict[str, Any]],
    tune_state: dict[str, Any],
) -> dict[str, Any]:
    """A trial of an incomplete sweep, from its run's record and history and Tune's state."""
    epochs_run = epochs[-1]["epoch"] if epochs else 0
    run_status = (record or {}).get("status")
    state = tune_state.get("status")
    # ASHA ends a trial from outside, so a record may still say "running" for a trial that
    # ran all its epochs (Tune stops it at max_t) or one ASHA stopped: the history and Tune's
    # state are the better witnesses.
    if run_status == "finished" or (sweep["epochs"] and epochs_run >= sweep["epochs"]):
        status = "completed"
    elif run_status == "stopped" or state == "TERMINATED":
        status = "stopped"
    elif state == "ERROR" or (run_status == "failed" and not state):
        # A failed record beside a trial Tune still ran is most likely the sweep's own kill
        # reaching the trial (an interruption: resuming retries it), not the trial's error.
        status = "error"
    elif record is None:
        status = "pending"
    else:
        status = "incomplete"
    metric = sweep["metric"]
    last = epochs[-1] if epochs else {}
    trial = {
        "trial_id": trial_id,
        "run_id": f"{sweep['sweep']}-{trial_id}",
        "config": (record or {}).get("params") or tune_state.get("config") or {},
        "status": status,
        "epochs_run": epochs_run,
        "metrics": {k: v for k, v in last.items() if k in (*FINAL_METRICS, metric)},
        "best_score": _best(
            [e[metric] for e in epochs if e.get(metric) is not None], sweep["mode"]
        ),
    }
    if record and record.get("chosen_by") is not None:
        trial["chosen_by"] = record["chosen_by"]
    return trial


def read_sweep(storage: Path, sweep_id: str) -> dict[str, Any]:
    """One sweep's view: its spec's essentials, every trial (config, status, epochs run, ASHA
    rungs reached, final metrics), the best trial. Raises KeyError for an unknown id,
    SweepRecordError for a file that cannot be read."""
    sweep_dir = sweeps_root(storage) / check_sweep_id(sweep_id)
    if not sweep_dir.is_dir():
        raise KeyError(f"no sweep {sweep_id!r} under {sweeps_root(storage)}")
    spec_path = sweep_dir / SPEC
    spec = _read_json(spec_path, "sweep config")
    try:
        view: dict[str, Any] = {
            "sweep": sweep_id,
            "sweep_dir": str(sweep_dir),
            "name": spec.get("name"),
            "started_at": _started_at(sweep_id, spec_path),
            "search_alg": spec.get("search_alg", "random"),  # older sweeps: random (and grid)
            "search": sorted(spec["search"]),
            "num_samples": spec.get("num_samples"),
            "metric": spec["metric"],
            "mode": spec["mode"],
            "epochs": spec["train"]["epochs"],
            "asha_rungs": asha_rungs(spec),
        }
    except (KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError):
        raise SweepRecordError(f"{spec_path}: unreadable sweep config (fields missing)") from None
    mode, rungs = view["mode"], view["asha_rungs"]

    runs = _trial_runs(storage, sweep_id)
    epochs_of = {t: history.read(run_dir) for t, (run_dir, _) in runs.items()}
    result_path = sweep_dir / RESULT
    if result_path.exists():
        result = _read_json(result_path, "sweep result")
        try:
            trials = [_finished_trial(t, runs) for t in result["trials"]]
        except (KeyError, TypeError):
            raise SweepRecordError(f"{result_path}: unreadable sweep result (no trials)") from None
        best = result.get("best")
        view.update(status="finished", model=result.get("model"))
    else:
        tune = _tune_statuses(sweep_dir)
        trials = [
            _unfinished_trial(
                view, t, runs[t][1] if t in runs else None, epochs_of.get(t, []), tune.get(t, {})
            )
            for t in sorted(set(runs) | set(tune))
        ]
        scored = [t for t in trials if t["best_score"] is not None]
        sign = 1 if mode == "max" else -1
        best = max(scored, key=lambda t: sign * t["best_score"]) if scored else None
        resume = f"relay tune --resume {sweep_id}"
        if storage != _default_storage():
            resume += f" --storage {storage}"
        view.update(
            status="incomplete",
            model=None,
            resume=resume,
            last_activity=_iso(_last_write(sweep_dir, [d for d, _ in runs.values()])),
        )
    for trial in trials:
        # What the Train run trained, from its history: after ASHA's stop, a run may finish
        # an epoch more before Tune's kill reaches it (Tune's `epochs_run` does not count it).
        trained = epochs_of.get(trial["trial_id"])
        trial["epochs_trained"] = trained[-1]["epoch"] if trained else 0
        trial["rungs_reached"] = [r for r in rungs if r <= trial["epochs_run"]] if rungs else None
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial["status"]] = counts.get(trial["status"], 0) + 1
    view.update(trials=trials, counts=counts, best=best)
    return view


def _finished_trial(
    trial: dict[str, Any], runs: dict[str, tuple[Path, dict[str, Any]]]
) -> dict[str, Any]:
    """A trial of a finished sweep: Tune's verdict from result.json, as written."""
    shown = {
        k: trial[k]
        for k in ("trial_id", "run_id", "config", "status", "epochs_run", "metrics", "best_score")
    }
    record = runs[trial["trial_id"]][1] if trial["trial_id"] in runs else {}
    chosen_by = trial.get("chosen_by", record.get("chosen_by"))
    return {**shown, **({"chosen_by": chosen_by} if chosen_by is not None else {})}


def _default_storage() -> Path:
    from relay.config import resolve_storage

    return resolve_storage(None)


def _last_write(sweep_dir: Path, run_dirs: list[Path]) -> float:
    paths = [*sweep_dir.glob("experiment_state-*.json"), sweep_dir / SPEC]
    for run_dir in run_dirs:
        paths += [run_dir / registry.RECORD, run_dir / history.FILE]
    return max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)


_ID_TIME = re.compile(r"-(\d{8}-\d{6})-[0-9a-f]{4}$")  # driver.new_run_id's stamp


def _started_at(sweep_id: str, spec_path: Path) -> str:
    """When the sweep started: the UTC time in its id (files' times change when Tune syncs
    the sweep's directory), else when its spec was written."""
    if match := _ID_TIME.search(sweep_id):
        started = datetime.strptime(match.group(1), "%Y%m%d-%H%M%S").replace(tzinfo=UTC)
        return started.isoformat(timespec="seconds")
    return _iso(spec_path.stat().st_mtime)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def list_sweeps(storage: Path) -> list[dict[str, Any]]:
    """Every sweep, newest first, without its trials; one whose files cannot be read is listed
    with `error` (naming the file) in place of the rest."""
    views = []
    for spec in sweeps_root(storage).glob(f"*/{SPEC}"):
        sweep_id = spec.parent.name
        try:
            view = read_sweep(storage, sweep_id)
        except SweepRecordError as exc:
            view = {"sweep": sweep_id, "started_at": _started_at(sweep_id, spec), "error": str(exc)}
        view.pop("trials", None)
        views.append(view)
    return sorted(views, key=lambda v: v["started_at"], reverse=True)


def check_sweep_id(sweep_id: object) -> str:
    """`sweep_id`, if it is one directory name; a KeyError naming it if not (before it names
    a path: `../../x` or an absolute path would lead out of the sweeps)."""
    if not registry.is_name(sweep_id):
        raise KeyError(f"invalid sweep id {sweep_id!r}: letters, digits, '_', '.', '-'")
    return sweep_id


def find_sweep_id(storage: Path, sweep_id: str) -> str:
    """An exact sweep id, or the one sweep whose id starts with `sweep_id`."""
    root = sweeps_root(storage)
    check_sweep_id(sweep_id)
    if (root / sweep_id / SPEC).exists():
        return sweep_id
    matches = sorted(p.parent.name for p in root.glob(f"*/{SPEC}"))
    matches = [m for m in matches if sweep_id and m.startswith(sweep_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise KeyError(f"no sweep {sweep_id!r} under {root}")
    raise KeyError(f"sweep id {sweep_id!r} is ambiguous: {', '.join(matches[:5])}")


# --- what a person sees -----------------------------------------------------------------------


def _score(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.4f}" if 1e-3 <= abs(value) < 1e5 else f"{value:.4g}"


def _counts(view: dict[str, Any]) -> str:
    counts = view.get("counts") or {}
    order = [*STATUS_TEXT, *sorted(set(counts) - set(STATUS_TEXT))]
    parts = [f"{counts[s]} {STATUS_TEXT.get(s, s)}" for s in order if s in counts]
    return f"{sum(counts.values())} trials" + (f" ({', '.join(parts)})" if parts else "")


def sweep_line(view: dict[str, Any]) -> str:
    """One line of `relay sweeps`."""
    if "error" in view:
        return f"{view['sweep']:<40} damaged   {view['error']}"
    best = view.get("best")
    score = ""
    if best and best.get("best_score") is not None:
        score = f"best {view['metric']}={best['best_score']:.4g}"
        if view["status"] == "incomplete":
            score += " so far"
    model = f" model {view['model']}" if view.get("model") else ""
    return (
        f"{view['sweep']:<40} {view['status']:<10} {view['search_alg']:<7} "
        f"{_counts(view):<48} {score}{model}"
    )


def render_sweep(view: dict[str, Any]) -> str:
    """`relay sweeps show ID`: the sweep, then a table of its trials, then the best."""
    metric, rungs = view["metric"], view.get("asha_rungs")
    asha = f"ASHA rungs at epochs {' '.join(map(str, rungs))}" if rungs else "no ASHA"
    lines = [
        f"sweep {view['sweep']}: {view['status']}, search {view['search_alg']}, {_counts(view)}",
        f"  {metric} ({view['mode']}), {view['epochs']} epochs per trial, {asha}",
        f"  started {view['started_at']}, in {view['sweep_dir']}",
    ]
    if view["status"] == "incomplete":
        lines.append(
            f"  no {RESULT}: still running, or interrupted (last write {view['last_activity']});"
            f" to continue it: {view['resume']}"
        )
    chosen = [str(t.get("chosen_by") or "-") for t in view["trials"]]
    chosen_width = max([9, *map(len, chosen)]) if any(c != "-" for c in chosen) else 0
    rungs_of = {
        t["trial_id"]: " ".join(map(str, t["rungs_reached"] or [])) or "-" for t in view["trials"]
    }
    width = max([5, *map(len, rungs_of.values())])
    header = (
        f"{'trial':<14} {'status':<14} {'epochs':>7} {'rungs':<{width}} {metric:>14} {'best':>8}"
    )
    if chosen_width:
        header += f"  {'chosen by':<{chosen_width}}"
    lines += ["", header + "  config"]
    for t, chosen_by in zip(view["trials"], chosen, strict=True):
        epochs = f"{t['epochs_run']}/{view['epochs'] or '?'}"
        row = (
            f"{t['trial_id']:<14} {STATUS_TEXT.get(t['status'], t['status']):<14} "
            f"{epochs:>7} "
            f"{rungs_of[t['trial_id']]:<{width}} "
            f"{_score(t['metrics'].get(metric)):>14} {_score(t['best_score']):>8}"
        )
        if chosen_width:
            row += f"  {chosen_by:<{chosen_width}}"
        lines.append(f"{row}  {short_params(t['config'])}")
    best = view.get("best")
    if best and best.get("best_score") is not None:
        so_far = " so far" if view["status"] == "incomplete" else ""
        lines += [
            "",
            f"best{so_far}: {best['trial_id']} {metric}={_score(best['best_score'])} "
            f"({short_params(best['config'])})",
        ]
        if best.get("checkpoint"):
            lines.append(f"checkpoint: {best['checkpoint']}")
        if view.get("model"):
            lines.append(f"model: {view['model']}")
    elif not view["trials"]:
        lines += ["", "no trial has started"]
    else:
        lines += ["", "no trial reported a score"]
    return "\n".join(lines)


def short_params(params: dict[str, Any]) -> str:
    """A trial's sampled values on one line: 'optim.lr=0.003 batch_size=32'."""
    return " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )
