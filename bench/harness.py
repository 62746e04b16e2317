"""What every bench repeats, in one place, so that each bench keeps only what it measures:

- the order of its runs (`alternated`, `alternated_sides`): sides in rounds, every other round
  reversed, so a load drifting during the bench weighs on every side alike;
- its figures over repeats (`spread`, `side_spreads`, `median_of`, `spread_text`): a median
  with its min and max, since one run's number alone says little on a shared machine;
- what each side computed with (`cpu_differences`, `cpu_text`): threads, allowed cores and
  niceness per rank, so that unlike work cannot hide behind a ratio;
- its temporary storage (`scratch`, `relay_home`): a fresh directory per bench, gone after it,
  so no run reads another's records;
- the programs it needs besides the venv (`require_program`), checked before anything runs;
- its results line (`print_results`): the one JSON object `bench/run_all.py` records.

Benches import it as `harness` (bench/ is the script's directory, so on sys.path); the benches
run as scripts, so this module needs nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

Side = TypeVar("Side")


# --- the order of the runs -------------------------------------------------------------------


def alternated(sides: Sequence[Side], repeats: int) -> list[tuple[int, Side]]:
    """(round, side) for `repeats` rounds of `sides`, the odd rounds in reverse (A B, B A, A B,
    ...): each side takes every position, so a drifting load or a cold cache favours none."""
    return [(r, side) for r in range(repeats) for side in (sides if r % 2 == 0 else sides[::-1])]


def alternated_sides(sides: Sequence[Side], repeats: int) -> list[Side]:
    """The sides of `alternated`, without their rounds."""
    return [side for _, side in alternated(sides, repeats)]


# --- figures over repeats --------------------------------------------------------------------


def spread(values: Iterable[float], prefix: str = "", suffix: str = "") -> dict[str, float]:
    """The median of `values` with its min and max, as {"median", "min", "max"}; each name
    between `prefix` and `suffix` where a bench's figures name them so (`wall_s_median`,
    `median_s`). The min and max are the values as measured, not rounded."""
    values = list(values)
    return {
        f"{prefix}median{suffix}": statistics.median(values),
        f"{prefix}min{suffix}": min(values),
        f"{prefix}max{suffix}": max(values),
    }


def median_of(rows: Iterable[dict[str, Any]], key: str) -> float:
    """The median of `key` over `rows` (the runs of one side, the windows of one phase)."""
    return statistics.median(row[key] for row in rows)


def side_spreads(
    runs: Sequence[dict[str, Any]],
    field: str,
    sides: Iterable[Any],
    keys: Iterable[str],
    flat: bool = False,
) -> dict[Any, dict[str, Any]]:
    """Per side (the runs whose `field` is that side, in the order of `sides`), the spread of
    each of `keys` over its runs: nested as {key: {"median", "min", "max"}}, or with `flat`
    as {"<key>_median", "<key>_min", "<key>_max", ...}."""
    keys = list(keys)
    out: dict[Any, dict[str, Any]] = {}
    for side in sides:
        mine = [run for run in runs if run[field] == side]
        if flat:
            out[side] = {
                name: value
                for key in keys
                for name, value in spread([r[key] for r in mine], prefix=f"{key}_").items()
            }
        else:
            out[side] = {key: spread([r[key] for r in mine]) for key in keys}
    return out


def spread_text(s: dict[str, float], fmt: str = "{:.3f}", prefix: str = "") -> str:
    """A spread as the console shows it: "median (min-max)", each number by `fmt`; `prefix`
    picks one key's spread out of a flat `side_spreads` entry."""
    median, low, high = (fmt.format(s[prefix + name]) for name in ("median", "min", "max"))
    return f"{median} ({low}-{high})"


# --- what each side ran with ------------------------------------------------------------------


def cpu_differences(sides: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The keys of parallel.cpu_setup (threads, interop threads, OMP_NUM_THREADS, allowed cores,
    niceness) on which the sides' ranks did not all run alike: a comparison of throughput
    means little while this is not empty."""
    ranks = [rank for setups in sides.values() for rank in setups]
    keys = sorted({key for rank in ranks for key in rank})
    return [key for key in keys if len({json.dumps(rank.get(key)) for rank in ranks}) > 1]


def cpu_text(setups: list[dict[str, Any]]) -> str:
    """One rank's setup per item: "2 ranks: 1 thread (1 inter-op), OMP_NUM_THREADS 1, cores
    [0, 1], nice 0", or each rank's where they differ."""

    def one(rank: dict[str, Any]) -> str:
        return (
            f"{rank['threads']} thread(s) ({rank['interop_threads']} inter-op), OMP_NUM_THREADS "
            f"{rank['omp_num_threads']}, cores {rank['affinity']}, nice {rank['nice']}"
        )

    texts = [one(rank) for rank in setups]
    if len(set(texts)) == 1:
        return f"{len(texts)} rank(s): {texts[0]}"
    return "; ".join(f"rank {i}: {text}" for i, text in enumerate(texts))


# --- temporary storage -----------------------------------------------------------------------


def scratch(name: str) -> tempfile.TemporaryDirectory:
    """A fresh directory (`relay-bench-<name>-*` in the system's temp folder) for one bench's
    storage, removed when its `with` ends: each bench starts from no runs, registry or cache,
    and leaves none behind. The `with` gives the directory's path as a string."""
    return tempfile.TemporaryDirectory(prefix=f"relay-bench-{name}-")


@contextlib.contextmanager
def relay_home(name: str) -> Iterator[Path]:
    """A `scratch` directory as relay's home (RELAY_HOME) with RAY_ADDRESS=local, so relay
    starts its own embedded cluster rather than join one already up; on the way out, Ray (if
    the bench imported it) is shut down before its directory is removed."""
    with scratch(name) as tmp:
        os.environ["RELAY_HOME"] = tmp
        os.environ["RAY_ADDRESS"] = "local"
        try:
            yield Path(tmp)
        finally:
            if "ray" in sys.modules:
                sys.modules["ray"].shutdown()


def require_program(program: str, bench: str, package: str | None = None) -> None:
    """Exit at once, naming what to install, where `program` is not on PATH: a bench that
    finds it missing after its set-up has wasted minutes (run_all.py checks the same first)."""
    if shutil.which(program) is None:
        sys.exit(f"{bench} needs {program}: apt-get install {package or program}")


# --- the results line ------------------------------------------------------------------------


def print_results(figures: dict[str, Any]) -> None:
    """Print a bench's figures as its results line: one JSON object on one line.

    `bench/run_all.py` (`results_line`) keeps, of all a bench printed, the last line that starts
    with "{" and parses it with `json.loads` into the bench's `figures` in results.jsonl, which
    bench/readme.py quotes in the docs. So the figures must be a JSON object (a list or a number
    would not start with "{"), printed on one line (no indent), and nothing starting with "{" may
    follow it."""
    if not isinstance(figures, dict):
        raise TypeError(f"a bench's figures are a dict (a JSON object), not {type(figures)}")
    print(json.dumps(figures), flush=True)
