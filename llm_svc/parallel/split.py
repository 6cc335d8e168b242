"""How one dimension splits over ranks: contiguous, even, in units of ``unit`` (heads, blocks)."""

from __future__ import annotations


def even_range(total: int, parts: int, index: int, unit: int = 1, what: str = "dimension") -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``total`` split into ``parts`` equal contiguous
    pieces, each a multiple of ``unit``; a ``ValueError`` naming ``what`` when it does not split."""
    if total % parts or (total // parts) % unit:
        extra = f" in multiples of {unit}" if unit > 1 else ""
        raise ValueError(f"{what} = {total} does not split evenly over {parts} ranks{extra}")
    size = total // parts
    return index * size, (index + 1) * size
