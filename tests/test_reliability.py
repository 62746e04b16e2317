"""Reliability tier: faults injected from outside the training code, at moments it does not
choose, as they happen in real clusters — worker processes SIGKILLed mid-step and mid-checkpoint,
damaged checkpoint files, two runs racing on one storage root, a storage that fills up.

Each test prints a tally line (`reliability: ...`); `pytest -s tests/test_reliability.py`
shows them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support import (
    BIN,
    REPO,
    cli_in_fresh_interpreter,
    free_port,
    process_gone,
    stop_session,
    subprocess_env,
    train_worker_pids,
    wait_for_checkpoint,
)

import relay
from relay.checkpoints import checkpoint
from relay.config import from_dict
from relay.observe.doctor import heartbeat
from relay.records import history, registry
from relay.tasks import build_task

pytestmark = pytest.mark.slow


# --- SIGKILL random workers at random times -------------------------------------------------------

KILL_EPOCHS = 10


def kill_fields(storage: Path) -> dict:
    """digits with a wider MLP and small batches: an epoch takes ~0.5-1 s on this machine, so
    a random moment falls mid-step or mid-checkpoint (13 MB of weights and AdamW moments each
    epoch), not only between epochs. No dropout: its random masks are not part of a checkpoint,
    so a resumed run would draw other ones and could not be compared number for number."""
    return {
        "name": "kill",
        "task": "digits",
        "size": "default",
        "model": {"hidden": [1024, 1024], "dropout": 0.0},
        "epochs": KILL_EPOCHS,
        "batch_size": 16,
        "optim": {"lr": 0.001},
        "schedule": {"name": "cosine"},  # the lr depends on the step: a wrong resume shows
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "checkpoint": {"every": 1, "keep": 2},
        "failure": {"max_failures": 10},
        # A validation pass long enough (~40 batches) for a kill to be aimed into it.
        "data": {"val_fraction": 0.4},
        "storage": str(storage),
    }


def kill_config(storage: Path):
    return from_dict(kill_fields(storage))


@pytest.fixture(scope="module")
def uninterrupted_run(ray_cluster, tmp_path_factory):
    """A finished run of `kill_config`, never killed: the numbers a killed run must match, and
    the storage root whose copies the damaged-checkpoint test damages."""
    return relay.train(kill_config(tmp_path_factory.mktemp("uninterrupted")), out=None)


@dataclass
class Kill:
    pid: int
    delay_s: float  # after the new history line that allowed it
    lines: int  # history lines written when it struck
    epoch: int  # the highest epoch in history then
    registered: int | None  # the epoch of the latest checkpoint Ray Train had registered then
    phase: str  # what the run was doing, seen from outside (see `_phase`)
    aim: str = ""  # the moment the killer waited for (`AIMS`)
    at: float = 0.0  # time.time() of the kill
    landed: bool = False  # the process is gone


def _history_lines(storage: Path) -> tuple[Path | None, list[dict]]:
    dirs = list((storage / "runs").glob("*/history.jsonl"))
    return (dirs[0].parent, history.read_raw(dirs[0].parent)) if dirs else (None, [])


def _checkpoint_in_flight(run_dir: Path, since: float) -> bool:
    """Whether rank 0 is writing a checkpoint of the run in `run_dir`: after appending an epoch
    to history it writes the checkpoint to a temp dir (named after the run) that lives until
    Ray Train has copied it to storage. Older dirs are orphans of workers killed mid-write."""
    pattern = os.path.join(tempfile.gettempdir(), f"relay-ckpt-{run_dir.name}-*")
    return any(_ctime(path) >= since - 0.01 for path in glob.glob(pattern))


def _rank_progress(run_dir: Path, pid: int) -> dict:
    """The progress file of the rank in process `pid` (phase, epoch), {} if none says so."""
    records = heartbeat.read_all(run_dir)
    return next((r for r in records if r.get("pid") == pid), {})


def _phase(run_dir: Path, lines: list[dict], registered: int | None, pid: int) -> str:
    """Where the run was when a kill of `pid` struck, from what it leaves on disk: each rank
    writes its phase (a training pass, a validation pass, the report) to its progress file as
    it starts it; rank 0 then appends the epoch to history, writes its checkpoint to a staging
    dir (`_checkpoint_in_flight`) and reports it, and the controller registers it."""
    if _checkpoint_in_flight(run_dir, lines[-1]["time"]):
        return "checkpoint-write"
    phase = _rank_progress(run_dir, pid).get("phase")
    if phase == "train":
        return "training-step"
    if phase == "val":
        return "validation"
    if registered is None or registered < lines[-1]["epoch"]:
        return "checkpoint-unregistered"
    return f"between-epochs ({phase})"


def _ctime(path: str) -> float:
    try:
        return os.stat(path).st_ctime
    except OSError:
        return 0.0


# What the kills aim at, in turn (run 0 from the first, run 1 from the third): the moments where
# what a restart must redo differs. Run 0's first is epoch 1's checkpoint write, which may strike
# before Ray Train registered any checkpoint (the restarted group then starts from scratch); a
# later checkpoint write has an older checkpoint to go back to. Validation, the shortest, is
# aimed at twice too.
AIMS = (
    "checkpoint-write",
    "validation",
    "training-step",
    "anywhere",
    "checkpoint-write",
    "validation",
)
# The moments the test requires a kill to have struck. An aim can miss (the moment ended before
# the kill landed): the next kill then aims at the missed moment again (`WorkerKiller._aim`).
MUST_STRIKE = ("training-step", "checkpoint-write", "validation")


class WorkerKiller(threading.Thread):
    """SIGKILLs a live RayTrainWorker process `count` times, each after new progress (a history
    line for an epoch past the previous kill's), aiming in turn (`AIMS`, a missed moment of
    `MUST_STRIKE` again first) at a moment of a training pass, of a checkpoint write (as soon as
    its staging dir appears), of a validation pass (as soon as a rank's progress file says it
    started one), or anywhere in the next 1.2 epochs. Where each kill really struck is read from
    disk when it lands (`_phase`)."""

    def __init__(
        self, storage: Path, count: int, epoch_s: float, rng: random.Random, first_aim: int = 0
    ) -> None:
        super().__init__(daemon=True)
        self.storage, self.count, self.epoch_s, self.rng = storage, count, epoch_s, rng
        self.turn = first_aim  # the next aim of AIMS
        self.kills: list[Kill] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _await_moment(self, aim: str, run_dir: Path, lines: list[dict]) -> int | None:
        """Wait for a moment `aim` names (at most 2 epochs); the pid to kill then, or None
        for any rank."""
        deadline = time.monotonic() + 2 * self.epoch_s
        if aim == "anywhere":
            self.stop.wait(self.rng.uniform(0.0, 1.2 * self.epoch_s))
            return None
        if aim == "checkpoint-write":
            while not _checkpoint_in_flight(run_dir, lines[-1]["time"]):
                if time.monotonic() > deadline or self.stop.wait(0.002):
                    return None
            return None
        phase = "train" if aim == "training-step" else "val"
        after = lines[-1]["epoch"]
        while time.monotonic() < deadline and not self.stop.is_set():
            started = [
                r
                for r in heartbeat.read_all(run_dir)
                if r.get("phase") == phase and (r.get("epoch") or 0) > after
            ]
            if started:
                if aim == "training-step":  # somewhere in the pass, not only at its start
                    self.stop.wait(self.rng.uniform(0.0, 0.3 * self.epoch_s))
                return self.rng.choice(started)["pid"]
            time.sleep(0.002)
        return None

    def _aim(self) -> str:
        """The moment of MUST_STRIKE a kill aimed at and no kill struck yet, else AIMS's next."""
        struck = {k.phase for k in self.kills}
        aimed = {k.aim for k in self.kills}
        missed = [p for p in MUST_STRIKE if p in aimed and p not in struck]
        if missed:
            return missed[0]
        self.turn += 1
        return AIMS[(self.turn - 1) % len(AIMS)]

    def _run(self) -> None:
        past_epoch = 0
        aim = None
        while len(self.kills) < self.count and not self.stop.is_set():
            run_dir, lines = _history_lines(self.storage)
            if not lines or max(e["epoch"] for e in lines) <= past_epoch:
                time.sleep(0.02)
                continue
            aim = aim or self._aim()
            since = time.time()
            target = self._await_moment(aim, run_dir, lines)
            if self.stop.is_set():
                return
            delay = time.time() - since
            pids = train_worker_pids()
            if not pids:
                continue
            pid = target if target in pids else self.rng.choice(pids)
            _, lines = _history_lines(self.storage)
            latest = checkpoint.latest_registered(run_dir)
            registered = latest[1] if latest else None
            epoch = max(e["epoch"] for e in lines)
            if epoch >= KILL_EPOCHS:
                return  # the run is finishing: leave the last kills undone (the test says so)
            kill = Kill(pid, round(delay, 3), len(lines), epoch, registered, "", aim)
            kill.phase = _phase(run_dir, lines, registered, pid)
            try:
                kill.at = time.time()
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # ended on its own (the run finishing): not a kill
            kill.landed = process_gone(pid)
            self.kills.append(kill)
            past_epoch, aim = epoch, None


