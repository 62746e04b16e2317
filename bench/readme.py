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
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results.jsonl"
BLOCK = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S
)


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


def load_results(path: Path = RESULTS) -> dict[str, dict[str, Any]]:
    entries = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {entry["bench"]: entry for entry in entries}


def get(tree: Any, dotted: str) -> Any:
    """tree["a"]["b"] for "a.b"; a missing key is an error, never a silent blank."""
    for key in dotted.split("."):
        if key not in tree:
            raise KeyError(f"results: no {dotted!r} (missing {key!r})")
        tree = tree[key]
    return tree


# --- formatting ---------------------------------------------------------------------------


def ratio(value: float) -> str:
    return f"{value:.2f}"


def rate(value: float) -> str:
    return f"{value:,.0f}"


def seconds(value: float) -> str:
    return f"{value:.1f} s"


def percent(value: float) -> str:
    return f"{value:.0%}"


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    """median (min–max) of repeated measurements."""
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    if n == 1:
        return fmt(median)
    return f"{fmt(median)} ({fmt(ordered[0])}–{fmt(ordered[-1])})"


# --- one figures cell per bench -----------------------------------------------------------


def train_overhead(f: dict[str, Any]) -> str:
    return (
        f"steady samples/s relay {rate(f['relay_steady_samples_per_s'])} vs torchrun "
        f"{rate(f['torchrun_steady_samples_per_s'])}: `throughput_ratio` "
        f"**{ratio(f['throughput_ratio'])}**; end-to-end "
        f"{ratio(f['end_to_end_throughput_ratio'])} (relay spends "
        f"{f['relay_between_epochs_s']:.3f} s between epochs on report + checkpoint); time to the "
        f"end of epoch 1: relay {seconds(f['relay_first_epoch_s'])} starting Ray, "
        f"{seconds(f['relay_first_epoch_s_ray_up'])} with Ray up, torchrun "
        f"{seconds(f['torchrun_first_epoch_s'])}"
    )


def scaling(f: dict[str, Any]) -> str:
    def speedup(key: str) -> str:
        return f"**{ratio(f[key])}** ({ratio(f[key + '_min'])}–{ratio(f[key + '_max'])})"

    return (
        f"`speedup_2w` relay {speedup('speedup_2w')}, torchrun "
        f"{speedup('torchrun_speedup_2w')} (medians of {f['repeats']} alternated rounds, "
        f"per-round spread): relay's / torchrun's **{ratio(f['speedup_vs_torchrun'])}**; "
        f"samples/s relay / torchrun {ratio(f['relay_vs_torchrun_1w'])} at 1 worker, "
        f"{ratio(f['relay_vs_torchrun_2w'])} at 2; `fraction_of_measured_matmul_peak` "
        f"{ratio(f['fraction_of_measured_matmul_peak'])} at 2 workers "
        f"({ratio(f['fraction_of_measured_matmul_peak_1w'])} at 1); gradient comm "
        f"{percent(f['comm_fraction'])} of compute + comm; while 2 workers train, the rest of "
        f"the process tree (Ray's daemons and actors, the driver) uses "
        f"{f['support_cpu_cores']['relay']['2']:.2f} cores beside relay's workers, "
        f"{f['support_cpu_cores']['torchrun']['2']:.2f} beside torchrun's"
    )


def scaling_hosts(f: dict[str, Any]) -> str:
    rates = f["samples_per_s"]
    links = [r["host1_link_bytes"] for r in f["runs"] if r["side"] == "two_hosts"]
    return (
        f"samples/s with 1 worker on each of 2 namespace hosts "
        f"{spread(rates['two_hosts'], rate)} vs both on one host "
        f"{spread(rates['one_host'], rate)}: `two_hosts_vs_one_host` "
        f"**{ratio(f['two_hosts_vs_one_host'])}** (medians of {f['repeats']} alternated runs "
        f"each; the second host's link carried {spread(links, lambda b: f'{b / 1e6:,.0f} MB')} "
        f"per run)"
    )


def strategies(f: dict[str, Any]) -> str:
    return (
        f"measured state per rank (live tensors after a step, each storage once): "
        f"`fsdp_state_ratio` **{ratio(f['fsdp_state_ratio'])}**, zero1 "
        f"{ratio(f['zero1_state_ratio'])} of ddp; peak RSS growth per rank fsdp/ddp "
        f"{ratio(f['fsdp_rss_growth_ratio'])}; "
        + (
            f"`bf16_speedup` **{ratio(f['bf16_speedup'])}** (ddp)"
            if f["bf16_speedup"] is not None
            else f["bf16_skipped"]
        )
    )


