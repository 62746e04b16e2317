"""The README and docs/ quote only measured figures: their figures blocks are what
bench/readme.py renders from bench/results.jsonl (written by `make bench`), each block lives in
one page, and no measured number is typed outside them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from support import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = REPO / "bench" / "results.jsonl"
BLOCK = re.compile(r"<!-- figures:([\w-]+) -->\n.*?<!-- /figures:\1 -->", re.S)

# A number followed by a unit of something measured: speed, latency, FLOP/s, a speedup.
MEASURED = re.compile(
    r"\d[\d,.]*\s*(?:req(?:uests)?/s|samples/s|tokens/s|[kMGT]?FLOP/s|ms\b)"
    r"|\d\.\d+\s*[×x]\b"
    r"|~\s?\d[\d.]*\s?s\b"
)


def page_texts() -> dict[str, str]:
    return {str(page.relative_to(REPO)): page.read_text() for page in PAGES}


def results() -> list[dict]:
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def test_readme_figures_are_the_results_file():
    proc = subprocess.run(
        [sys.executable, "bench/readme.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, "the docs disagree with bench/results.jsonl:\n" + proc.stdout


def test_every_bench_has_a_result_and_a_place_in_the_docs():
    names = {entry["bench"] for entry in results()}
    listed = subprocess.run(
        [sys.executable, "bench/run_all.py", "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()  # "name  command..."
    benches = {line.split()[0] for line in listed if line.strip()}
    assert benches <= names, f"benches never run into the results file: {benches - names}"
    found = [name for text in page_texts().values() for name in BLOCK.findall(text)]
    assert {"benchmarks", "sample_train", "sample_report", "sample_plan"} <= set(found)
    assert len(found) == len(set(found)), f"a figures block in two places: {sorted(found)}"


def test_results_come_from_this_history_on_a_clean_tree():
    for entry in results():
        assert entry["dirty"] is False, f"{entry['bench']} ran on uncommitted code"
        assert entry["machine"]["cores"] and entry["machine"]["cpu_model"]
        ancestor = subprocess.run(
            ["git", "merge-base", "--is-ancestor", entry["commit"], "HEAD"],
            cwd=REPO,
            capture_output=True,
            timeout=60,
        )
        if ancestor.returncode == 128:  # not a git checkout, or a shallow one: cannot tell
            # CI runs in a full clone, so there it can always tell: never pass unchecked.
            assert os.environ.get("CI") != "true", f"cannot check {entry['commit']}: {ancestor}"
            continue
        assert ancestor.returncode == 0, (
            f"{entry['bench']}: {entry['commit']} is not in HEAD's past"
        )


def test_no_measured_figure_outside_the_generated_blocks():
    typed = {
        name: [m.group(0) for m in MEASURED.finditer(BLOCK.sub("", text))]
        for name, text in page_texts().items()
    }
    typed = {name: figures for name, figures in typed.items() if figures}
    assert not typed, f"figures typed by hand: {typed}"
