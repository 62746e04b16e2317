"""Driver-side chores that repeat while something else blocks (a fit, a sweep)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def every(interval_s: float, chore: Callable[[], None], name: str) -> Iterator[None]:
    """Run `chore` every `interval_s` seconds in a daemon thread until the block ends, then
    once more, so whatever happened last is handled too."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            chore()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        chore()