def _restarts(raw: list[dict], kills: list[Kill]) -> list[dict]:
    """For each kill: where the restarted group took up again and how many epochs it trained a
    second time. A restart shows in history as an epoch that does not follow the one before;
    a group resumed from the very checkpoint it had just written continues seamlessly (0)."""
    out = []
    for i, kill in enumerate(kills):
        end = kills[i + 1].lines if i + 1 < len(kills) else len(raw)
        resumed_at, retrained = None, 0
        for j in range(max(kill.lines, 1), end):
            if raw[j]["epoch"] != raw[j - 1]["epoch"] + 1:
                resumed_at, retrained = raw[j]["epoch"], raw[j - 1]["epoch"] - raw[j]["epoch"] + 1
                break
        recovered = next((e["time"] for e in raw[kill.lines : end] if e["time"] > kill.at), None)
        out.append(
            {
                "resumed_at": resumed_at,
                "retrained": retrained,
                "recovery_s": round(recovered - kill.at, 1) if recovered else None,
            }
        )
    return out


KILLS_PER_RUN = (5, 5)


@pytest.mark.timeout(540)
def test_sigkilled_workers_at_random_moments(uninterrupted_run, tmp_path):
    """10 SIGKILLs of a worker (rank 0 or 1) over 2 runs, aimed in turn mid-checkpoint write,
    mid-validation, mid-step and anywhere (`AIMS`; the second run from the third); where each
    struck is recorded, and each of the first three must have happened.

    Tolerance of every epoch's metrics against an uninterrupted run: rel 1e-5 (losses, lr) and
    exact accuracies. A resumed run is the same computation: weights and AdamW moments come
    back bit for bit (safetensors, torch.save), the lr is recomputed from the epoch, the shuffle
    is seeded per epoch and the data split is the same; what may differ is the order of float
    additions (gloo's all-reduce), a few ulps. A resume that lost optimizer state or an epoch,
    or repeated one, moves the losses by far more (percent)."""
    baseline = uninterrupted_run
    epoch_s = sorted(e["epoch_s"] for e in baseline.history)[len(baseline.history) // 2]

    rng = random.Random(20240608)
    started = time.time()
    tallies = []
    for number, count in enumerate(KILLS_PER_RUN):
        storage = tmp_path / f"killed-{number}"
        killer = WorkerKiller(storage, count, epoch_s, rng, first_aim=2 * number)
        killer.start()
        try:
            result = relay.train(kill_config(storage), out=None)
        finally:
            killer.stop.set()
            killer.join(timeout=30)
        assert killer.error is None, killer.error
        raw = history.read_raw(result.run_dir)
        _check_killed_run(result, raw, killer.kills, baseline)
        tallies.append((killer.kills, _restarts(raw, killer.kills), raw))

    kills = [k for ks, _, _ in tallies for k in ks]
    retrained = [r["retrained"] for _, rs, _ in tallies for r in rs]
    phases = Counter(k.phase for k in kills)
    recovery = [r["recovery_s"] for _, rs, _ in tallies for r in rs]
    print(
        f"\nreliability: worker SIGKILLs survived {sum(k.landed for k in kills)}/{len(kills)} "
        f"over {len(tallies)} runs of {KILL_EPOCHS} epochs (epoch ~{epoch_s:.2f} s); "
        f"epochs re-trained per kill {retrained} (max {max(retrained, default=0)}); "
        f"where they struck {dict(phases)}; kill to next epoch done (s) {recovery}; "
        f"killed runs took {time.time() - started:.0f} s"
    )
    for number, (ks, rs, raw) in enumerate(tallies):
        print(
            f"reliability: run {number}: history epochs {[e['epoch'] for e in raw]}; kills "
            + "; ".join(
                f"pid {k.pid} at epoch {k.epoch} (+{k.delay_s}s, aimed at {k.aim}, struck "
                f"{k.phase}, registered {k.registered}) -> resumed at "
                f"{r['resumed_at'] or 'the next epoch, seamless'}"
                for k, r in zip(ks, rs, strict=True)
            )
        )
    assert len(kills) == sum(KILLS_PER_RUN), [(k.aim, k.phase) for k in kills]
    # Among them a kill mid-step, one while a checkpoint was being written, one mid-validation.
    assert set(MUST_STRIKE) <= set(phases), phases


def _check_killed_run(result, raw: list[dict], kills: list[Kill], baseline) -> None:
    """What a run survived its kills with: every epoch trained, none more than twice, the
    replicas equal at the end, no work before the last registered checkpoint redone, the
    uninterrupted run's numbers epoch for epoch, no staging dir left behind."""
    assert [e["epoch"] for e in result.history] == list(range(1, KILL_EPOCHS + 1))
    counts = Counter(e["epoch"] for e in raw)
    assert max(counts.values()) <= 2, counts
    assert result.replicas_in_sync is True
    for kill in kills:
        assert kill.landed, kill
        # At most the work since the last registered checkpoint is redone: no epoch up to
        # that checkpoint's is trained again after the kill.
        later = [e["epoch"] for e in raw[kill.lines :]]
        assert not later or min(later) > (kill.registered or 0), (kill, later)
    # The loss curve continues from each checkpoint with its optimizer state (AdamW moments),
    # and the lr of the cosine schedule (recomputed from the epoch, not restored) is where it
    # would have been.
    for ours, theirs in zip(result.history, baseline.history, strict=True):
        for name in ("train_loss", "val_loss"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-5), (name, ours["epoch"])
        for name in ("train_accuracy", "val_accuracy"):
            assert ours[name] == theirs[name], (name, ours["epoch"])
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-9), ours["epoch"]
    # A rank 0 killed mid-write leaves its staging dir behind (SIGKILL runs no cleanup);
    # the worker group that replaces it removes them.
    staging = f"relay-ckpt-{Path(result.run_dir).name}-*"
    assert not glob.glob(os.path.join(tempfile.gettempdir(), staging))


