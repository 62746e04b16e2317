"""`relay report`: one self-contained HTML page for a run, a sweep or a model version.

Charts are drawn with matplotlib and inlined as SVG: a page is a single file of some tens of
kilobytes that opens anywhere without a network or a script (plotly, the other choice, inlines
~4.7 MB of JavaScript per page: too heavy to write after every run). Every plotted series is
an SVG group with an id `trace-...`, so a page's curves can be counted in the DOM.

A run's page: learning curves (train/val loss, the task's metric), throughput and the learning
rate per epoch (and per step report, for a run with step clocks), where the run's wall time
went (start-up, training passes split into compute and gradient communication, waiting for
input, validation and checkpoints), and the config. A sweep's page: every trial's metric per
epoch on one chart (a trial ASHA stopped ends in an x), its configs against its score in
parallel coordinates, the best trial drawn bold, and the table.
"""

from __future__ import annotations

import html
import io
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from relay.config import redacted_uri
from relay.records import history, registry, sweep_records

REPORT = "report.html"
BEST, OTHER = "#d62728", "#1f77b4"


def _figure(width: float = 6.4, height: float = 3.2, ncols: int = 1):
    # A bare Figure draws without pyplot's global state or any GUI backend.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.subplots(1, ncols)


def _svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # inline: without the XML prolog and doctype


def _series(axes, x, y, name: str, **style):
    (line,) = axes.plot(x, y, label=name, **style)
    line.set_gid(f"trace-{name}")
    return line


def _chart(title: str, svg: str) -> str:
    return f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>{svg}</figure>'


def _run_charts(record: dict[str, Any], epochs: list[dict[str, Any]]) -> list[str]:
    x = [e["epoch"] for e in epochs]
    metric = record["config"]["checkpoint"]["metric"]
    charts = []
    figure, axes = _figure()
    for name in ("train_loss", "val_loss"):
        if any(name in e for e in epochs):
            _series(axes, x, [e.get(name) for e in epochs], name, marker="o")
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.legend()
    charts.append(_chart("Loss per epoch", _svg(figure)))
    if metric not in ("train_loss", "val_loss") and any(metric in e for e in epochs):
        figure, axes = _figure()
        _series(axes, x, [e.get(metric) for e in epochs], metric, marker="o", color=BEST)
        axes.set_xlabel("epoch")
        axes.set_ylabel(metric)
        charts.append(_chart(f"{metric} per epoch", _svg(figure)))
    charts.append(_rate_and_lr(epochs, "epoch", "", "o"))
    if breakdown := time_breakdown(record, epochs):
        charts.append(_chart("Where the wall time went (s)", _breakdown_svg(breakdown)))
    return charts


def _step_charts(steps: list[dict[str, Any]]) -> list[str]:
    """The step clocks' reports (`report.every_steps`, `validation.every_steps`) against the
    optimizer step: what a run of one long epoch has to show between its epoch ends."""
    charts = []
    figure, axes = _figure()
    for name in ("train_loss", "val_loss"):
        points = [(s["step"], s[name]) for s in steps if name in s]
        if points:
            x, y = zip(*points, strict=True)
            _series(axes, x, y, f"step_{name}", marker=".")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.legend()
    charts.append(_chart("Loss per step report", _svg(figure)))
    charts.append(_rate_and_lr(steps, "step", "step_", "."))
    return charts


def _rate_and_lr(records: list[dict[str, Any]], clock: str, prefix: str, marker: str) -> str:
    """Throughput and learning rate of epoch or step `records`, against their `clock` field."""
    x = [r[clock] for r in records]
    figure, (rate, lr) = _figure(height=3.0, ncols=2)
    _series(rate, x, [r.get("samples_per_s") for r in records], f"{prefix}samples_per_s",
            marker=marker)  # fmt: skip
    _series(lr, x, [r.get("lr") for r in records], f"{prefix}lr", marker=marker, color="#2ca02c")
    rate.set_ylabel("samples/s")
    lr.set_ylabel("learning rate")
    for axes in (rate, lr):
        axes.set_xlabel("optimizer step" if clock == "step" else clock)
    per = "step report" if clock == "step" else "epoch"
    return _chart(f"Throughput and learning rate per {per}", _svg(figure))


