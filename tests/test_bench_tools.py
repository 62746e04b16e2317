"""`make bench` (bench/run_all.py) checks the programs its benches need before it runs any, and
says what to install: a newcomer's run fails at once, not an hour in at the serving bench."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import REPO

pytestmark = pytest.mark.timeout(60)


def run_all(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/run_all.py", *args],
        cwd=REPO, env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_a_missing_tool_is_named_with_its_package_before_any_bench_runs(tmp_path):
    results = (REPO / "bench" / "results.jsonl").read_bytes()
    done = run_all(str(tmp_path), "--only", "serve_load", "serve_multiplex")  # no wrk there
    assert done.returncode == 2, done.stderr
    assert "serve_load, serve_multiplex: needs `wrk` (apt-get install wrk" in done.stderr
    assert (REPO / "bench" / "results.jsonl").read_bytes() == results  # nothing ran


def test_a_tool_on_the_path_passes_the_check(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import run_all
    finally:
        sys.path.remove(str(REPO / "bench"))
    fake = tmp_path / "wrk"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    saved = os.environ["PATH"]
    os.environ["PATH"] = f"{tmp_path}{os.pathsep}{saved}"
    try:
        assert run_all.missing_tools(["serve_load", "train_overhead"]) == {}
    finally:
        os.environ["PATH"] = saved