def _wall(arm: dict[str, Any]) -> str:
    return f"{seconds(arm['wall_s_median'])} ({arm['wall_s_min']:.0f}–{arm['wall_s_max']:.0f})"


def _asha_workload(f: dict[str, Any]) -> str:
    """What differs from the defaults: the corpus and the ASHA arm's strategy."""
    settings = f.get("asha_settings", {})
    corpus = f["model"].get("corpus_bytes")
    strategy = {
        "promote": ", ASHA by promotions (`asha.strategy: promote`)",
        "stop": ", ASHA by Ray's stopping rule (`asha.strategy: stop`)",
    }
    # rows from before the option name no strategy: Ray's rule, the only one then
    return (f", a {corpus // 1000} kB corpus" if corpus else "") + strategy.get(
        settings.get("strategy"), ""
    )


def _asha_rank_of_best(f: dict[str, Any]) -> str:
    per_seed = f["per_seed"]
    if not all("rank_of_best" in search for search in per_seed):
        return ""  # rows from before the bench recorded the curves
    return (
        "; without stopping, the best config first ranks in a rung's top 1/reduction_factor "
        "after epoch "
        + ", ".join(str(search["rank_of_best"]["first_epoch_kept"]) for search in per_seed)
        + " (per seed): a rung before that stops it"
    )


def asha_vs_random(f: dict[str, Any]) -> str:
    seeds = f["seeds"]
    if len(seeds) > 1:  # one search per seed: the medians of the per-seed figures
        return (
            f"{len(seeds)} random searches (seeds {', '.join(map(str, seeds))}) of "
            f"{f['trials']} trials of at most {f['max_epochs']} epochs{_asha_workload(f)}, "
            "each run by both arms: "
            f"`wall_ratio` **{ratio(f['wall_ratio'])}** ({ratio(f['wall_ratio_min'])}–"
            f"{ratio(f['wall_ratio_max'])}), `best_metric_gap` **{f['best_metric_gap']:.3f}** "
            f"({f['best_metric_gap_min']:.3f}–{f['best_metric_gap_max']:.3f}) (medians over the "
            f"seeds, min–max); wall per sweep ASHA {_wall(f['asha'])} vs "
            f"{_wall(f['no_stopping'])}, epochs trained {f['asha']['epochs_trained_median']:g} vs "
            f"{f['no_stopping']['epochs_trained_median']:g} (medians over all sweeps)"
            + _asha_rank_of_best(f)
        )
    return (
        f"{f['trials']} trials of at most {f['max_epochs']} epochs: "
        f"`wall_ratio` **{ratio(f['wall_ratio'])}** (ASHA {_wall(f['asha'])} vs "
        f"{_wall(f['no_stopping'])}, medians (min–max) of {f['repeats']} alternated repeats), "
        "epochs trained "
        f"{f['asha']['epochs_trained_median']:g} vs {f['no_stopping']['epochs_trained_median']:g}, "
        f"`best_metric_gap` {f['best_metric_gap']:.3f}"
    )


def overlap(f: dict[str, Any]) -> str:
    low, high = (str(o) for o in f["compared"])
    a, b = f["sides"][low], f["sides"][high]
    return (
        f"ASHA sweep wall time with `overlap: {high}` / `overlap: {low}`: `wall_ratio` "
        f"**{ratio(f['wall_ratio'])}** ({seconds(b['wall_s_median'])} vs "
        f"{seconds(a['wall_s_median'])}, medians of {f['repeats']} alternated repeats; "
        f"{f['trials']} trials of at most {f['max_epochs']} epochs), epochs trained "
        f"{b['epochs_trained_median']:g} vs {a['epochs_trained_median']:g}"
    )


def serve_load(f: dict[str, Any]) -> str:
    tiny = f["levels"]["tiny"]
    return (
        f"tiny model, c=32: relay (HAProxy) {rate(get(tiny, 'haproxy.32.rps'))} vs plain "
        f"{rate(get(tiny, 'plain.32.rps'))} req/s (`throughput_ratio_c32` "
        f"**{ratio(f['throughput_ratio_c32'])}**, `p99_ratio_c32` {ratio(f['p99_ratio_c32'])}); "
        f"Python proxy {ratio(f['proxy_ratio_c32'])}; heavy model batched vs plain "
        f"**{ratio(f['batched_throughput_ratio_c32'])}**; version swaps under load: "
        f"**{f['swap_failed_requests']}** failed of {f['swap_requests']:,}"
    )


