""".venv/bin/python bench/run_all.py [--only NAME ...] [--list]      (what `make bench` runs)

Runs every benchmark of this folder, one after another, each in its own process (so one bench's
Ray cluster is gone before the next starts), and records what each printed as its last line (one
JSON object) in bench/results.jsonl: one line per bench and machine, with the command that
produced it, the commit and date, and the machine (cores, CPU model, memory). A run on another
machine adds its lines beside the first machine's (bench/results_file.py). Then it regenerates
the figures of README.md and docs/ from that file (bench/readme.py), so they quote only measured
numbers.

`--only NAME` reruns some benches and keeps the other lines of the file as they are (each line
carries its own commit, date and machine). A bench that fails leaves its old line in place and
makes the exit status non-zero. Run it on a quiet machine: the benches share its cores with
everything else.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import results_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PYTHON = sys.executable

# name → argv after the interpreter. Each bench's docstring says what it measures.
BENCHES: dict[str, list[str]] = {
    "train_overhead": ["bench/train_overhead.py"],
    "scaling": ["bench/scaling.py"],
    "scaling_hosts": ["bench/scaling.py", "--hosts"],  # root: network namespaces
    "strategies": ["bench/strategies.py"],
    "memory_wall": ["bench/memory_wall.py"],
    "checkpoint_upload": ["bench/checkpoint_upload.py"],
    # Three searches (seeds) run by both arms: one seed's draw decides whether ASHA stops the
    # best config, so its gap alone says little.
    "asha_vs_random": ["bench/asha_vs_random.py", "--seeds", "0,1,2", "--repeats", "1"],
    # The same comparison on a larger sweep: what early stopping saves grows with the trials per
    # slot and the epochs per trial (rungs at 1, 3 and 9 epochs with reduction factor 3).
    "asha_vs_random_9x9": [
        "bench/asha_vs_random.py",
        *("--samples", "9", "--epochs", "9", "--seeds", "0,1,2", "--repeats", "1"),
    ],
    # ASHA by promotions (asha.strategy promote) where epochs are long next to a start-up: the
    # charlm corpus at 160 kB, an epoch 7-15 s against a trial's ~8 s start-up (at 40 kB,
    # above, no config has left the plateau after one epoch: rank_of_best).
    "asha_vs_random_promote": [
        "bench/asha_vs_random.py",
        *("--samples", "9", "--epochs", "9", "--model", '{"corpus_bytes": 160000}'),
        *("--strategy", "promote", "--seeds", "0,1,2", "--repeats", "1"),
    ],
    # The same sweeps under Ray's stopping rule (the default strategy): stop vs promote on one
    # workload, each against its own no-stopping sweeps of the same configs.
    "asha_vs_random_stop_160k": [
        "bench/asha_vs_random.py",
        *("--samples", "9", "--epochs", "9", "--model", '{"corpus_bytes": 160000}'),
        *("--strategy", "stop", "--seeds", "0,1,2", "--repeats", "1"),
    ],
    "startup": ["bench/startup.py"],
    # 100 one-epoch trials: relay's sweep (in-actor trials) against Optuna alone in one process.
    "many_trials": ["bench/many_trials.py"],
    "search_algorithms": ["bench/search_algorithms.py"],
    # TPE needs results to learn from: 16 short trials (4 random start-up, 12 chosen by TPE)
    # on the same budget of 32 epochs, random vs TPE only (PBT's population must fit at once).
    "search_algorithms_many_trials": [
        "bench/search_algorithms.py",
        *("--samples", "16", "--epochs", "2", "--arms", "random,tpe"),
    ],
    "overlap": ["bench/overlap.py"],
    "serve_load": ["bench/serve_load.py"],
    "serve_multiplex": ["bench/serve_multiplex.py"],
    "ingest": ["bench/ingest.py"],
    # Sample outputs the docs show: real runs of the commands they document.
    "sample_train": ["relay", "train", "jobs/configs/digits.yaml"],
    "sample_report": [
        "relay",
        "train",
        "jobs/configs/charlm.yaml",
        "--set",
        "size=debug",
        "--set",
        "parallel.strategy=fsdp",
        "--set",
        "parallel.mixed_precision=bf16",
    ],
    "sample_plan": [
        "relay",
        "plan",
        "jobs/configs/charlm.yaml",
        "--workers",
        "2",
        "--device-memory",
        "80GiB",
    ],
}
# Benches whose result is their console output rather than a JSON line.
TEXT_OUTPUT = {"sample_train", "sample_report", "sample_plan"}


def machine() -> dict[str, object]:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages / 2**30, 1)
    except (ValueError, OSError):
        memory_gib = None
    return {"cores": os.cpu_count(), "cpu_model": model, "memory_gib": memory_gib}


def commit() -> dict[str, object]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        # The files this script writes do not make a benchmarked tree dirty.
        outputs = (":!bench/results.jsonl", ":!README.md", ":!docs")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs))
        return {"commit": git("rev-parse", "HEAD"), "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def command_text(argv: list[str]) -> str:
    """The command as a shell line one can paste (a JSON argument quoted)."""
    if argv[0] == "relay":
        return shlex.join(argv)
    return ".venv/bin/python " + shlex.join(argv)


def executable(argv: list[str]) -> list[str]:
    """`relay ...` runs the venv's console script; a bench file runs under this interpreter."""
    if argv[0] == "relay":
        return [str(Path(PYTHON).parent / "relay"), *argv[1:]]
    return [PYTHON, *argv]


