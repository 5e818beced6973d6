"""The journal's group commit: the requests answered in one turn of the loop share one write,
so thousands of nodes joining at once cost a few transactions (and fsyncs), not one each.

A request's changes are on disk before it is answered; the write is made once, soon (the next
turn of the loop), for all of those that asked meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class GroupCommit:
    """Calls ``write`` once for all who ask for a commit in one turn of the loop."""

    def __init__(self, write: Callable[[], None]) -> None:
        self._write = write
        self._next: asyncio.Future[None] | None = None

    def next(self) -> asyncio.Future[None]:
        """The next commit, done once what changed so far is written (its exception, when
        the write failed). Not to be cancelled: it is shared."""
        if self._next is None:
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            loop.call_soon(self._commit)
        return self._next

    def _commit(self) -> None:
        done, self._next = self._next, None
        assert done is not None
        try:
            self._write()
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
