import asyncio

import pytest

from gateway.aio import gather_or_cancel

pytestmark = pytest.mark.unit


def test_gather_or_cancel_cancels_siblings_and_raises_the_first_error():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def boom():
        await asyncio.sleep(0.01)
        raise ValueError("bad item")

    async def main():
        assert await gather_or_cancel(asyncio.sleep(0, "a"), asyncio.sleep(0, "b")) == ["a", "b"]
        with pytest.raises(ValueError, match="bad item"):
            await gather_or_cancel(slow(), boom())

    asyncio.run(main())
    assert cancelled == [True]