def time_breakdown(record: dict[str, Any], epochs: list[dict[str, Any]]) -> dict[str, float]:
    """The run's last call's wall time in parts, from its records: start-up (efficiency
    report), then per epoch the training passes (samples / rate) split by the measured share
    of gradient communication, the input wait, and the rest of the epoch (validation,
    checkpoint); what remains of the wall time is the end (registration, the report)."""
    report = record.get("efficiency") or {}
    startup = (report.get("startup") or {}).get("total_s")
    wall = record.get("wall_s")
    throughput, step = report.get("throughput") or {}, report.get("step") or {}
    if startup is None or wall is None or not throughput.get("epochs_counted"):
        return {}
    rows = throughput["samples"] / throughput["epochs_counted"]  # per epoch, all ranks
    comm_share = step.get("comm_s", 0) / step["step_s"] if step.get("step_s") else 0.0
    parts = {"compute": 0.0, "communication": 0.0, "input wait": 0.0, "validation, checkpoint": 0.0}
    started = datetime.fromisoformat(record["started_at"]).timestamp()
    for e in (e for e in epochs if e.get("time", 0) >= started):  # trained by the last call
        passes = min(rows / e["samples_per_s"], e["epoch_s"]) if e.get("samples_per_s") else 0
        waited = e.get("input_wait_share", 0) * passes
        working = passes - waited
        parts["compute"] += working * (1 - comm_share)
        parts["communication"] += working * comm_share
        parts["input wait"] += waited
        parts["validation, checkpoint"] += max(e["epoch_s"] - passes, 0)
    accounted = startup + sum(parts.values())
    return {"start-up": startup, **parts, "end": max(wall - accounted, 0.0)}


def _breakdown_svg(parts: dict[str, float]) -> str:
    figure, axes = _figure(height=2.4)
    left = 0.0
    for name, seconds in parts.items():
        bar = axes.barh([0], [seconds], left=left, label=f"{name} {seconds:.1f}")
        bar.patches[0].set_gid(f"trace-{name}")
        left += seconds
    axes.set_yticks([])
    axes.set_xlabel("seconds")
    figure.legend(ncols=4, fontsize="small", loc="outside lower center")
    return _svg(figure)


def _page(title: str, subtitle: str, sections: list[str]) -> str:
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
        "figure{margin:1.5em 0}figcaption{font-weight:600;margin-bottom:.3em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;"
        "text-align:right}th{background:#f4f4f4}tr.best{font-weight:700;color:" + BEST + "}"
        "pre{background:#f7f7f7;padding:1em;overflow:auto}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{html.escape(subtitle)}</p>{''.join(sections)}</body></html>\n"
    )


def run_page(record: dict[str, Any]) -> str:
    epochs = history.read(record["run_dir"])
    steps = history.latest_steps(record["run_dir"])
    charts = _run_charts(record, epochs) if epochs else ["<p>No epoch has been recorded.</p>"]
    charts += _step_charts(steps) if steps else []
    reported = f", {len(steps)} step reports" if steps else ""
    subtitle = (
        f"{record['task']} ({record.get('size')}), {record.get('status')}; "
        f"{len(epochs)} epochs{reported}; model {record.get('model') or '-'}"
    )
    config = yaml.safe_dump(_shown_config(record["config"]), sort_keys=False)
    sections = [*charts, f"<h2>Config</h2><pre>{html.escape(config)}</pre>"]
    return _page(f"run {record['run_id']}", subtitle, sections)