# --- damaged checkpoints given to the CLI ---------------------------------------------------------


def small_config(storage: Path, **fields) -> dict:
    return {
        "name": "small",
        "task": "regression",
        "size": "debug",
        "epochs": 2,
        "batch_size": 32,
        "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        "checkpoint": {"every": 1, "keep": None},
        "storage": str(storage),
        **fields,
    }


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "truncated model.safetensors": (checkpoint.WEIGHTS, _truncate),
    "truncated train_state.pt": (checkpoint.TRAIN_STATE, _truncate),
    "missing meta.json": (checkpoint.META, Path.unlink),
}


def _relay(*args: str, storage: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "relay"), *args],
        cwd=REPO,
        env=subprocess_env(RELAY_HOME=str(storage), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            stop_session(proc)
    return proc.returncode, out, err


@pytest.mark.timeout(240)
def test_damaged_checkpoints_fail_in_one_line(uninterrupted_run, tmp_path):
    """Each damage x `relay serve`, `relay train --resume`, `relay runs show`: the exit code
    docs/training.md documents, one stderr line naming the damaged file, no traceback, and no Ray
    started (the checks run before any cluster work). One run (the kill test's uninterrupted
    one), a copy of its storage root per damage, and all 9 commands in one fresh interpreter."""
    run = uninterrupted_run
    storage = Path(run.run_dir).parents[1]
    record_before = registry.read(Path(run.run_dir))
    checkpoints = {
        Path(run.checkpoint),
        Path(run.last_checkpoint),
        checkpoint.latest_registered(run.run_dir)[0],
    }
    # Each command with the exit code docs/training.md documents for a damaged checkpoint.
    expected = {"serve": 2, "train --resume": 2, "runs show": 1}
    cases, copies = {}, {}
    for number, (case, (name, damage)) in enumerate(CORRUPTIONS.items()):
        copy = copies[case] = tmp_path / f"damaged-{number}"
        shutil.copytree(storage, copy)
        for directory in checkpoints:
            damage(copy / directory.relative_to(storage) / name)
        config_file = tmp_path / f"damaged-{number}.yaml"
        config_file.write_text(yaml.safe_dump(kill_fields(copy)))
        commands = {
            "serve": ["serve", run.run_id, "--port", str(free_port()), "--storage", str(copy)],
            "train --resume": ["train", str(config_file), "--resume", run.run_id],
            "runs show": ["runs", "show", run.run_id, "--storage", str(copy)],
        }
        cases |= {f"{case} | {what}": argv for what, argv in commands.items()}
    # A command that started a local Ray cluster would leave its session under RAY_TMPDIR.
    ray_tmp = tmp_path / "ray-tmp"
    results = cli_in_fresh_interpreter(cases, cwd=REPO, env=subprocess_env(RAY_TMPDIR=str(ray_tmp)))
    handled = []
    for key in cases:
        case, what = key.split(" | ")
        code, err = results[key]["code"], results[key]["stderr"]
        lines = err.strip().splitlines()
        assert code == expected[what], (case, what, err)
        assert "Traceback" not in err, (case, what, err)
        assert len(lines) == 1 and CORRUPTIONS[case][0] in lines[0], (case, what, err)
        handled.append((case, what, code, lines[0]))
    assert not results["ray_initialized"] and not ray_tmp.exists()
    for case, copy in copies.items():  # a refused resume leaves the run as it was
        assert registry.read(copy / "runs" / run.run_id) == record_before, case

    # Undamaged, the same commands find nothing wrong: the checks tell damage from health.
    code, out, err = _finish(_relay("runs", "show", run.run_id, storage=storage), timeout=60)
    assert code == 0 and run.run_id in out, err
    print(f"\nreliability: damaged-checkpoint cases handled {len(handled)}/{len(cases)}")
    for case, what, code, line in handled:
        print(f"reliability:   {case:<30} relay {what:<15} exit {code}: {line[:150]}")


# --- two runs at once on one storage root ---------------------------------------------------------


class RecordReader(threading.Thread):
    """Reads every run record and model version under `storage` over and over, counting the
    reads and any that is not a whole JSON object (a half-written file)."""

    def __init__(self, storage: Path) -> None:
        super().__init__(daemon=True)
        self.storage, self.stop = storage, threading.Event()
        self.reads, self.partial = 0, []

    def run(self) -> None:
        while not self.stop.is_set():
            for path in [
                *self.storage.glob("runs/*/run.json"),
                *self.storage.glob("models/*/*.json"),
            ]:
                try:
                    text = path.read_text()
                except FileNotFoundError:
                    continue
                self.reads += 1
                try:
                    assert isinstance(json.loads(text), dict)
                except (ValueError, AssertionError):
                    self.partial.append((str(path), text[:80]))
            time.sleep(0.002)  # leave the CPUs to the writers


@pytest.mark.timeout(300)
def test_two_runs_started_together_on_one_storage_root(tmp_path):
    storage = tmp_path / "storage"
    config_file = tmp_path / "small.yaml"
    config_file.write_text(yaml.safe_dump(small_config(storage, epochs=3)))
    reader = RecordReader(storage)
    reader.start()
    procs = [_relay("train", str(config_file), "--json", storage=storage) for _ in range(2)]
    try:
        finished = [_finish(proc, timeout=240) for proc in procs]
    finally:
        reader.stop.set()
        reader.join(timeout=10)
    for code, out, err in finished:
        assert code == 0, out[-2000:] + err[-2000:]
    results = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in finished]
    assert len({r["run_id"] for r in results}) == 2
    assert sorted(r["model"] for r in results) == ["regression:1", "regression:2"]
    versions = registry.list_versions(storage, "regression")
    assert {(v["version"], v["run_id"]) for v in versions} == {
        (int(r["model"].split(":")[1]), r["run_id"]) for r in results
    }
    code, listed, err = _finish(_relay("runs", storage=storage), timeout=60)
    assert code == 0, err
    for r in results:
        assert any(r["run_id"] in line and "finished" in line for line in listed.splitlines())
    assert reader.partial == [] and reader.reads > 0
    print(
        f"\nreliability: 2 simultaneous runs on one storage: both finished, versions "
        f"{sorted(r['model'] for r in results)}; {reader.reads} record reads meanwhile, "
        f"{len(reader.partial)} partial"
    )


