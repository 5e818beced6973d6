"""planaria.master.state.Wake: the event a long poll waits on, with its own timeout."""

from __future__ import annotations

import asyncio
import time

from planaria.master.state import Deferred, Wake


def test_a_wait_ends_when_set_or_after_its_timeout() -> None:
    async def main() -> None:
        wake = Wake()
        started = time.monotonic()
        assert await wake.wait(0.1) is False
        assert 0.1 <= time.monotonic() - started < 5.0

        waiting = asyncio.ensure_future(wake.wait(30))
        await asyncio.sleep(0.05)
        wake.set()
        assert await asyncio.wait_for(waiting, 1) is True
        assert wake.waiter(30) is None  # set already: nothing to wait for
        wake.clear()
        assert wake.waiter(0) is None  # no time to wait

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_others_waiting() -> None:
    async def main() -> None:
        wake = Wake()
        given_up, kept = wake.waiter(30), wake.waiter(30)
        assert given_up is not None and kept is not None
        given_up.cancel()
        await asyncio.sleep(0.01)
        assert not kept.done()
        wake.set()
        await asyncio.sleep(0)
        assert kept.done() and not kept.cancelled()

    asyncio.run(main())


def test_waiters_that_ended_do_not_pile_up() -> None:
    """A node's wake is waited on once a heartbeat for the job's whole life, and a round's
    by every node joining it: what ended is dropped, in amortised O(1) a wait."""

    async def main() -> None:
        wake = Wake()
        for _ in range(300):
            assert await wake.wait(0.001) is False
        assert len(wake._waiters) <= 2

        live = [wake.waiter(30) for _ in range(1000)]
        for waiter in live[::2]:
            assert waiter is not None
            waiter.cancel()
        for _ in range(1000):
            gone = wake.waiter(30)
            assert gone is not None
            gone.cancel()
        assert len(wake._waiters) <= 2 * 500 + 2 + 1
        wake.set()
        await asyncio.sleep(0)
        assert all(w is not None and w.done() for w in live)

    asyncio.run(main())


def test_a_deferred_answer_maps_once_the_wait_is_done() -> None:
    async def main() -> None:
        wake = Wake()
        waiting = wake.waiter(30)
        assert waiting is not None
        deferred = Deferred(waiting, lambda: 20).map(lambda n: n + 1)
        assert deferred.waiting is waiting
        wake.set()
        await deferred.waiting
        assert deferred.then() == 21

    asyncio.run(main())
