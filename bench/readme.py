""".venv/bin/python bench/readme.py --write | --check

The figures of README.md and docs/*.md, generated from bench/results.jsonl (written by
`make bench`, bench/run_all.py). Every measured number those pages show sits between a pair of
markers

    <!-- figures:NAME -->
    ...generated...
    <!-- /figures:NAME -->

and is rendered here from the results file; nothing between the markers is typed by hand. Each
block lives in exactly one page. `--write` rewrites the blocks in place; `--check` exits 1
(printing a diff) when a page and the results file disagree — the test suite runs it.

What each block says is data (BENCHMARK_ROWS, the Sections, BLOCKS below): templates in
str.format syntax whose fields are dotted paths into a bench's figures
("{levels.tiny.plain.32.rps}") and whose format specs are Python's (".3f") or a name in FORMATS
("{throughput_ratio:ratio}"), with When for the clauses only some results have.
"""

from __future__ import annotations

import argparse
import difflib
import re
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import results_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BLOCK = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S
)
Figures = dict[str, Any]
Results = dict[str, list[dict[str, Any]]]  # each bench's runs, one per machine, newest first


def pages(repo: Path = REPO) -> list[Path]:
    """The pages that may hold figures blocks: the README and every page of docs/."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def block_homes(texts: dict[Path, str]) -> dict[str, Path]:
    """Each figures block's page; a block in two places (or twice in one) is an error, since
    the two copies could only ever be kept equal by hand."""
    homes: dict[str, Path] = {}
    for page, text in texts.items():
        for match in BLOCK.finditer(text):
            name = match["name"]
            if name in homes:
                raise ValueError(f"figures block {name!r} is in {homes[name]} and in {page}")
            homes[name] = page
    return homes


def load_results(path: Path = results_file.PATH) -> Results:
    return results_file.by_bench(results_file.read(path))


_REQUIRED = object()


def get(tree: Any, dotted: str, default: Any = _REQUIRED) -> Any:
    """tree["a"]["b"] for "a.b"; a missing key is an error, never a silent blank, unless the
    caller names a default (a figure only some runs or sides have)."""
    for key in dotted.split("."):
        if key not in tree:
            if default is _REQUIRED:
                raise KeyError(f"results: no {dotted!r} (missing {key!r})")
            return default
        tree = tree[key]
    return tree


# --- formats: what a format spec names ----------------------------------------------------


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    """median (min–max) of repeated measurements."""
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    if n == 1:
        return fmt(median)
    return f"{fmt(median)} ({fmt(ordered[0])}–{fmt(ordered[-1])})"


ASHA_STRATEGIES = {
    "promote": ", ASHA by promotions (`asha.strategy: promote`)",
    "stop": ", ASHA by Ray's stopping rule (`asha.strategy: stop`)",
}
FORMATS: dict[str, Callable[[Any], str]] = {
    "ratio": lambda value: f"{value:.2f}",
    "rate": lambda value: f"{value:,.0f}",
    "seconds": lambda value: f"{value:.1f} s",
    "percent": lambda value: f"{value:.0%}",
    "ms": lambda value: f"{value:.1f} ms",
    "mib": lambda size: f"{size / 2**20:.1f} MiB",
    "megabytes": lambda size: f"{size / 1e6:,.0f} MB",
    "kilobytes": lambda size: f"{size // 1000} kB",
    "count": lambda items: str(len(items)),
    "list": lambda items: ", ".join(map(str, items)),
    # an unknown strategy reads as the default, Ray's stopping rule, which names none
    "asha_strategy": lambda name: ASHA_STRATEGIES.get(name, ""),
    # figures recorded as a group: {"median", "min", "max"}, a sweep arm, a server at a level
    "median_range": lambda s: f"{s['median']:.1f} s ({s['min']:.1f}–{s['max']:.1f})",
    "sweep_wall": lambda a: (
        f"{a['wall_s_median']:.1f} s ({a['wall_s_min']:.0f}–{a['wall_s_max']:.0f})"
    ),
    "latency": lambda x: f"{x['rps']:,.0f} req/s, p50 {x['p50_ms']:.1f} / p99 {x['p99_ms']:.1f} ms",
    "latency_short": lambda x: f"{x['rps']:,.0f}, {x['p50_ms']:.1f} / {x['p99_ms']:.1f} ms",
}
# "spread F" / "max F": a list of measurements, each shown by format F.
LIST_FORMATS: dict[str, Callable[[list, Callable[[Any], str]], str]] = {
    "spread": spread,
    "max": lambda values, fmt: fmt(max(values)),
}


def format_value(value: Any, spec: str) -> str:
    """A format spec: "LIST F" (LIST_FORMATS), a name in FORMATS, or Python's own (".3f")."""
    head, _, each = spec.partition(" ")
    if each:
        return LIST_FORMATS[head](value, lambda item: format_value(item, each))
    if spec in FORMATS:
        return FORMATS[spec](value)
    return format(value, spec)


