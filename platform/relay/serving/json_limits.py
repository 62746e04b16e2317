"""How much structure a JSON text from a client may hold, checked before it is parsed.

A request body is bounded in bytes (`max_body_bytes`), but bytes are not what parsing costs:
each `{}` (three bytes with its comma) becomes a 64-byte dict and an 8-byte list slot, so 1 MiB
of `{},` parses into ~24 MiB of Python objects before any check of the instance count could
refuse it; and 10⁵ nested `[` make the parser recurse past Python's limit (a RecursionError).
So the text is scanned first, at C speed: strings are blanked out (a bracket inside a string
is no structure), then the objects and arrays are counted against a budget that grows with the
instances a request may carry, and their nesting depth is measured. Numbers, strings, true,
false and null are left to the byte limit: none of them grows more than ~10× when parsed.
"""

from __future__ import annotations

import re

# Objects and arrays one instance may bring: digits sent as 8 rows of 8 is 10 (its dict, its
# list, 8 rows); a v2 tensor nested by shape, one per row. Generous for any schema relay serves.
CONTAINERS_PER_INSTANCE = 64
# And the envelope around the instances (the body, its lists, a v2 request's tensors).
ENVELOPE_CONTAINERS = 64
# Deeper than any schema relay serves nests (a v1 body of nested rows is 4 deep), far below
# where Python's parser recurses out (~1000).
MAX_DEPTH = 32

# A JSON string, escapes included; possessive, so a long one costs no backtracking.
STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
BRACKET = re.compile(rb"[\[\]{}]")


class TooMuchJSON(ValueError):
    """A JSON text beyond the budget: `status` 413 (too many objects and arrays) or 422
    (nested too deep), and what was found, as a message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def check(text: bytes | str, max_containers: int, max_depth: int = MAX_DEPTH) -> None:
    """Raise TooMuchJSON when `text` holds more than `max_containers` objects and arrays, or
    nests them deeper than `max_depth`. Malformed text is the parser's to refuse."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    bare = STRING.sub(b'""', data)
    _check_depth(bare, max_depth, brackets_to_read=2 * max_containers + 2)
    containers = bare.count(b"{") + bare.count(b"[")
    if containers > max_containers:
        message = f"{containers} JSON objects and arrays; at most {max_containers}"
        raise TooMuchJSON(413, "too_many_values", message)


def _check_depth(bare: bytes, max_depth: int, brackets_to_read: int) -> None:
    """Nesting deeper than `max_depth` among the first `brackets_to_read` brackets (a Python
    loop, so bounded: a text with more is refused by its count anyway)."""
    depth = 0
    for read, bracket in enumerate(BRACKET.finditer(bare)):
        if read >= brackets_to_read:
            return
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        if depth > max_depth:
            raise TooMuchJSON(422, "too_deep", f"JSON nested deeper than {max_depth} levels")


def body_budget(max_instances: int) -> int:
    """Objects and arrays a request body carrying up to `max_instances` instances may hold."""
    return ENVELOPE_CONTAINERS + CONTAINERS_PER_INSTANCE * max_instances
