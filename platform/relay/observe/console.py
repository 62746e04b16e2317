"""What a person sees: one line per epoch while a run trains, then where the model is."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from relay.records import history
from relay.runtime import background

_SKIP = {"epoch", "step", "samples_per_s", "input_wait_share", "epoch_s", "lr", "time"}


def human_bytes(n: float) -> str:
    """Bytes as '812 B', '12.3 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 or abs(value) >= 1e5 else f"{value:.4f}"
    return str(value)


def epoch_line(metrics: dict[str, Any], epochs: int, max_steps: int | None = None) -> str:
    """An epoch's line; a run whose length is `max_steps` counts its steps instead of epochs."""
    if max_steps is None:
        parts = [f"epoch {metrics['epoch']:>{len(str(epochs))}}/{epochs}"]
    else:
        steps = metrics.get("step", "?")
        parts = [f"epoch {metrics['epoch']}", f"step {steps:>{len(str(max_steps))}}/{max_steps}"]
    parts += [f"{k} {_number(v)}" for k, v in metrics.items() if k not in _SKIP]
    parts.append(f"{metrics.get('samples_per_s', 0):,.0f} samples/s")
    if "input_wait_share" in metrics:  # histories written before it was measured lack it
        parts.append(f"input wait {metrics['input_wait_share']:.0%}")
    parts.append(f"{metrics.get('epoch_s', 0):.2f}s")
    return "  ".join(parts)


def step_line(metrics: dict[str, Any], max_steps: int | None = None) -> str:
    """A step report's line: the epoch in progress, the step, its metrics, its throughput."""
    budget = f"/{max_steps}" if max_steps else ""
    parts = [f"  epoch {metrics['epoch']} step {metrics['step']}{budget}"]
    parts += [f"{k} {_number(v)}" for k, v in metrics.items() if k not in _SKIP]
    parts.append(f"{metrics.get('samples_per_s', 0):,.0f} samples/s")
    return "  ".join(parts)


@contextmanager
def follow(
    run_dir: Path,
    epochs: int,
    out: TextIO | None = sys.stdout,
    also: Callable[[], None] | None = None,
    max_steps: int | None = None,
) -> Iterator[None]:
    """Print each epoch of `run_dir`'s history as rank 0 appends it, until the block ends;
    `also` is called beside (e.g. to tell what a tracker could not write)."""
    if out is None:
        yield
        return
    new_epochs = history.Follower(run_dir, history.FILE)
    new_steps = history.Follower(run_dir, history.STEPS)  # report.every_steps

    def flush() -> None:
        if also is not None:
            also()
        lines = [(r["time"], epoch_line(r, epochs, max_steps)) for r in new_epochs.new()]
        lines += [(r["time"], step_line(r, max_steps)) for r in new_steps.new()]
        for _, line in sorted(lines):
            out.write(line + "\n")
        out.flush()

    with background.every(0.2, flush, "relay-progress"):
        yield