# --- templates ----------------------------------------------------------------------------


@dataclass(frozen=True)
class When:
    """`then` where the test holds, else `otherwise`: the test is a dotted path that must be
    present and not None (a figure older rows lack), or a function of the figures."""

    test: str | Callable[[Figures], bool]
    then: Template
    otherwise: Template = ""

    def holds(self, figures: Figures) -> bool:
        if callable(self.test):
            return self.test(figures)
        return get(figures, self.test, None) is not None


Template = str | When | tuple["Template", ...]


class _FiguresFormatter(string.Formatter):
    """str.format whose fields are dotted paths into the figures and whose specs may be names."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return get(args[0], field_name), field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        return format_value(value, format_spec)


def fill(template: Template, figures: Figures) -> str:
    if isinstance(template, str):
        return _FiguresFormatter().vformat(template, (figures,), {})
    if isinstance(template, When):
        return fill(template.then if template.holds(figures) else template.otherwise, figures)
    return "".join(fill(part, figures) for part in template)


def run_stamp(entry: dict[str, Any]) -> str:
    """The commit (+ when the tree was dirty), date and machine of the run that wrote an entry:
    a figure means something only beside the CPU it was measured on."""
    commit = f"{(entry['commit'] or '?')[:8]}{'+' if entry['dirty'] else ''}"
    return f"{commit}, {entry['date'][:10]}, {results_file.machine_name(entry['machine'])}"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "|" + "".join(f" {cell} |" if cell else " |" for cell in cells)

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


# --- the benchmarks table: one row per bench, its figures in one cell ----------------------


@dataclass(frozen=True)
class Row:
    """One bench's row: `command` | what | figures (the template, filled) | run."""

    bench: str
    what: str
    figures: Template
    # figures worked out from the recorded ones, for the template (e.g. a run picked from a list)
    derive: Callable[[Figures], Figures] | None = None

    def cells(self, entry: dict[str, Any]) -> list[str]:
        figures = entry["figures"]
        if self.derive:
            figures = {**figures, **self.derive(figures)}
        return [f"`{entry['command']}`", self.what, fill(self.figures, figures), run_stamp(entry)]


def _memory_wall_runs(figures: Figures) -> Figures:
    """memory_wall's runs by strategy and workers ("fsdp_2"): the bench makes one of each."""
    runs = {f"{run['strategy']}_{run['workers']}": run for run in figures["runs"]}
    if len(runs) != len(figures["runs"]):
        raise ValueError("memory_wall: two runs of one strategy at one worker count")
    return {"run": runs}


def _overlap_sides(figures: Figures) -> Figures:
    """overlap's two settings, named by the values compared: low and high."""
    low, high = (str(value) for value in figures["compared"])
    sides = figures["sides"]
    return {"low": low, "high": high, "low_side": sides[low], "high_side": sides[high]}


