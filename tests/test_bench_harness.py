"""bench/harness.py: what every bench repeats (the order of its runs, medians and spreads, its
temporary storage, its results line). Pure functions, checked on their values: the benches'
JSON keeps its keys, nesting and order only while these give what each bench computed by hand
before, and the results line only counts while bench/run_all.py parses it back."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

pytestmark = pytest.mark.timeout(60)

BENCH = REPO / "bench"


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("harness")
    # The repository's harness/ folder (namespace-host clusters) is another thing: this is it.
    assert module.__file__ == str(BENCH / "harness.py")
    return module


@pytest.fixture
def run_all(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("run_all")


# --- the order of the runs ---------------------------------------------------------------------


def test_alternated_reverses_every_other_round(harness):
    assert harness.alternated(["a", "b"], 3) == [
        (0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b"),
    ]  # fmt: skip
    assert harness.alternated(["a", "b"], 0) == []


def test_alternated_sides_match_the_loops_the_benches_wrote_by_hand(harness):
    sides = ("none", "sync", "async")  # checkpoint_upload's: a tuple, reversed as one
    by_hand = [
        side for repeat in range(3) for side in (sides if repeat % 2 == 0 else reversed(sides))
    ]
    assert harness.alternated_sides(sides, 3) == by_hand
    assert by_hand == ["none", "sync", "async", "async", "sync", "none", "none", "sync", "async"]


def test_the_swap_phases_alternate_as_serve_load_ran_them(harness):
    # serve_load's swaps: steady then swap in even rounds, swap then steady in odd ones.
    assert harness.alternated(("steady", "swap"), 2) == [
        (0, "steady"), (0, "swap"), (1, "swap"), (1, "steady"),
    ]  # fmt: skip


# --- figures over repeats ----------------------------------------------------------------------


def test_spread_is_the_median_with_min_and_max_in_that_order(harness):
    figures = harness.spread([3, 1, 2])
    assert figures == {"median": 2, "min": 1, "max": 3}
    assert list(figures) == ["median", "min", "max"]  # the JSON's key order
    assert harness.spread([4.0, 1.0, 2.0, 3.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}
    assert harness.spread(v for v in (5, 7)) == {"median": 6.0, "min": 5, "max": 7}


def test_spread_names_its_keys_as_each_bench_does(harness):
    # asha_vs_random's `wall_ratio_median` ..., memory_wall's `median_s` ...
    assert harness.spread([0.5, 1.5], prefix="wall_ratio_") == {
        "wall_ratio_median": 1.0, "wall_ratio_min": 0.5, "wall_ratio_max": 1.5,
    }  # fmt: skip
    assert list(harness.spread([0.5, 1.5], suffix="_s")) == ["median_s", "min_s", "max_s"]


def test_spread_of_nothing_is_an_error_not_a_figure(harness):
    with pytest.raises(ValueError):
        harness.spread([])


def test_median_of_a_key_over_rows(harness):
    rows = [{"rps": 10.0}, {"rps": 30.0}, {"rps": 20.0}, {"rps": 40.0}]
    assert harness.median_of(rows, "rps") == 25.0
    assert harness.median_of(iter(rows[:3]), "rps") == 20.0


RUNS = [
    {"side": "a", "x": 1, "y": 10},
    {"side": "b", "x": 5, "y": 50},
    {"side": "a", "x": 3, "y": 30},
]


def test_side_spreads_nested(harness):
    spreads = harness.side_spreads(RUNS, "side", ("b", "a"), ("x", "y"))
    assert spreads == {
        "b": {"x": {"median": 5, "min": 5, "max": 5}, "y": {"median": 50, "min": 50, "max": 50}},
        "a": {"x": {"median": 2, "min": 1, "max": 3}, "y": {"median": 20, "min": 10, "max": 30}},
    }  # fmt: skip
    assert list(spreads) == ["b", "a"]  # in the order of the sides given, not of the runs


def test_side_spreads_flat_prefixes_each_key(harness):
    spreads = harness.side_spreads(RUNS, "side", ["a"], ["x", "y"], flat=True)
    assert spreads == {"a": {"x_median": 2.0, "x_min": 1, "x_max": 3,
                             "y_median": 20.0, "y_min": 10, "y_max": 30}}  # fmt: skip
    assert list(spreads["a"]) == ["x_median", "x_min", "x_max", "y_median", "y_min", "y_max"]


def test_spread_text_is_median_then_min_max(harness):
    assert harness.spread_text({"median": 1.23456, "min": 1, "max": 2}) == "1.235 (1.000-2.000)"
    flat = {"wall_s_median": 1234.5, "wall_s_min": 1000.0, "wall_s_max": 2000.0}
    assert harness.spread_text(flat, "{:.4g}", "wall_s_") == "1234 (1000-2000)"
    assert harness.spread_text(harness.spread([1500, 900]), "{:,.0f}") == "1,200 (900-1,500)"


# --- temporary storage -------------------------------------------------------------------------


def test_scratch_is_a_fresh_directory_removed_after(harness):
    with harness.scratch("unit") as tmp:
        path = Path(tmp)
        assert path.name.startswith("relay-bench-unit-")
        assert path.is_dir() and not any(path.iterdir())
        (path / "left.txt").write_text("x")
    assert not path.exists()


def test_relay_home_points_relay_at_it_and_removes_it(tmp_path):
    # In a process of its own: relay_home sets os.environ and would shut down a Ray it finds
    # imported, neither of which this test process should see.
    code = """
