"""The order of a bench's runs: rounds of the same sides, every other round reversed (A B, B A,
A B, ...), so that a load drifting during the bench weighs on every side alike and each side
takes every position. Shared by the benches that compare sides."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Side = TypeVar("Side")


def alternated(sides: Sequence[Side], repeats: int) -> list[tuple[int, Side]]:
    """(round, side) for `repeats` rounds of `sides`, the odd rounds in reverse."""
    return [(r, side) for r in range(repeats) for side in (sides if r % 2 == 0 else sides[::-1])]


def alternated_sides(sides: Sequence[Side], repeats: int) -> list[Side]:
    """The sides of `alternated`, without their rounds."""
    return [side for _, side in alternated(sides, repeats)]
