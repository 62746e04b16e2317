"""bench/results.jsonl, the one file the docs' figures come from: a JSON object per line, one
line per (bench, machine). bench/run_all.py writes it, bench/readme.py renders from it.

A bench's figures hold only for the CPU they were measured on (relay's throughput against
torchrun's has differed by a fifth between two 2-core machines), so a run on a new machine
adds that machine's lines beside the others instead of replacing them; a rerun on the same
machine replaces its own. A machine is named by its CPU model and core count, the two things
`make bench` records that decide what a figure means. Standard library only, like the rest of
bench/'s plumbing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PATH = Path(__file__).resolve().parent / "results.jsonl"

Entry = dict[str, Any]
Key = tuple[str, str]  # (bench, machine)


def machine_name(machine: dict[str, Any]) -> str:
    """How pages and keys name a machine: "AMD EPYC, 2 cores"."""
    return f"{machine['cpu_model']}, {machine['cores']} cores"


def key(entry: Entry) -> Key:
    return entry["bench"], machine_name(entry["machine"])


def read(path: Path = PATH) -> dict[Key, Entry]:
    """Every line, keyed by (bench, machine); an absent file is no results yet."""
    if not path.exists():
        return {}
    entries = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {key(entry): entry for entry in entries}


def write(entries: dict[Key, Entry], bench_order: list[str], path: Path = PATH) -> None:
    """All lines, in the order of `bench_order` (then by machine), replacing the file whole
    (through a temporary file, so an interrupted write leaves the old one). A bench that is
    no longer in `bench_order` keeps its lines, after the others."""
    rank = {name: i for i, name in enumerate(bench_order)}
    ordered = sorted(entries, key=lambda k: (rank.get(k[0], len(rank)), k[0], k[1]))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(entries[k], sort_keys=True) + "\n" for k in ordered))
    tmp.replace(path)


def by_bench(entries: dict[Key, Entry]) -> dict[str, list[Entry]]:
    """Each bench's lines, newest run first (what a page that shows one run shows)."""
    benches: dict[str, list[Entry]] = {}
    for entry in sorted(entries.values(), key=lambda e: e["date"], reverse=True):
        benches.setdefault(entry["bench"], []).append(entry)
    return benches
