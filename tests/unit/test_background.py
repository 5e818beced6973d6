"""planaria.background: work kept until it is done, listed while it runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc

from planaria.background import Running


def test_a_started_task_is_kept_until_done_and_then_forgotten() -> None:
    async def body() -> None:
        running: Running[asyncio.Future[None]] = Running()
        gate = asyncio.Event()
        done: list[str] = []

        async def work() -> None:
            await gate.wait()
            done.append("done")

        running.start(work())
        gc.collect()  # the loop holds only a weak reference: the set keeps the task
        assert len(running) == 1
        gate.set()
        await asyncio.gather(*running)
        assert done == ["done"]
        assert len(running) == 0

    asyncio.run(body())


def test_a_thread_future_is_kept_until_it_is_done_then_listed_no_more() -> None:
    async def body() -> None:
        running: Running[concurrent.futures.Future[None]] = Running()
        loop = asyncio.get_running_loop()
        gate = asyncio.Event()

        async def work() -> None:
            await gate.wait()

        def from_a_thread() -> None:
            running.keep(asyncio.run_coroutine_threadsafe(work(), loop))

        await asyncio.to_thread(from_a_thread)
        assert len(running) == 1
        gate.set()
        await asyncio.wait([asyncio.wrap_future(f) for f in running])
        await asyncio.sleep(0)
        assert list(running) == []

    asyncio.run(body())