ASHA = When(
    lambda figures: len(figures["seeds"]) > 1,
    (  # one search per seed: the medians of the per-seed figures
        "{seeds:count} random searches (seeds {seeds:list}) of {trials} trials of at most "
        "{max_epochs} epochs",
        # what differs from the defaults; rows from before the option name no strategy
        When("model.corpus_bytes", ", a {model.corpus_bytes:kilobytes} corpus"),
        When("asha_settings.strategy", "{asha_settings.strategy:asha_strategy}"),
        ", each run by both arms: `wall_ratio` **{wall_ratio:ratio}** ({wall_ratio_min:ratio}–"
        "{wall_ratio_max:ratio}), `best_metric_gap` **{best_metric_gap:.3f}** "
        "({best_metric_gap_min:.3f}–{best_metric_gap_max:.3f}) (medians over the seeds, "
        "min–max); wall per sweep ASHA {asha:sweep_wall} vs {no_stopping:sweep_wall}, epochs "
        "trained {asha.epochs_trained_median:g} vs {no_stopping.epochs_trained_median:g} "
        "(medians over all sweeps)",
        When(
            "first_epochs_kept",
            "; without stopping, the best config first ranks in a rung's top 1/reduction_factor "
            "after epoch {first_epochs_kept:list} (per seed): a rung before that stops it",
        ),
    ),
    "{trials} trials of at most {max_epochs} epochs: `wall_ratio` **{wall_ratio:ratio}** (ASHA "
    "{asha:sweep_wall} vs {no_stopping:sweep_wall}, medians (min–max) of {repeats} alternated "
    "repeats), epochs trained {asha.epochs_trained_median:g} vs "
    "{no_stopping.epochs_trained_median:g}, `best_metric_gap` {best_metric_gap:.3f}",
)


def _asha_first_epochs_kept(figures: Figures) -> Figures:
    """The epoch after which each seed's best config first ranked in a rung's top; none where a
    search lacks rank_of_best (rows from before the bench recorded the curves)."""
    per_seed = figures.get("per_seed", [])
    if not per_seed or not all("rank_of_best" in search for search in per_seed):
        return {}
    return {
        "first_epochs_kept": [search["rank_of_best"]["first_epoch_kept"] for search in per_seed]
    }


def _asha_row(bench: str, what: str) -> Row:
    return Row(bench, what, ASHA, derive=_asha_first_epochs_kept)


