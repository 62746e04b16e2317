"""Each worker's output kept with its run (`relay runs logs`), without a cluster: what the
block prints goes to the worker's own streams and to its rank's log, an exception's
traceback too, and `show` prints every rank's lines (following a log as it grows). Logs of
real Train workers are read back in test_cli.py."""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest

from relay.observe import worker_logs

pytestmark = pytest.mark.timeout(60)


def test_a_workers_output_and_traceback_are_kept_per_rank(tmp_path, capsys):
    with worker_logs.captured(tmp_path, 1, 2):
        print("step 1 done")
        print("a user warning", file=sys.stderr)  # what `warnings` writes goes there too
    with pytest.raises(RuntimeError), worker_logs.captured(tmp_path, 1, 2):  # a restart
        raise RuntimeError("out of batches")
    assert "step 1 done" in capsys.readouterr().out  # the worker's own stdout still has it
    log = worker_logs.log_path(tmp_path, 1).read_text().splitlines()
    assert log[0].startswith("--- relay: rank 1 of 2 on ")
    assert "step 1 done" in log and "a user warning" in log
    assert sum(x.startswith("--- relay: rank 1 of 2") for x in log) == 2
    assert log[-1] == "RuntimeError: out of batches"
    assert worker_logs.ranks(tmp_path) == [1]
    assert sys.stdout is not None and not isinstance(sys.stdout, worker_logs._Tee)


def test_show_prefixes_ranks_and_follows_until_the_run_ends(tmp_path):
    for rank in (0, 1):
        with worker_logs.captured(tmp_path, rank, 2):
            print(f"hello from {rank}")
    shown = io.StringIO()
    worker_logs.show(tmp_path, shown)
    lines = shown.getvalue().splitlines()
    assert [x for x in lines if "hello" in x] == ["[rank 0] hello from 0", "[rank 1] hello from 1"]

    # Following: lines appended while the run "runs" are printed; it stops once it ends.
    running = threading.Event()
    running.set()

    def write_more() -> None:
        with open(worker_logs.log_path(tmp_path, 0), "a") as f:
            for n in range(3):
                f.write(f"epoch {n}\n")
                f.flush()
                time.sleep(0.2)
            f.write("no newline yet")
        running.clear()

    followed = io.StringIO()
    writer = threading.Thread(target=write_more)
    writer.start()
    worker_logs.show(tmp_path, followed, rank=0, follow=running.is_set, poll_s=0.05)
    writer.join()
    lines = followed.getvalue().splitlines()
    assert lines[-4:] == ["epoch 0", "epoch 1", "epoch 2", "no newline yet"]
