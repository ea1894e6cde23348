"""One asyncio loop in a daemon thread, and one aiohttp session on it, per process.

Synchronous code (the GRPO loop) runs coroutines there with `run_async(coro)`; HTTP clients
(multi-turn rollouts over HTTP, NeMo Gym) share `http_session()`, one connection pool per
process, as NeMo Gym itself does at high concurrency.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_session: Any = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            try:  # uvloop (installed with uvicorn[standard]) is the cheaper loop per request
                import uvloop

                loop = uvloop.new_event_loop()
            except ImportError:
                loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="tempering-aio", daemon=True).start()
            _loop = loop
        return _loop


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
    """Run `coro` on the shared background loop and wait for its result (from sync code)."""
    future = asyncio.run_coroutine_threadsafe(coro, _background_loop())
    return future.result(timeout_s)


async def http_session() -> Any:
    """The process's aiohttp session (created on first use, on the background loop)."""
    import aiohttp

    global _session
    if _session is None or _session.closed:
        _session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None),
        )
    return _session


@atexit.register
def _close_session() -> None:
    if _session is not None and not _session.closed and _loop is not None and _loop.is_running():
        asyncio.run_coroutine_threadsafe(_session.close(), _loop).result(5)