BENCHMARK_ROWS = (
    Row(
        "train_overhead",
        "2-worker relay `TorchTrainer` vs plain `torchrun`, the same epoch code "
        "(relay.training.epochs)",
        "steady samples/s relay {relay_steady_samples_per_s:rate} vs torchrun "
        "{torchrun_steady_samples_per_s:rate}: `throughput_ratio` **{throughput_ratio:ratio}**; "
        "end-to-end {end_to_end_throughput_ratio:ratio} (relay spends "
        "{relay_between_epochs_s:.3f} s between epochs on report + checkpoint); time to the end "
        "of epoch 1: relay {relay_first_epoch_s:seconds} starting Ray, "
        "{relay_first_epoch_s_ray_up:seconds} with Ray up, torchrun "
        "{torchrun_first_epoch_s:seconds}",
    ),
    Row(
        "scaling",
        "1 → 2 workers, relay and plain torchrun side by side",
        "`speedup_2w` relay **{speedup_2w:ratio}** ({speedup_2w_min:ratio}–{speedup_2w_max:ratio})"
        ", torchrun **{torchrun_speedup_2w:ratio}** ({torchrun_speedup_2w_min:ratio}–"
        "{torchrun_speedup_2w_max:ratio}) (medians of {repeats} alternated rounds, per-round "
        "spread): relay's / torchrun's **{speedup_vs_torchrun:ratio}**; samples/s relay / "
        "torchrun {relay_vs_torchrun_1w:ratio} at 1 worker, {relay_vs_torchrun_2w:ratio} at 2; "
        "`fraction_of_measured_matmul_peak` {fraction_of_measured_matmul_peak:ratio} at 2 "
        "workers ({fraction_of_measured_matmul_peak_1w:ratio} at 1); gradient comm "
        "{comm_fraction:percent} of compute + comm; while 2 workers train, the rest of the "
        "process tree (Ray's daemons and actors, the driver) uses "
        "{support_cpu_cores.relay.2:.2f} cores beside relay's workers, "
        "{support_cpu_cores.torchrun.2:.2f} beside torchrun's",
    ),
    Row(
        "scaling_hosts",
        "the network hop: the same 2 workers one per namespace host vs both on one",
        "samples/s with 1 worker on each of 2 namespace hosts {samples_per_s.two_hosts:spread rate}"
        " vs both on one host {samples_per_s.one_host:spread rate}: `two_hosts_vs_one_host` "
        "**{two_hosts_vs_one_host:ratio}** (medians of {repeats} alternated runs each; the "
        "second host's link carried {two_hosts_link_bytes:spread megabytes} per run)",
        derive=lambda f: {
            "two_hosts_link_bytes": [
                run["host1_link_bytes"] for run in f["runs"] if run["side"] == "two_hosts"
            ]
        },
    ),
    Row(
        "strategies",
        "ddp / zero1 / fsdp × fp32 / bf16 on 2 workers",
        (
            "measured state per rank (live tensors after a step, each storage once): "
            "`fsdp_state_ratio` **{fsdp_state_ratio:ratio}**, zero1 {zero1_state_ratio:ratio} "
            "of ddp; peak RSS growth per rank fsdp/ddp {fsdp_rss_growth_ratio:ratio}; ",
            When("bf16_speedup", "`bf16_speedup` **{bf16_speedup:ratio}** (ddp)", "{bf16_skipped}"),
        ),
    ),
    Row(
        "memory_wall",
        "a 63 M-parameter MLP: memory per rank by strategy at 2 and 4 workers; save times",
        (
            "peak RSS growth of the fullest rank, fsdp/ddp: **{fsdp_over_ddp_growth_2:ratio}** "
            "at 2 workers, **{fsdp_over_ddp_growth_4:ratio}** at 4 (zero1/ddp "
            "{zero1_over_ddp_growth_2:ratio}, {zero1_over_ddp_growth_4:ratio}); "
            "ddp {run.ddp_2.growth_bytes_per_rank:max mib} (plan "
            "{run.ddp_2.plan_total_bytes:mib}), fsdp {run.fsdp_2.growth_bytes_per_rank:max mib} "
            "(plan {run.fsdp_2.plan_total_bytes:mib}) at 2, fsdp "
            "{run.fsdp_4.growth_bytes_per_rank:max mib} (plan {run.fsdp_4.plan_total_bytes:mib}) "
            "at 4; ",
            When(
                "fsdp_over_ddp_startup_2",
                "start-up alone (building the model, fsdp on the meta device), fsdp/ddp: "
                "**{fsdp_over_ddp_startup_2:ratio}** at 2 workers, "
                "**{fsdp_over_ddp_startup_4:ratio}** at 4 (fullest rank: ddp "
                "{run.ddp_2.startup_growth_bytes_per_rank:max mib}, fsdp "
                "{run.fsdp_2.startup_growth_bytes_per_rank:max mib} at 2, "
                "{run.fsdp_4.startup_growth_bytes_per_rank:max mib} at 4); ",
            ),
            "checkpoint save at 2 workers gathered {save_gathered_s:seconds} vs sharded "
            "{save_sharded_s:seconds} (**{save_sharded_over_gathered:ratio}**)",
            When(
                "activations_over_plan_worst",
                "; measured/plan, the furthest from 1 over the runs: state "
                "{state_over_plan_worst:ratio}, activations {activations_over_plan_worst:ratio}",
            ),
        ),
        derive=_memory_wall_runs,
    ),
    Row(
        "checkpoint_upload",
        "the same model: a checkpoint every epoch copied to storage async vs sync vs none",
        "a checkpoint every epoch (fsdp, 2 workers, sharded), copied to storage beside the next "
        "epoch (async) vs waited for (sync) vs none between epochs: step-time hit async "
        "**{async_step_time_hit:percent}** (sync {sync_step_time_hit:percent}; samples/s "
        "{sides.async.samples_per_s.median:rate}, {sides.sync.samples_per_s.median:rate}, "
        "{sides.none.samples_per_s.median:rate}; none's own runs spread "
        "{sides.none.samples_per_s.min:rate}–{sides.none.samples_per_s.max:rate}); training "
        "held up per epoch {stall_s.async:seconds} async, {stall_s.sync:seconds} sync, "
        "{stall_s.none:seconds} none; medians of {repeats} alternated runs",
    ),
    _asha_row("asha_vs_random", "ASHA vs no stopping over the same random trials"),
    _asha_row(
        "asha_vs_random_9x9",
        "the same, on a sweep of 9 trials of up to 9 epochs (ASHA's rungs 1, 3, 9)",
    ),
    _asha_row(
        "asha_vs_random_promote",
        "the 9-trial sweep with ASHA by promotions, where epochs are long next to a start-up",
    ),
    _asha_row(
        "asha_vs_random_stop_160k",
        "the same sweeps as the row above with Ray's stopping rule (`asha.strategy: stop`)",
    ),
    Row(
        "startup",
        "per-run start-up: a Tune trial and a run vs a bare TorchTrainer; switches vs Ray's",
        (
            "per-trial start-up (in Tune, relay's `fit()` → first step) "
            "**{trial_startup_s:seconds}** ({sides.relay.trial.total_s.min:seconds}–"
            "{sides.relay.trial.total_s.max:seconds}), a "
            "`relay train` run {run_startup_s:seconds}, next to the bare `TorchTrainer` floor "
            "{floor_s:seconds} (`fit()` → its loop's first line); {workers} workers, medians of "
            "{repeats} alternated repeats; relay's switches save (Ray's defaults minus relay's) "
            "{saved_s.ray_defaults.run:+.1f} s per run, {saved_s.ray_defaults.trial:+.1f} s "
            "per trial",
            When(
                "trials_actor_gap_s",
                "; one-worker trials after the first, one at a time (a trial's end → the next "
                "one's first epoch): in their Tune actors **{trials_actor_gap_s:seconds}** "
                "(`fit()` → first epoch {trials_actor_startup_s:seconds}), each a TorchTrainer run "
                "{trials_group_gap_s:seconds} ({trials_group_startup_s:seconds})",
            ),
        ),
    ),
    Row(
        "many_trials",
        "a random search of 100 one-epoch trials vs Optuna alone in one process, same epoch code",
        "wall relay {sides.relay.wall_s.median:seconds} ({sides.relay.wall_s.min:seconds}–"
        "{sides.relay.wall_s.max:seconds}) vs Optuna {sides.optuna.wall_s.median:seconds} "
        "({sides.optuna.wall_s.min:seconds}–{sides.optuna.wall_s.max:seconds}): `wall_ratio` "
        "**{wall_ratio:ratio}**; {trials} trials of {task} ({size}), each side a fresh process "
        "timed whole (relay's cluster start included), medians of {repeats} alternated sweeps; "
        "best val_accuracy relay {sides.relay.best_val_accuracy.median:.3f}, Optuna "
        "{sides.optuna.best_val_accuracy.median:.3f}",
    ),
    Row(
        "overlap",
        "one more trial than fits, started while others train, vs none",
        "ASHA sweep wall time with `overlap: {high}` / `overlap: {low}`: `wall_ratio` "
        "**{wall_ratio:ratio}** ({high_side.wall_s_median:seconds} vs "
        "{low_side.wall_s_median:seconds}, medians of {repeats} alternated repeats; {trials} "
        "trials of at most {max_epochs} epochs), epochs trained "
        "{high_side.epochs_trained_median:g} vs {low_side.epochs_trained_median:g}",
        derive=_overlap_sides,
    ),
    Row(
        "serve_load",
        "`relay serve` (HAProxy, Python proxy) vs a plain FastAPI server",
        "tiny model, c=32: relay (HAProxy) {levels.tiny.haproxy.32.rps:rate} vs plain "
        "{levels.tiny.plain.32.rps:rate} req/s (`throughput_ratio_c32` "
        "**{throughput_ratio_c32:ratio}**, `p99_ratio_c32` {p99_ratio_c32:ratio}); Python proxy "
        "{proxy_ratio_c32:ratio}; heavy model batched vs plain "
        "**{batched_throughput_ratio_c32:ratio}**; version swaps under load: "
        "**{swap_failed_requests}** failed of {swap_requests:,}",
    ),
    Row(
        "serve_multiplex",
        "several models on one endpoint: relay's model table vs Serve's multiplexing",
        "two models on one replica, Serve's multiplexing / relay's table at c=32 "
        "**{multiplexed_ratio_c32:ratio}**; a model's first request "
        "{cold_first_ms_heavy.multiplexed:.0f} vs {cold_first_ms_heavy.table:.0f} ms (68 MB "
        "models), {cold_first_ms.multiplexed:.0f} vs {cold_first_ms.table:.0f} ms (tiny)",
    ),
    Row(
        "ingest",
        "data from Parquet files vs a DataLoader and vs in memory",
        "rows/s to 2 workers from Parquet, tokenised on the way: Ray Data "
        "{rows_per_s.ray_data.median:rate} vs `DataLoader` {rows_per_s.dataloader.median:rate} "
        "(`ray_data_vs_dataloader` **{ray_data_vs_dataloader:ratio}**), already in memory "
        "{rows_per_s.in_memory.median:rate}; charlm debug trainers wait for input "
        "{trainer_idle_share:percent} of the training pass",
    ),
)