import json, os, sys
from harness import relay_home
with relay_home("unit") as home:
    inside = {"home": str(home), "is_dir": home.is_dir(), "type": type(home).__name__,
              "RELAY_HOME": os.environ["RELAY_HOME"], "RAY_ADDRESS": os.environ["RAY_ADDRESS"]}
print(json.dumps({**inside, "exists_after": os.path.exists(inside["home"]),
                  "ray_imported": "ray" in sys.modules}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=30,
        env={"PATH": "/usr/bin:/bin", "RAY_ADDRESS": "auto", "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["home"].startswith(str(tmp_path / "relay-bench-unit-"))
    assert seen["is_dir"] and seen["type"] == "PosixPath"
    assert seen["RELAY_HOME"] == seen["home"]
    assert seen["RAY_ADDRESS"] == "local"  # not the cluster the environment named
    assert seen["exists_after"] is False
    assert seen["ray_imported"] is False  # the harness needs nothing but the standard library


def test_a_missing_program_exits_naming_its_package(harness, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(SystemExit) as exited:
        harness.require_program("wrk", "bench/serve_load.py")
    assert exited.value.code == "bench/serve_load.py needs wrk: apt-get install wrk"
    with pytest.raises(SystemExit) as exited:
        harness.require_program("ip", "bench/scaling.py", package="iproute2")
    assert exited.value.code == "bench/scaling.py needs ip: apt-get install iproute2"
    program = tmp_path / "wrk"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    assert harness.require_program("wrk", "bench/serve_load.py") is None  # found: no exit


# --- the results line --------------------------------------------------------------------------


FIGURES = {
    "wall_ratio": 0.8123456789,
    "sides": {"relay": {"median": 2.5, "min": 1, "max": 4}},
    "order": ["relay", "torchrun", "torchrun", "relay"],
    "missing": None,
    "name": "digits · debug",
}


def test_the_results_line_round_trips_through_run_alls_parser(harness, run_all, capsys):
    print("warming up")
    print('{"an": "earlier line"}')
    harness.print_results(FIGURES)
    print("cluster shut down")  # a line after it that is not JSON does not hide it
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == json.dumps(FIGURES)  # one line, as json.dumps writes it
    parsed = run_all.results_line(lines)
    assert parsed == FIGURES
    assert list(parsed) == list(FIGURES)
    assert list(parsed["sides"]["relay"]) == ["median", "min", "max"]


def test_run_all_finds_no_results_line_without_one(run_all):
    assert run_all.results_line(["starting", "done", ""]) is None
    assert run_all.results_line(['{"a": 1}', "[1, 2]"]) == {"a": 1}


def test_figures_that_are_not_an_object_are_refused(harness, capsys):
    # run_all looks for a line starting with "{": a list would print and never be found.
    with pytest.raises(TypeError, match="dict"):
        harness.print_results([1, 2])
    assert capsys.readouterr().out == ""


# --- the results file: a line per bench and machine ----------------------------------------------


@pytest.fixture
def results_file(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("results_file")


@pytest.fixture
def readme(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("readme")


def _entry(bench: str, cpu: str, date: str, figure: float) -> dict:
    return {
        "bench": bench,
        "machine": {"cores": 2, "cpu_model": cpu, "memory_gib": 23.5},
        "date": date,
        "figures": {"figure": figure},
    }


def test_a_run_on_another_machine_adds_lines_and_a_rerun_replaces_its_own(results_file, tmp_path):
    path = tmp_path / "results.jsonl"
    order = ["train_overhead", "scaling"]
    amd = _entry("train_overhead", "AMD EPYC", "2026-12-05T10:00:00+00:00", 1.01)
    entries = results_file.read(path)  # no file yet: nothing recorded
    entries[results_file.key(amd)] = amd
    results_file.write(entries, order, path)

    # `make bench` on an Intel machine: its train_overhead line goes beside the AMD one.
    entries = results_file.read(path)
    intel = _entry("train_overhead", "Intel Xeon", "2026-12-07T10:00:00+00:00", 0.81)
    scaling = _entry("scaling", "Intel Xeon", "2026-12-07T11:00:00+00:00", 0.87)
    for entry in (scaling, intel):
        entries[results_file.key(entry)] = entry
    results_file.write(entries, order, path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["bench"], e["machine"]["cpu_model"]) for e in lines] == [
        ("train_overhead", "AMD EPYC"),
        ("train_overhead", "Intel Xeon"),
        ("scaling", "Intel Xeon"),
    ]

    # A rerun on the AMD machine replaces the AMD line only.
    rerun = _entry("train_overhead", "AMD EPYC", "2026-12-08T10:00:00+00:00", 0.99)
    entries = results_file.read(path)
    entries[results_file.key(rerun)] = rerun
    results_file.write(entries, order, path)
    by_bench = results_file.by_bench(results_file.read(path))
    assert [e["figures"]["figure"] for e in by_bench["train_overhead"]] == [
        0.99,
        0.81,
    ]  # newest 1st
    assert [e["figures"]["figure"] for e in by_bench["scaling"]] == [0.87]


def test_the_pages_name_the_machine_of_every_figure(results_file, readme):
    # The recorded results, plus the same startup and train_overhead runs said to come from
    # another machine, later: the table has a row for each machine, the startup block (one run)
    # shows the newer one, and each says which machine measured it.
    entries = results_file.read()
    recorded = {bench: entry for (bench, _), entry in entries.items()}
    other = {"cores": 2, "cpu_model": "Intel(R) Xeon(R) CPU @ 2.20GHz", "memory_gib": 23.5}
    for bench in ("train_overhead", "startup"):
        copy = {**recorded[bench], "machine": other, "date": "2099-01-01T00:00:00+00:00"}
        entries[results_file.key(copy)] = copy
    results = results_file.by_bench(entries)

    table = readme.benchmarks(results)
    rows = [line for line in table.splitlines() if "bench/train_overhead.py`" in line]
    assert len(rows) == 2
    assert rows[0].endswith(", AMD EPYC, 2 cores |") and "2099-01-01" not in rows[0]
    assert rows[1].endswith("2099-01-01, Intel(R) Xeon(R) CPU @ 2.20GHz, 2 cores |")
    assert "Measured on 2 cores (Intel(R) Xeon(R) CPU @ 2.20GHz)" in table
    assert "Measured on 2 cores (AMD EPYC)" in table

    startup = readme.BLOCKS["startup"](results)
    assert "2099-01-01, Intel(R) Xeon(R) CPU @ 2.20GHz, 2 cores." in startup


# --- what each side ran with ----------------------------------------------------------------------

ONE_THREAD = {
    "threads": 1,
    "interop_threads": 2,
    "omp_num_threads": "1",
    "affinity": [0, 1],
    "nice": 0,
}


def test_alike_sides_differ_in_nothing_and_unlike_ones_name_what(harness):
    alike = {"relay": [ONE_THREAD, ONE_THREAD], "torchrun": [dict(ONE_THREAD)] * 2}
    assert harness.cpu_differences(alike) == []
    niced = {**ONE_THREAD, "nice": 15}
    pinned = {**ONE_THREAD, "affinity": [1], "threads": 2}
    unlike = {"relay": [ONE_THREAD, niced], "torchrun": [ONE_THREAD, pinned]}
    assert harness.cpu_differences(unlike) == ["affinity", "nice", "threads"]


def test_cpu_text_says_it_once_for_alike_ranks_and_per_rank_otherwise(harness):
    assert harness.cpu_text([ONE_THREAD, ONE_THREAD]) == (
        "2 rank(s): 1 thread(s) (2 inter-op), OMP_NUM_THREADS 1, cores [0, 1], nice 0"
    )
    text = harness.cpu_text([ONE_THREAD, {**ONE_THREAD, "nice": 15}])
    assert text.startswith("rank 0: 1 thread(s)") and text.endswith("cores [0, 1], nice 15")