def serve_load_block(results: dict[str, dict[str, Any]]) -> str:
    """bench/serve_load.py: every server at every level, both models."""
    e = results["serve_load"]
    f = e["figures"]
    setup = f["setup"]
    levels = sorted({int(c) for sides in f["levels"].values() for s in sides.values() for c in s})
    lines = [
        f"req/s, then p50 / p99 latency, median of {setup['repeats']} alternated repeats "
        f"({setup['seconds_per_level']} s per level, {setup['client']}); tiny: "
        f"{setup['models']['tiny']}, heavy: {setup['models']['heavy']}. A lone request through "
        f"HAProxy: p50 {f['p50_gap_ms_c1']:+.2f} ms against plain. Run: `{e['command']}`, "
        f"{(e['commit'] or '?')[:8]}{'+' if e['dirty'] else ''}, {e['date'][:10]}.",
        "",
        "| model | server | " + " | ".join(f"c={c}" for c in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    order = (
        "plain",
        "haproxy",
        "haproxy conn-failure retry",
        "haproxy 2 models",
        "haproxy serve.batch",
        "proxy",
    )
    for model in ("tiny", "heavy"):
        sides = f["levels"][model]
        for side in sorted(sides, key=lambda name: order.index(name) if name in order else 9):
            figures = sides[side]
            cells = []
            for c in levels:
                x = figures.get(str(c))
                cells.append(
                    "—"
                    if x is None
                    else f"{rate(x['rps'])}, {x['p50_ms']:.1f} / {x['p99_ms']:.1f} ms"
                )
            lines.append(f"| {model} | {side} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Version swaps under load (tiny model, HAProxy, c=32, `relay deploy` alternating "
        f"1 → 2 → 1 in {len(f['swap_windows']['swap'])} windows of {setup['swap_seconds']} s, "
        f"each beside a steady window): **{f['swap_failed_requests']}** failed requests of "
        f"{f['swap_requests']:,} (steady windows: {f['steady_failed_requests']}); p99 "
        f"{f['swap_p99_ms']:.1f} ms during a swap vs {f['steady_p99_ms']:.1f} ms steady "
        f"(max {f['swap_max_ms']:.1f} vs {f['steady_max_ms']:.1f} ms); `relay deploy` took "
        f"{f['deploy_s']:.1f} s (a new Ray driver, the redeploy, the check). A second model in "
        f"the table: {ratio(f['two_models_ratio_c32'])}× the one-model throughput at c=32. "
        "relay's HAProxy retry policy (`conn-failure empty-response`) against Serve's "
        f"(`conn-failure`): c=1 p50 {f['retry_p50_gap_ms_c1']:+.2f} ms, c=32 "
        f"{ratio(f['retry_throughput_ratio_c32'])}× the throughput (heavy, batched: "
        f"{ratio(f['retry_batched_ratio_c32'])}×).",
    ]
    return "\n".join(lines) + "\n"


def serve_multiplex(f: dict[str, Any]) -> str:
    cold, heavy = f["cold_first_ms"], f["cold_first_ms_heavy"]
    return (
        f"two models on one replica, Serve's multiplexing / relay's table at c=32 "
        f"**{ratio(f['multiplexed_ratio_c32'])}**; a model's first request "
        f"{heavy['multiplexed']:.0f} vs {heavy['table']:.0f} ms (68 MB models), "
        f"{cold['multiplexed']:.0f} vs {cold['table']:.0f} ms (tiny)"
    )


def serve_multiplex_block(results: dict[str, dict[str, Any]]) -> str:
    """bench/serve_multiplex.py: the table against multiplexing, cold and warm."""
    e = results["serve_multiplex"]
    f = e["figures"]
    setup, levels = f["setup"], f["levels"]
    lines = [
        f"Two models on one replica (HAProxy), relay's table vs Serve's `@serve.multiplexed` "
        f"loading the same replica's models on demand; median of {setup['repeats']} alternated "
        f"repeats, {setup['seconds_per_level']} s per level ({setup['client']}). Run: "
        f"`{e['command']}`, {(e['commit'] or '?')[:8]}{'+' if e['dirty'] else ''}, "
        f"{e['date'][:10]}.",
        "",
        "| | table | multiplexed |",
        "|---|---|---|",
    ]
    for c in ("1", "32"):
        cells = [
            f"{rate(levels[side][c]['rps'])} req/s, p50 {levels[side][c]['p50_ms']:.1f} / "
            f"p99 {levels[side][c]['p99_ms']:.1f} ms"
            for side in ("table", "multiplexed")
        ]
        lines.append(
            f"| c={c}, requests alternating between the models | " + " | ".join(cells) + " |"
        )
    for key, size in (("cold_first_ms", "tiny"), ("cold_first_ms_heavy", setup["sizes"]["heavy"])):
        cold = f[key]
        lines.append(
            f"| first request to a model ({size}), slower of the two | "
            f"{cold['table']:.1f} ms | {cold['multiplexed']:.1f} ms |"
        )
    return "\n".join(lines) + "\n"


def startup(f: dict[str, Any]) -> str:
    relay, saved = f["sides"]["relay"], f["saved_s"]["ray_defaults"]
    return (
        f"per-trial start-up (in Tune, relay's `fit()` → first step) "
        f"**{seconds(f['trial_startup_s'])}** ({seconds(relay['trial']['total_s']['min'])}–"
        f"{seconds(relay['trial']['total_s']['max'])}), a `relay train` run "
        f"{seconds(f['run_startup_s'])}, next to the bare `TorchTrainer` floor "
        f"{seconds(f['floor_s'])} (`fit()` → its loop's first line); {f['workers']} workers, "
        f"medians of {f['repeats']} alternated repeats; relay's switches save (Ray's defaults "
        f"minus relay's) {saved['run']:+.1f} s per run, {saved['trial']:+.1f} s per trial"
    )


def memory_wall(f: dict[str, Any]) -> str:
    def run_of(strategy: str, workers: int) -> dict[str, Any]:
        (run,) = [r for r in f["runs"] if (r["strategy"], r["workers"]) == (strategy, workers)]
        return run

    def growth(strategy: str, workers: int) -> str:
        run = run_of(strategy, workers)
        fullest = max(run["growth_bytes_per_rank"])
        return f"{mib(fullest)} (plan {mib(run['plan_total_bytes'])})"

    def startup(strategy: str, workers: int) -> str:
        return mib(max(run_of(strategy, workers)["startup_growth_bytes_per_rank"]))

    return (
        f"peak RSS growth of the fullest rank, fsdp/ddp: **{ratio(f['fsdp_over_ddp_growth_2'])}** "
        f"at 2 workers, **{ratio(f['fsdp_over_ddp_growth_4'])}** at 4 (zero1/ddp "
        f"{ratio(f['zero1_over_ddp_growth_2'])}, {ratio(f['zero1_over_ddp_growth_4'])}); ddp "
        f"{growth('ddp', 2)}, fsdp {growth('fsdp', 2)} at 2, fsdp {growth('fsdp', 4)} at 4; "
        + (
            f"start-up alone (building the model, fsdp on the meta device), fsdp/ddp: "
            f"**{ratio(f['fsdp_over_ddp_startup_2'])}** at 2 workers, "
            f"**{ratio(f['fsdp_over_ddp_startup_4'])}** at 4 (fullest rank: ddp "
            f"{startup('ddp', 2)}, fsdp {startup('fsdp', 2)} at 2, {startup('fsdp', 4)} at 4); "
            if f.get("fsdp_over_ddp_startup_2") is not None
            else ""
        )
        + f"checkpoint save at 2 workers gathered {seconds(f['save_gathered_s'])} vs sharded "
        f"{seconds(f['save_sharded_s'])} (**{ratio(f['save_sharded_over_gathered'])}**)"
        + (
            f"; measured/plan, the furthest from 1 over the runs: state "
            f"{ratio(f['state_over_plan_worst'])}, activations "
            f"{ratio(f['activations_over_plan_worst'])}"
            if f.get("activations_over_plan_worst") is not None
            else ""
        )
    )


def checkpoint_upload(f: dict[str, Any]) -> str:
    samples, stall = f["sides"], f["stall_s"]

    def throughput(side: str) -> str:
        return rate(samples[side]["samples_per_s"]["median"])

    return (
        f"a checkpoint every epoch (fsdp, 2 workers, sharded), copied to storage beside the next "
        f"epoch (async) vs waited for (sync) vs none between epochs: step-time hit async "
        f"**{percent(f['async_step_time_hit'])}** (sync {percent(f['sync_step_time_hit'])}; "
        f"samples/s {throughput('async')}, {throughput('sync')}, {throughput('none')}; none's "
        f"own runs spread {rate(samples['none']['samples_per_s']['min'])}–"
        f"{rate(samples['none']['samples_per_s']['max'])}); "
        f"training held up per epoch {seconds(stall['async'])} async, {seconds(stall['sync'])} "
        f"sync, {seconds(stall['none'])} none; medians of {f['repeats']} alternated runs"
    )


def ingest(f: dict[str, Any]) -> str:
    rates = f["rows_per_s"]
    return (
        f"rows/s to 2 workers from Parquet, tokenised on the way: Ray Data "
        f"{rate(rates['ray_data']['median'])} vs `DataLoader` "
        f"{rate(rates['dataloader']['median'])} (`ray_data_vs_dataloader` "
        f"**{ratio(f['ray_data_vs_dataloader'])}**), already in memory "
        f"{rate(rates['in_memory']['median'])}; charlm debug trainers wait for input "
        f"{percent(f['trainer_idle_share'])} of the training pass"
    )


TABLE = {
    "train_overhead": (
        "2-worker relay `TorchTrainer` vs plain `torchrun`, the same epoch code "
        "(relay.training.epochs)",
        train_overhead,
    ),
    "scaling": ("1 → 2 workers, relay and plain torchrun side by side", scaling),
    "scaling_hosts": (
        "the network hop: the same 2 workers one per namespace host vs both on one",
        scaling_hosts,
    ),
    "strategies": ("ddp / zero1 / fsdp × fp32 / bf16 on 2 workers", strategies),
    "memory_wall": (
        "a 63 M-parameter MLP: memory per rank by strategy at 2 and 4 workers; save times",
        memory_wall,
    ),
    "checkpoint_upload": (
        "the same model: a checkpoint every epoch copied to storage async vs sync vs none",
        checkpoint_upload,
    ),
    "asha_vs_random": ("ASHA vs no stopping over the same random trials", asha_vs_random),
    "asha_vs_random_9x9": (
        "the same, on a sweep of 9 trials of up to 9 epochs (ASHA's rungs 1, 3, 9)",
        asha_vs_random,
    ),
    "asha_vs_random_promote": (
        "the 9-trial sweep with ASHA by promotions, where epochs are long next to a start-up",
        asha_vs_random,
    ),
    "asha_vs_random_stop_160k": (
        "the same sweeps as the row above with Ray's stopping rule (`asha.strategy: stop`)",
        asha_vs_random,
    ),
    "startup": (
        "per-run start-up: a Tune trial and a run vs a bare TorchTrainer; switches vs Ray's",
        startup,
    ),
    "overlap": ("one more trial than fits, started while others train, vs none", overlap),
    "serve_load": ("`relay serve` (HAProxy, Python proxy) vs a plain FastAPI server", serve_load),
    "serve_multiplex": (
        "several models on one endpoint: relay's model table vs Serve's multiplexing",
        serve_multiplex,
    ),
    "ingest": ("data from Parquet files vs a DataLoader and vs in memory", ingest),
}


def benchmarks(results: dict[str, dict[str, Any]]) -> str:
    entries = [results[name] for name in TABLE if name in results]
    machines = {json.dumps(e["machine"], sort_keys=True) for e in entries}
    lines = []
    for m in sorted(machines):
        m = json.loads(m)
        lines.append(
            f"Measured on {m['cores']} cores ({m['cpu_model']}), {m['memory_gib']} GiB; "
            "each row names the commit and date of its run. Wall time of the benches and samples: "
            f"{sum(e['wall_s'] for e in results.values()) / 60:.0f} min."
        )
    lines += ["", "| command | what | figures | run |", "|---|---|---|---|"]
    for name, (what, cell) in TABLE.items():
        if name not in results:
            continue
        e = results[name]
        run = f"{(e['commit'] or '?')[:8]}{'+' if e['dirty'] else ''}, {e['date'][:10]}"
        lines.append(f"| `{e['command']}` | {what} | {cell(e['figures'])} | {run} |")
    return "\n".join(lines) + "\n"


def sample(name: str, keep: Callable[[list[str]], list[str]]) -> Callable[[dict], str]:
    def render(results: dict[str, dict[str, Any]]) -> str:
        e = results[name]
        lines = keep(e["output"].splitlines())
        return "```\n$ " + e["command"] + "\n" + "\n".join(lines) + "\n```\n"

    return render


# bench/search_algorithms.py's rows: the three arms on PBT's shape, then random vs TPE on many
# short trials, where TPE has results to learn from.
SEARCH_ROWS = ("search_algorithms", "search_algorithms_many_trials")


def search_algorithms(results: dict[str, dict[str, Any]]) -> str:
    """Random vs TPE vs PBT on one budget: best val loss, wall time, epochs, per arm; one
    table per row of SEARCH_ROWS that was run."""
    return "\n".join(_search_table(results[name]) for name in SEARCH_ROWS if name in results)


def _search_table(e: dict[str, Any]) -> str:
    f = e["figures"]
    pbt = "pbt" in f["arms"]
    lines = [
        f"{f['trials']} trials x {f['epochs']} epochs of {f['task']}/{f['size']} per sweep "
        f"(budget {f['budget_epochs']} epochs"
        + (f"; PBT every {f['pbt_interval']} epochs" if pbt else "")
        + f"), seeds {', '.join(map(str, f['seeds']))}; median (min–max) over the seeds. "
        + (
            f"Random and TPE run {f['search_concurrency']} trial(s) at a time (TPE chooses "
            "from finished trials' results)" + (", PBT its whole population. " if pbt else ". ")
            if "search_concurrency" in f
            else ""
        )
        + f"Run: `{e['command']}`, {(e['commit'] or '?')[:8]}{'+' if e['dirty'] else ''}, "
        f"{e['date'][:10]}.",
        "",
        f"| search | best {f['metric']} | vs random | wall | epochs trained |",
        "|---|---|---|---|---|",
    ]
    for arm in f["arms"]:
        best = [s["best"] for s in f["sweeps"] if s["arm"] == arm]
        walls = [s["wall_s"] for s in f["sweeps"] if s["arm"] == arm]
        epochs = [s["epochs_trained"] for s in f["sweeps"] if s["arm"] == arm]
        versus = f["best_vs_random"].get(arm)
        lines.append(
            f"| {arm} | {spread(best, lambda v: f'{v:.4f}')} | "
            f"{ratio(versus) if versus is not None else '—'} | {spread(walls, seconds)} | "
            f"{spread(epochs, lambda v: f'{v:g}')} |"
        )
    return "\n".join(lines) + "\n"


# bench/startup.py's parts, one row each: (label, key in each run's figures).
STARTUP_ROWS = (
    ("relay's work before `TorchTrainer.fit()` (config, task data)", "prepare_s"),
    ("controller actor up", "controller_s"),
    ("worker group: placement group, worker actors, process group", "worker_group_s"),
    ("worker group ready → the loop's first line", "launch_s"),
    ("model and data", "model_and_data_s"),
    ("first step", "first_step_s"),
    ("**`fit()` → first step** (bare TorchTrainer: → its loop's first line)", "total_s"),
)


def startup_block(results: dict[str, dict[str, Any]]) -> str:
    """bench/startup.py's parts: the bare floor, a run and a Tune trial; switches on vs off."""
    e = results["startup"]
    f = e["figures"]

    def part(side: str, run: str, key: str) -> str:
        s = f["sides"][side][run].get(key)
        if s is None:
            return "—"
        return f"{seconds(s['median'])} ({s['min']:.1f}–{s['max']:.1f})"

    lines = [
        f"Median (min–max) of {f['repeats']} alternated repeats, {f['workers']} workers, "
        f"{f['task']} ({f['size']}), each side on its own fresh cluster after a warm-up run. "
        f"Run: `{e['command']}`, {(e['commit'] or '?')[:8]}{'+' if e['dirty'] else ''}, "
        f"{e['date'][:10]}.",
        "",
        "| part | bare TorchTrainer | relay run | relay trial (Tune) | trial, Ray's defaults |",
        "|---|---|---|---|---|",
    ]
    for label, key in STARTUP_ROWS:
        lines.append(
            f"| {label} | {part('ray_defaults', 'floor', key)} | {part('relay', 'run', key)} | "
            f"{part('relay', 'trial', key)} | {part('ray_defaults', 'trial', key)} |"
        )
    return "\n".join(lines) + "\n"


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


BLOCKS: dict[str, Callable[[dict[str, dict[str, Any]]], str]] = {
    "benchmarks": benchmarks,
    "sample_train": sample("sample_train", _train_lines),
    "sample_report": sample("sample_report", _report_lines),
    "sample_plan": sample("sample_plan", lambda lines: lines),
    "startup": startup_block,
    "search_algorithms": search_algorithms,
    "serve_load": serve_load_block,
    "serve_multiplex": serve_multiplex_block,
}


def render(page: str, results: dict[str, dict[str, Any]], where: str = "README.md") -> str:
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
