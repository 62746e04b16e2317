"""The mailbox a TorchTrainer trial's run reports through (relay/tuning/pbt.py): from its Train
controller to the trial's driver thread, one report at a time.

A module of its own, importing only Ray: Ray ships an actor class by reference, so the process
each mailbox starts in imports the class's module, and pbt.py's imports (torch, Ray Train and
Tune, the train driver) cost that process ~4 CPU-seconds, at every start of such a run."""

from __future__ import annotations

import asyncio
from typing import Any

import ray


@ray.remote(num_cpus=0)
class Mailbox:
    """Carries a Train run's reports from its controller to the trial driver, one at a time;
    a report at an interval epoch holds the controller until the driver says go on."""

    def __init__(self) -> None:
        self._items: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._go: asyncio.Queue = asyncio.Queue()

    async def put(self, item: Any, hold: bool) -> None:
        await self._items.put(item)
        if hold:
            await self._go.get()

    async def get(self) -> Any:
        return await self._items.get()

    async def go_on(self) -> None:
        self._go.put_nowait(True)
