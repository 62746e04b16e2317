"""relay's adaptive batcher on a real asyncio loop: what each forward receives, in what order.

A forward here is an async function that records its batch and waits on an event the test
controls, so "while the model works" is a state the test sets, not a race against the clock.
"""

from __future__ import annotations

import asyncio

import pytest

from relay.serving.batching import AdaptiveBatcher

pytestmark = pytest.mark.timeout(30)


class Model:
    """Records each batch; each forward finishes only when the test releases it."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def forward(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.started.set()
        await self.release.wait()
        if any(item < 0 for item in items):
            raise ValueError("negative input")
        return [item * 10 for item in items]


async def settle() -> None:
    for _ in range(5):  # let every ready task run
        await asyncio.sleep(0)


# Waits no test may sit out: a batcher that waited when it should not would run past the
# test's timeout instead of passing.
NEVER = 600.0


def test_a_lone_request_runs_at_once_and_later_ones_share_the_next_forward():
    async def scenario():
        model = Model()
        batcher = AdaptiveBatcher(model.forward, max_batch_size=32, wait_s=NEVER)
        first = asyncio.create_task(batcher.submit([1]))
        await model.started.wait()
        assert model.batches == [[1]]  # nothing else queued: not held back for company
        # While the model works, eleven requests arrive (one carries two instances).
        rest = [asyncio.create_task(batcher.submit([i])) for i in range(2, 12)]
        rest.append(asyncio.create_task(batcher.submit([12, 13])))
        await settle()
        assert model.batches == [[1]]  # one forward at a time
        model.release.set()
        results = await asyncio.gather(first, *rest)
        assert model.batches == [[1], list(range(2, 14))]
        assert results == [[10], *[[i * 10] for i in range(2, 12)], [120, 130]]

    asyncio.run(scenario())


def test_batches_never_exceed_the_maximum_and_keep_arrival_order():
    async def scenario():
        model = Model()
        model.release.set()
        batcher = AdaptiveBatcher(model.forward, max_batch_size=4, wait_s=0.01)
        results = await asyncio.gather(*(batcher.submit([i]) for i in range(10)))
        assert [r for (r,) in results] == [i * 10 for i in range(10)]
        assert all(len(batch) <= 4 for batch in model.batches)
        assert [i for batch in model.batches for i in batch] == list(range(10))

    asyncio.run(scenario())


def test_after_overlapping_callers_the_next_forward_waits_for_as_many():
    async def scenario():
        model = Model()
        batcher = AdaptiveBatcher(model.forward, max_batch_size=32, wait_s=NEVER)
        trio = asyncio.create_task(batcher.submit([1, 2, 3]))  # a forward of three: load
        await model.started.wait()
        model.release.set()
        assert await trio == [10, 20, 30]
        waiting = [asyncio.create_task(batcher.submit([i])) for i in (4, 5)]
        await settle()
        assert model.batches == [[1, 2, 3]]  # two queued of the three expected: still filling
        last = asyncio.create_task(batcher.submit([6, 7]))  # more than expected go along
        assert await asyncio.gather(*waiting, last) == [[40], [50], [60, 70]]
        assert model.batches == [[1, 2, 3], [4, 5, 6, 7]]

    asyncio.run(scenario())


def test_the_wait_for_company_ends():
    async def scenario():
        model = Model()
        model.release.set()
        batcher = AdaptiveBatcher(model.forward, max_batch_size=32, wait_s=0.01)
        assert await batcher.submit([1, 2]) == [10, 20]
        assert await batcher.submit([3]) == [30]  # after at most wait_s, with what is there
        assert model.batches == [[1, 2], [3]]

    asyncio.run(scenario())


def test_a_failing_forward_fails_its_batch_only():
    async def scenario():
        model = Model()
        batcher = AdaptiveBatcher(model.forward, max_batch_size=32, wait_s=0.01)
        blocker = asyncio.create_task(batcher.submit([1]))
        await model.started.wait()
        bad = asyncio.create_task(batcher.submit([-1]))
        good = asyncio.create_task(batcher.submit([2]))
        await settle()
        model.release.set()
        assert await blocker == [10]
        with pytest.raises(ValueError, match="negative input"):
            await bad
        with pytest.raises(ValueError):  # shared the failing forward
            await good
        assert await batcher.submit([3]) == [30]  # and the batcher carries on

    asyncio.run(scenario())


def test_callers_that_went_away_are_left_out_of_the_forward():
    async def scenario():
        model = Model()
        batcher = AdaptiveBatcher(model.forward, max_batch_size=32, wait_s=NEVER)
        blocker = asyncio.create_task(batcher.submit([1]))
        await model.started.wait()
        gone = asyncio.create_task(batcher.submit([5]))
        kept = asyncio.create_task(batcher.submit([6]))
        await settle()
        gone.cancel()
        await settle()
        model.release.set()
        await blocker
        assert await kept == [60]
        assert model.batches == [[1], [6]]

    asyncio.run(scenario())