def benchmarks(results: Results) -> str:
    """A row per bench and machine it ran on; a line per machine saying what it is and how
    long all its benches took."""
    entries = [entry for row in BENCHMARK_ROWS for entry in results.get(row.bench, [])]
    machines = {results_file.machine_name(e["machine"]): e["machine"] for e in entries}
    lines = []
    for _, machine in sorted(machines.items()):
        ran = [e for runs in results.values() for e in runs if e["machine"] == machine]
        minutes = sum(e["wall_s"] for e in ran) / 60
        lines.append(
            f"Measured on {machine['cores']} cores ({machine['cpu_model']}), "
            f"{machine['memory_gib']} GiB; each row "
            "names the commit, date and machine of its run. Wall time of that machine's benches "
            f"and samples: {minutes:.0f} min."
        )
    header = ["command", "what", "figures", "run"]
    rows = [
        row.cells(entry)
        for row in BENCHMARK_ROWS
        for entry in sorted(results.get(row.bench, []), key=lambda e: e["machine"]["cpu_model"])
    ]
    return "\n".join([*lines, "", *markdown_table(header, rows)]) + "\n"


# --- blocks of their own: an intro naming the run, a table, maybe a closing paragraph ------


@dataclass(frozen=True)
class Grid:
    """A table of one figure per (row, column). Each row is (label template, dotted path with
    "{column}" where a column's key goes, format spec of the value there)."""

    corner: str
    columns: tuple[tuple[str, str], ...]  # (header, key)
    rows: tuple[tuple[Template, str, str], ...]
    absent: str | None = None  # a missing value's cell; None: a missing value is an error

    def __call__(self, figures: Figures) -> list[str]:
        header = [self.corner, *(header for header, _ in self.columns)]
        rows = [
            [
                fill(label, figures),
                *(self._cell(figures, path, spec, key) for _, key in self.columns),
            ]
            for label, path, spec in self.rows
        ]
        return markdown_table(header, rows)

    def _cell(self, figures: Figures, path: str, spec: str, column: str) -> str:
        path = path.format(column=column)
        if self.absent is None:
            return format_value(get(figures, path), spec)
        value = get(figures, path, None)
        return self.absent if value is None else format_value(value, spec)


