"""A tracker that fails, told once: the failure is marked in the run's directory (a small JSON
file per tracker), and the run's driver prints it.

Trackers fail in two processes — the controller, which logs each epoch, and the driver, which
opens and closes the run — and the controller's output does not reach the console unless
`--verbose`. So neither prints: both mark, the driver announces each mark once (while it
follows the run's epochs, and at the end), and a marked tracker is not called again in that
run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_PREFIX = "tracking_failed."


def _path(directory: Path, tracker: str) -> Path:
    return Path(directory) / f"{_PREFIX}{tracker}.json"


def mark(directory: Path, tracker: str, message: str) -> None:
    """Record that `tracker` failed for the run in `directory`; the first mark stays. Where
    no mark can be written (the directory itself is the trouble), the message is printed
    here and now instead."""
    try:
        with open(_path(directory, tracker), "x") as f:
            json.dump({"message": message, "time": time.time()}, f)
    except FileExistsError:
        pass
    except OSError:
        print(message, file=sys.stderr, flush=True)


def failed(directory: Path, tracker: str) -> bool:
    return _path(directory, tracker).exists()


def clear(directory: Path, tracker: str) -> None:
    """A new attempt at the run (e.g. `--resume`) tries the tracker again."""
    _path(directory, tracker).unlink(missing_ok=True)


class Announcer:
    """Prints each tracker failure marked in `directory` once, on stderr."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._told: set[str] = set()

    def __call__(self) -> None:
        for path in sorted(self.directory.glob(f"{_PREFIX}*.json")):
            if path.name in self._told:
                continue
            try:
                message = json.loads(path.read_text())["message"]
            except (OSError, ValueError, KeyError):
                continue  # being written: told on the next call
            self._told.add(path.name)
            print(message, file=sys.stderr, flush=True)