_HAMMER = """
import sys
from pathlib import Path
from relay.records import registry
storage, writer = Path(sys.argv[1]), int(sys.argv[2])
run_dir = registry.runs_root(storage) / f"run-{writer}"
run_dir.mkdir(parents=True, exist_ok=True)
for seq in range(int(sys.argv[3])):
    registry.register_version(storage, "hammer", {"run_id": f"w{writer}-{seq}", "pad": "x" * 50000})
    registry.write(run_dir, {"run_id": f"run-{writer}", "seq": seq, "pad": "y" * 50000})
"""


@pytest.mark.timeout(120)
def test_registry_under_concurrent_writers_and_readers(tmp_path):
    """4 processes register 25 versions each of one model and rewrite their run records while
    this process reads every file: 100 distinct versions 1..100, each record whole, and no
    read ever sees part of a file (records of 50 kB take several writes to fill)."""
    writers, each = 4, 25
    reader = RecordReader(tmp_path)
    reader.start()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HAMMER, str(tmp_path), str(w), str(each)],
            env=subprocess_env(),
        )
        for w in range(writers)
    ]
    try:
        codes = [proc.wait(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.stop.set()
        reader.join(timeout=10)
    assert codes == [0] * writers
    versions = registry.list_versions(tmp_path, "hammer")
    assert [v["version"] for v in versions] == list(range(1, writers * each + 1))
    assert sorted(v["run_id"] for v in versions) == sorted(
        f"w{w}-{s}" for w in range(writers) for s in range(each)
    )
    assert [r["seq"] for r in registry.list_runs(tmp_path)] == [each - 1] * writers
    assert reader.partial == [], reader.partial[:3]
    assert not list(tmp_path.rglob("*.tmp")), "temp files left behind"
    print(
        f"\nreliability: registry hammer: {writers} writers x {each} versions, "
        f"{reader.reads} concurrent reads, {len(reader.partial)} partial"
    )


# --- storage full, storage read-only -------------------------------------------------------------


@contextlib.contextmanager
def small_file_system(path: Path, size_bytes: int):
    """A tmpfs of `size_bytes` at `path` (needs root, as in CI's container); skips otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def _checkpoint_bytes(cfg) -> int:
    """Bytes one checkpoint of `cfg` takes: fp32 weights and two AdamW moments, plus room for
    headers, meta.json and the file system's pages."""
    model = build_task(cfg.task, cfg.size, cfg.model).build_model()
    return 3 * 4 * sum(p.numel() for p in model.parameters()) + 64 * 1024


@pytest.mark.timeout(240)
def test_storage_fills_up_mid_run_then_turns_read_only(tmp_path):
    """A storage root with room for about 3 checkpoints, all kept: the run fails cleanly when
    the 4th does not fit — a short error, the run recorded as failed (its record's reserved
    space makes room for that), the checkpoints written before still whole and loadable. The
    same storage read-only: refused before any cluster work."""
    mount = tmp_path / "small-disk"
    fields = {
        "task": "digits",
        "size": "default",
        "model": {"hidden": [256, 256], "dropout": 0.0},
        "epochs": 10,
        "failure": {"max_failures": 0},
    }
    each = _checkpoint_bytes(from_dict(small_config(mount, **fields)))
    config_file = tmp_path / "full.yaml"
    config_file.write_text(yaml.safe_dump(small_config(mount / "relay", **fields)))
    with small_file_system(mount, 3 * each + each // 2 + registry.RESERVE_BYTES):
        code, out, err = _finish(_relay("train", str(config_file), storage=mount), timeout=200)
        assert code == 1, out[-2000:] + err[-2000:]
        assert "No space left on device" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        (run_dir,) = (mount / "relay" / "runs").iterdir()
        record = registry.read(run_dir)
        assert record["status"] == "failed", record
        assert "No space left on device" in record["error"]
        # The checkpoints Ray Train registered before the disk filled are whole and load.
        snapshot = json.loads((run_dir / checkpoint.RAY_SNAPSHOT).read_text())
        registered = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
        assert len(registered) >= 2, registered
        task = build_task("digits", "default", fields["model"])
        for name in registered:
            checkpoint.validate(run_dir / name)
            checkpoint.load_weights(run_dir / name, task.build_model())
            assert checkpoint.load_train_state(run_dir / name).optimizer["state"]
        epochs_done = [e["epoch"] for e in history.read(run_dir)]

        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        code, _, ro_err = _finish(_relay("train", str(config_file), storage=mount), timeout=60)
        assert code == 1 and "not writable" in ro_err and "Read-only" in ro_err, ro_err
        assert len(ro_err.strip().splitlines()) == 1, ro_err
    print(
        f"\nreliability: storage full after epoch {max(epochs_done)} (checkpoints "
        f"{registered} intact), recorded as failed; stderr: {err.strip()[:300]}"
        f"\nreliability: read-only storage refused: {ro_err.strip()}"
    )


@pytest.mark.timeout(240)
def test_storage_turning_read_only_mid_run_is_reported(tmp_path):
    """The storage root turns read-only after epoch 2's checkpoint, as docs/training.md says: the
    run fails, stderr says why and that its record could not say so, no traceback; the record
    still reads "running"; the checkpoints registered before are whole and load."""
    mount = tmp_path / "turns-read-only"
    fields = {"task": "digits", "epochs": 60, "failure": {"max_failures": 0}}
    config_file = tmp_path / "ro.yaml"
    config_file.write_text(yaml.safe_dump(small_config(mount / "relay", **fields)))
    with small_file_system(mount, 256 * 1024 * 1024):
        proc = _relay("train", str(config_file), storage=mount)
        try:
            run_dir = wait_for_checkpoint(mount / "relay", "small", 2)
        except AssertionError:
            _finish(proc, timeout=5)
            raise
        # Linux refuses to remount a file system read-only while files on it are open for
        # writing (the run's are), so a read-only view of it goes on top: every path opened
        # from now on is read-only, as on a storage server that turned read-only.
        subprocess.run(["mount", "--bind", "-o", "ro", str(mount), str(mount)], check=True)
        try:
            code, out, err = _finish(proc, timeout=180)
        finally:
            subprocess.run(["umount", str(mount)], check=True)  # the view; the tmpfs stays
        epochs_done = [e["epoch"] for e in history.read(run_dir)]
        assert code == 1, out[-2000:] + err[-2000:]
        # Two lines: why training failed, and that its record could not say so.
        recorded, failed = err.strip().splitlines()
        assert "Traceback" not in err, err
        assert recorded.startswith("relay: run ") and "could not record it" in recorded, err
        assert failed.startswith("relay: training failed: "), err
        assert "Read-only file system" in recorded and "Read-only file system" in failed, err
        assert max(epochs_done) < fields["epochs"], epochs_done  # it stopped mid-run
        assert registry.read(run_dir)["status"] == "running"
        snapshot = json.loads((run_dir / checkpoint.RAY_SNAPSHOT).read_text())
        registered = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
        task = build_task("digits", "debug")
        for name in registered:
            checkpoint.validate(run_dir / name)
            checkpoint.load_weights(run_dir / name, task.build_model())
    print(
        f"\nreliability: storage read-only after epoch {max(epochs_done)} (checkpoints "
        f"{registered} intact); stderr: {err.strip()[:300]}"
    )