@dataclass(frozen=True)
class Section:
    """A block for one bench: an intro ending with the run that measured it, a table (figures →
    markdown lines), and a closing paragraph where there is one."""

    bench: str
    intro: Template
    table: Callable[[Figures], list[str]]
    outro: Template = ""

    def __call__(self, results: Results) -> str:
        entry = results[self.bench][0]  # the newest run, its machine named with it
        figures = entry["figures"]
        intro = f"{fill(self.intro, figures)} Run: `{entry['command']}`, {run_stamp(entry)}."
        outro = ["", fill(self.outro, figures)] if self.outro else []
        return "\n".join([intro, "", *self.table(figures), *outro]) + "\n"


# bench/startup.py's parts, one row each: (label, key in each run's figures).
STARTUP_PARTS = (
    ("relay's work before `TorchTrainer.fit()` (config, task data)", "prepare_s"),
    ("controller actor up", "controller_s"),
    ("worker group: placement group, worker actors, process group", "worker_group_s"),
    ("worker group ready → the loop's first line", "launch_s"),
    ("model and data", "model_and_data_s"),
    ("first step", "first_step_s"),
    ("**`fit()` → first step** (bare TorchTrainer: → its loop's first line)", "total_s"),
)
STARTUP = Section(
    "startup",
    "Median (min–max) of {repeats} alternated repeats, {workers} workers, {task} ({size}), "
    "each side on its own fresh cluster after a warm-up run.",
    Grid(
        "part",
        columns=(
            ("bare TorchTrainer", "ray_defaults.floor"),
            ("relay run", "relay.run"),
            ("relay trial (Tune)", "relay.trial"),
            ("trial, Ray's defaults", "ray_defaults.trial"),
        ),
        rows=tuple(
            (label, f"sides.{{column}}.{key}", "median_range") for label, key in STARTUP_PARTS
        ),
        absent="—",  # a part one side does not have (the bare floor builds no relay model)
    ),
)