def run_one(name: str, argv: list[str], log: Path) -> dict[str, object]:
    """Run one bench, echoing its output; return its results line."""
    print(f"== {name}: {command_text(argv)}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RELAY_HOME")}
    started = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            executable(argv),
            cwd=REPO,
            env={**env, "RELAY_HOME": str(log.parent / f"{name}-home")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
            lines.append(line.rstrip("\n"))
        proc.wait()
    wall_s = round(time.perf_counter() - started, 1)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode} (log: {log})")
    entry: dict[str, object] = {
        "bench": name,
        "command": command_text(argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **commit(),
        "machine": machine(),
        "wall_s": wall_s,
    }
    if name in TEXT_OUTPUT:
        entry["output"] = "\n".join(lines)
    else:
        figures = results_line(lines)
        if figures is None:
            raise RuntimeError(f"{name} printed no JSON line (log: {log})")
        entry["figures"] = figures
    return entry


def results_line(lines: list[str]) -> dict | None:
    """A bench's figures: the last of its output lines that starts with "{", parsed as JSON
    (what bench/harness.py's print_results writes); None when no line starts so."""
    last = next((x for x in reversed(lines) if x.startswith("{")), None)
    return None if last is None else json.loads(last)


# The programs a bench needs besides the venv, and where to get each (Debian's package).
TOOLS = {"serve_load": ["wrk"], "serve_multiplex": ["wrk"], "scaling_hosts": ["ip"]}
PACKAGES = {"wrk": "wrk", "ip": "iproute2"}


def missing_tools(names: list[str]) -> dict[str, list[str]]:
    """Each program the benches `names` need that is not on PATH, with the benches needing it."""
    missing: dict[str, list[str]] = {}
    for name in names:
        for tool in TOOLS.get(name, []):
            if shutil.which(tool) is None:
                missing.setdefault(tool, []).append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="benches to run")
    parser.add_argument("--list", action="store_true", help="list the benches and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, bench_argv in BENCHES.items():
            print(f"{name:16} {command_text(bench_argv)}")
        return 0
    names = args.only or list(BENCHES)
    # Before anything runs: a bench that finds its tool missing an hour in fails there.
    if missing := missing_tools(names):
        for tool, benches in missing.items():
            print(
                f"bench: {', '.join(benches)}: needs `{tool}` (apt-get install {PACKAGES[tool]}; "
                "`make bench` installs it where it can), or leave them out with --only",
                file=sys.stderr,
            )
        return 2
    results = results_file.read()
    failed = []
    logs = Path(os.environ.get("RELAY_BENCH_LOGS", "/tmp/relay-bench-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            entry = run_one(name, BENCHES[name], logs / f"{name}.log")
        except RuntimeError as exc:
            print(f"bench {name} failed: {exc}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        # This machine's line replaces this machine's only; after each bench, so that an
        # interrupted run keeps what it measured.
        results[results_file.key(entry)] = entry
        results_file.write(results, list(BENCHES))
    subprocess.run([PYTHON, str(HERE / "readme.py"), "--write"], cwd=REPO, check=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
