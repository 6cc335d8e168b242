"""read_bounded: the body whole under the limit; refused from its declared length, or as soon as the
bytes read pass the limit, without reading the rest."""

from __future__ import annotations

import asyncio

import pytest

from shared.bounded_read import TooLarge, read_bounded

pytestmark = pytest.mark.unit


def _chunks(parts: list[bytes], seen: list[int]):
    async def gen():
        for p in parts:
            seen.append(len(p))
            yield p
    return gen()


def test_a_body_within_the_limit_comes_back_whole():
    seen: list[int] = []
    assert asyncio.run(read_bounded(_chunks([b"ab", b"cd", b"e"], seen), 5, "5")) == b"abcde"


def test_a_declared_length_past_the_limit_is_refused_before_reading():
    seen: list[int] = []
    with pytest.raises(TooLarge) as e:
        asyncio.run(read_bounded(_chunks([b"abcdef"], seen), 5, "6"))
    assert e.value.declared == 6 and e.value.limit == 5 and seen == []


def test_bytes_past_the_limit_stop_the_read_at_the_chunk_that_passes_it():
    seen: list[int] = []
    with pytest.raises(TooLarge) as e:
        asyncio.run(read_bounded(_chunks([b"abc", b"def", b"ghi"], seen), 5, None))
    assert e.value.declared is None and seen == [3, 3]  # the third chunk is never read


def test_a_lying_declared_length_does_not_let_more_through():
    seen: list[int] = []
    with pytest.raises(TooLarge):
        asyncio.run(read_bounded(_chunks([b"abc", b"def"], seen), 5, "2"))