ALTERNATING = "requests alternating between the models"
SERVE_MULTIPLEX = Section(
    "serve_multiplex",
    "Two models on one replica (HAProxy), relay's table vs Serve's `@serve.multiplexed` loading "
    "the same replica's models on demand; median of {setup.repeats} alternated repeats, "
    "{setup.seconds_per_level} s per level ({setup.client}).",
    Grid(
        "",
        columns=(("table", "table"), ("multiplexed", "multiplexed")),
        rows=(
            (f"c=1, {ALTERNATING}", "levels.{column}.1", "latency"),
            (f"c=32, {ALTERNATING}", "levels.{column}.32", "latency"),
            ("first request to a model (tiny), slower of the two", "cold_first_ms.{column}", "ms"),
            (
                "first request to a model ({setup.sizes.heavy}), slower of the two",
                "cold_first_ms_heavy.{column}",
                "ms",
            ),
        ),
    ),
)

# the serve_load table's rows per model: these servers in this order, then any other by name
SERVERS_IN_ORDER = (
    "plain",
    "haproxy",
    "haproxy conn-failure retry",
    "haproxy 2 models",
    "haproxy serve.batch",
    "proxy",
)


def serve_load_table(figures: Figures) -> list[str]:
    """Every server at every level, both models. Code, not a Grid: its columns are the levels
    the run measured, its rows the servers each model ran behind (two label columns), and not
    every server ran at every level."""
    by_model = figures["levels"]
    levels = sorted({int(c) for sides in by_model.values() for s in sides.values() for c in s})

    def server_rank(name: str) -> int:
        return SERVERS_IN_ORDER.index(name) if name in SERVERS_IN_ORDER else 9

    def cell(measured: dict[str, Any] | None) -> str:
        return "—" if measured is None else format_value(measured, "latency_short")

    rows = [
        [model, side, *(cell(by_model[model][side].get(str(c))) for c in levels)]
        for model in ("tiny", "heavy")
        for side in sorted(by_model[model], key=server_rank)
    ]
    return markdown_table(["model", "server", *(f"c={c}" for c in levels)], rows)


SERVE_LOAD = Section(
    "serve_load",
    "req/s, then p50 / p99 latency, median of {setup.repeats} alternated repeats "
    "({setup.seconds_per_level} s per level, {setup.client}); tiny: {setup.models.tiny}, heavy: "
    "{setup.models.heavy}. A lone request through HAProxy: p50 {p50_gap_ms_c1:+.2f} ms against "
    "plain.",
    serve_load_table,
    "Version swaps under load (tiny model, HAProxy, c=32, `relay deploy` alternating 1 → 2 → 1 "
    "in {swap_windows.swap:count} windows of {setup.swap_seconds} s, each beside a steady "
    "window): **{swap_failed_requests}** failed requests of {swap_requests:,} (steady windows: "
    "{steady_failed_requests}); p99 {swap_p99_ms:.1f} ms during a swap vs {steady_p99_ms:.1f} ms "
    "steady (max {swap_max_ms:.1f} vs {steady_max_ms:.1f} ms); `relay deploy` took "
    "{deploy_s:.1f} s (a new Ray driver, the redeploy, the check). A second model in the table: "
    "{two_models_ratio_c32:ratio}× the one-model throughput at c=32. relay's HAProxy retry "
    "policy (`conn-failure empty-response`) against Serve's (`conn-failure`): c=1 p50 "
    "{retry_p50_gap_ms_c1:+.2f} ms, c=32 {retry_throughput_ratio_c32:ratio}× the throughput "
    "(heavy, batched: {retry_batched_ratio_c32:ratio}×).",
)


