"""asyncio helpers shared by the fetcher and the upstream clients."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def gather_or_cancel(*coros: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` that cancels the siblings as soon as one fails (TaskGroup semantics)
    and re-raises that first error itself rather than an ExceptionGroup."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