def _shown_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as a page shows it. relay refuses a tracking URI with credentials in it, but
    a run recorded before it did may hold one, and a page is made to be passed around: its
    userinfo and secret query values are shown as `***`."""
    mlflow = (config.get("tracking") or {}).get("mlflow") or {}
    if not mlflow.get("uri"):
        return config
    shown = {**mlflow, "uri": redacted_uri(mlflow["uri"])}
    return {**config, "tracking": {**config["tracking"], "mlflow": shown}}


def _trial_histories(storage: Path, view: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    histories = {}
    for trial in view["trials"]:
        run_dir = registry.runs_root(storage) / trial["run_id"]
        histories[trial["trial_id"]] = history.read(run_dir) if run_dir.exists() else []
    return histories


def sweep_page(storage: Path, sweep_id: str) -> str:
    view = sweep_records.read_sweep(storage, sweep_id)
    metric, mode = view["metric"], view["mode"]
    best = (view.get("best") or {}).get("trial_id")
    histories = _trial_histories(storage, view)
    figure, axes = _figure(7.2, 3.6)
    for trial in view["trials"]:
        epochs = histories[trial["trial_id"]]
        points = [(e["epoch"], e[metric]) for e in epochs if metric in e]
        if not points:
            continue
        is_best = trial["trial_id"] == best
        style = {"color": BEST, "linewidth": 3, "zorder": 3} if is_best else {"alpha": 0.6}
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        _series(axes, xs, ys, trial["trial_id"], marker="o", markersize=3, **style)
        if trial["status"] == "stopped":  # where ASHA stopped it
            (mark,) = axes.plot([xs[-1]], [ys[-1]], "x", color="black", markersize=8)
            mark.set_gid(f"stopped-{trial['trial_id']}")
    axes.set_xlabel("epoch")
    axes.set_ylabel(metric)
    sections = [_chart(f"{metric} per epoch, every trial (x: stopped by ASHA)", _svg(figure))]
    if parallel := _parallel_coordinates(view, metric, mode, best):
        sections.append(_chart(f"Trial configs against {metric}", parallel))
    sections.append(_trial_table(view, metric, best))
    subtitle = (
        f"search {view.get('search_alg')}, {len(view['trials'])} trials, {metric} ({mode}); "
        f"best {best or '-'}; {view.get('status')}"
    )
    return _page(f"sweep {sweep_id}", subtitle, sections)


def _parallel_coordinates(view: dict[str, Any], metric: str, mode: str, best: str | None):
    """One vertical axis per searched field and one for the metric (each scaled to its own
    range; a choice field's values in order), one line per trial."""
    trials = [t for t in view["trials"] if t.get("best_score") is not None]
    fields = sorted({k for t in trials for k in t["config"]})
    if not trials or not fields:
        return None
    columns = [*fields, metric]

    def position(column: str) -> tuple[list[float], list[str]]:
        values = [t["best_score"] if column == metric else t["config"].get(column) for t in trials]
        if all(isinstance(v, int | float) for v in values):
            low, high = min(values), max(values)
            if low > 0 and high / low > 20:  # a learning rate's decades: a log axis
                values = [math.log10(v) for v in values]
                low, high = math.log10(low), math.log10(high)
                labels = [f"{10**low:.3g}", f"{10**high:.3g} (log)"]
            else:
                labels = [f"{low:.3g}", f"{high:.3g}"]
            span = (high - low) or 1.0
            return [(v - low) / span for v in values], labels
        levels = sorted({str(v) for v in values})
        step = max(len(levels) - 1, 1)
        return [levels.index(str(v)) / step for v in values], levels

    scaled = [position(c) for c in columns]
    figure, axes = _figure(7.2, 3.6)
    for i, trial in enumerate(trials):
        is_best = trial["trial_id"] == best
        style = {"color": BEST, "linewidth": 3, "zorder": 3} if is_best else {"alpha": 0.6}
        ys = [s[0][i] for s in scaled]
        _series(axes, range(len(columns)), ys, f"config-{trial['trial_id']}", **style)
    for x, (_, labels) in enumerate(scaled):
        axes.axvline(x, color="#888", linewidth=0.8)
        axes.annotate(labels[0], (x, 0), fontsize="x-small", ha="center", va="top")
        axes.annotate(labels[-1], (x, 1), fontsize="x-small", ha="center", va="bottom")
    axes.set_xticks(range(len(columns)), columns, fontsize="small")
    axes.set_yticks([])
    axes.set_ylim(-0.1, 1.1)
    return _svg(figure)


def _trial_table(view: dict[str, Any], metric: str, best: str | None) -> str:
    fields = sorted({k for t in view["trials"] for k in t["config"]})
    head = "".join(
        f"<th>{html.escape(c)}</th>" for c in ["trial", "status", "epochs", f"best {metric}"]
    )
    head += "".join(f"<th>{html.escape(f)}</th>" for f in fields)
    rows = []
    for t in view["trials"]:
        score = f"{t['best_score']:.4g}" if isinstance(t.get("best_score"), float) else "-"
        cells = [t["trial_id"], t["status"], t.get("epochs_trained", "-"), score]
        cells += [t["config"].get(f, "-") for f in fields]
        tds = "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
        rows.append(f"<tr class='{'best' if t['trial_id'] == best else ''}'>{tds}</tr>")
    return f"<h2>Trials</h2><table><tr>{head}</tr>{''.join(rows)}</table>"


def write(storage: Path, ref: str, out: Path | None = None) -> Path:
    """Write the page for `ref` (a run id, a sweep id, or a model reference; unique prefixes
    do) to `out`, by default `report.html` in the run's or sweep's directory."""
    try:
        view_id = sweep_records.find_sweep_id(storage, ref)
    except KeyError:
        view_id = None
    if view_id is not None:
        page = sweep_page(storage, view_id)
        default = sweep_records.sweeps_root(storage) / view_id / REPORT
    else:
        record = _run_for(storage, ref)
        page = run_page(record)
        default = Path(record["run_dir"]) / REPORT
    path = Path(out) if out else default
    path.write_text(page)
    return path


def _run_for(storage: Path, ref: str) -> dict[str, Any]:
    try:
        return registry.get_run(storage, ref)
    except KeyError:
        found = registry.resolve_model(storage, ref)  # a model reference: its run's page
        if found.version is None:
            raise
        return registry.get_run(storage, found.version["run_id"])