def search_table(figures: Figures) -> list[str]:
    """Random vs TPE vs PBT on one budget, per arm. Code, not a Grid: the rows are the arms the
    run had, each cell a spread over that arm's sweeps."""

    def over_sweeps(arm: str, key: str, spec: str) -> str:
        measured = [sweep[key] for sweep in figures["sweeps"] if sweep["arm"] == arm]
        return format_value(measured, f"spread {spec}")

    def versus_random(arm: str) -> str:
        versus = figures["best_vs_random"].get(arm)
        return "—" if versus is None else format_value(versus, "ratio")

    header = ["search", f"best {figures['metric']}", "vs random", "wall", "epochs trained"]
    rows = [
        [
            arm,
            over_sweeps(arm, "best", ".4f"),
            versus_random(arm),
            over_sweeps(arm, "wall_s", "seconds"),
            over_sweeps(arm, "epochs_trained", "g"),
        ]
        for arm in figures["arms"]
    ]
    return markdown_table(header, rows)


def _has_pbt(figures: Figures) -> bool:
    return "pbt" in figures["arms"]


SEARCH = Section(
    "search_algorithms",
    (
        "{trials} trials x {epochs} epochs of {task}/{size} per sweep (budget {budget_epochs} "
        "epochs",
        When(_has_pbt, "; PBT every {pbt_interval} epochs"),
        "), seeds {seeds:list}; median (min–max) over the seeds.",
        When(
            "search_concurrency",
            (
                " Random and TPE run {search_concurrency} trial(s) at a time (TPE chooses from "
                "finished trials' results)",
                When(_has_pbt, ", PBT its whole population.", "."),
            ),
        ),
    ),
    search_table,
)
# bench/search_algorithms.py's rows: the three arms on PBT's shape, then random vs TPE on many
# short trials, where TPE has results to learn from.
SEARCH_ROWS = ("search_algorithms", "search_algorithms_many_trials")


def search_algorithms(results: Results) -> str:
    """One table per row of SEARCH_ROWS that was run."""
    tables = (replace(SEARCH, bench=name)(results) for name in SEARCH_ROWS if name in results)
    return "\n".join(tables)


# --- sample outputs -----------------------------------------------------------------------


def _train_lines(lines: list[str]) -> list[str]:
    """The run line, the first and last epochs, the model line."""
    epochs = [i for i, line in enumerate(lines) if line.startswith("epoch ")]
    model = [line for line in lines if line.startswith("model: ")]
    head = lines[: epochs[0] + 1]
    return [*head, "...", lines[epochs[-1]], *model]


def _report_lines(lines: list[str]) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith("efficiency:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("model: "))
    return ["...", *lines[start:end]]


@dataclass(frozen=True)
class Sample:
    """A command and its output as the bench recorded them, cut to the lines the page shows."""

    bench: str
    keep: Callable[[list[str]], list[str]] = list

    def __call__(self, results: Results) -> str:
        entry = results[self.bench][0]  # the newest run, its machine named with it
        lines = self.keep(entry["output"].splitlines())
        return "```\n$ " + entry["command"] + "\n" + "\n".join(lines) + "\n```\n"


BLOCKS: dict[str, Callable[[Results], str]] = {
    "benchmarks": benchmarks,
    "sample_train": Sample("sample_train", _train_lines),
    "sample_report": Sample("sample_report", _report_lines),
    "sample_plan": Sample("sample_plan"),
    "startup": STARTUP,
    "search_algorithms": search_algorithms,
    "serve_load": SERVE_LOAD,
    "serve_multiplex": SERVE_MULTIPLEX,
}


def render(page: str, results: Results, where: str = "README.md") -> str:
    def block(match: re.Match) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"{where} has a figures block {name!r} that bench/readme.py lacks")
        return match.group(1) + BLOCKS[name](results) + match.group(4)

    return BLOCK.sub(block, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the pages' blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page disagrees")
    args = parser.parse_args(argv)
    current = {page: page.read_text() for page in pages()}
    block_homes(current)
    results = load_results()
    stale = 0
    for page, text in current.items():
        name = str(page.relative_to(REPO))
        wanted = render(text, results, name)
        if wanted == text:
            continue
        stale += 1
        if args.write:
            page.write_text(wanted)
            continue
        sys.stdout.writelines(
            difflib.unified_diff(
                text.splitlines(keepends=True),
                wanted.splitlines(keepends=True),
                name,
                f"{name} as bench/results.jsonl says",
            )
        )
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
