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


def test_a_tool_on_the_path_passes_the_check(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import run_all

    fake = tmp_path / "wrk"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert run_all.missing_tools(["serve_load", "train_overhead"]) == {}
