"""Batching that adapts to the load: no wait for a request alone, batches as big as the load.

Ray Serve's `@serve.batch` waits `batch_wait_timeout_s` after every batch's first instance for
the batch to fill, so a request alone in the replica always pays the whole wait, and so does
every batch when fewer callers overlap than `max_batch_size`. Here one forward runs at a time
and, when the model frees, the next forward takes the queued instances (up to
`max_batch_size`). How long it first waits for more follows the last forward:

- after a forward of one instance (nobody else was there) it goes at once: a lone caller is
  never held back for company;
- after a forward of n > 1 (n callers overlap; in a closed loop they send again as soon as
  they are answered) it waits, at most `wait_s`, until n instances are queued: as many callers
  as last time, without waiting out the clock for a batch that cannot fill. More queued than
  that go along too (up to the maximum), so the batch grows with the load; fewer after `wait_s`
  shrink the next wait's goal. Many small forwards would cost more than the wait: each is a
  thread hop and a call into torch (bench/serve_load.py measures both batchers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class AdaptiveBatcher:
    def __init__(
        self,
        forward: Callable[[list[Any]], Awaitable[list[Any]]],
        max_batch_size: int,
        wait_s: float,
    ) -> None:
        self.forward, self.max_batch_size, self.wait_s = forward, max_batch_size, wait_s
        self.queue: list[tuple[Any, asyncio.Future]] = []
        self.arrived = asyncio.Event()
        self.last_batch_size = 0
        self.worker: asyncio.Task | None = None

    async def submit(self, instances: list[Any]) -> list[Any]:
        """Queue a request's instances; their results, in order."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in instances]
        self.queue += zip(instances, futures, strict=True)
        self.arrived.set()
        if self.worker is None or self.worker.done():
            self.worker = loop.create_task(self._run())
        return list(await asyncio.gather(*futures))

    async def _fill(self, goal: int) -> None:
        """Wait up to `wait_s` for the queue to hold `goal` instances."""
        deadline = time.monotonic() + self.wait_s
        while len(self.queue) < goal:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except TimeoutError:
                return

    async def _run(self) -> None:
        while self.queue:
            if self.last_batch_size > 1 and self.wait_s > 0:
                await self._fill(min(self.last_batch_size, self.max_batch_size))
            batch = self.queue[: self.max_batch_size]
            del self.queue[: self.max_batch_size]
            live = [(item, future) for item, future in batch if not future.done()]
            if not live:  # every caller went away
                continue
            self.last_batch_size = len(live)
            try:
                results = await self.forward([item for item, _ in live])
            except Exception as exc:  # the whole batch fails alike; the next one runs
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(live, results, strict=True):
                if not future.done():
                    future.set_result(result)
