"""The channel's outbox (:class:`planaria.master.channel.Channels`): a burst of pushed replies
goes out in slices of writes, a reply made while it is sent going out after the slice it came
in, and every reply goes out once, after the journal write of what it answered; one that tells
of nothing decided goes at once."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from aiohttp import WSMessage, WSMsgType
from pydantic import BaseModel, ConfigDict

from planaria.master.channel import SEND_SLICE, Channels, _Asked
from planaria.master.routes import Route
from planaria.master.state import ChannelStats
from planaria.protocol import API_PREFIX

WRITE_S = 0.001
"""What each write takes on the test's clock."""
SLICE = round(SEND_SLICE / WRITE_S)
"""Writes in one slice."""
BURST = 3 * SLICE + 17
REPLY = '"status":200,"body":{}}'


class _Master:
    def __init__(self) -> None:
        self.channel = ChannelStats()
        self.commits = 0
        self.fails: Exception | None = None

    async def journal_committed(self) -> None:
        await asyncio.sleep(0)
        if self.fails is not None:
            raise self.fails
        self.commits += 1


class _Socket:
    """An open channel that records what it was sent, and the journal writes done by then.
    Each write takes :data:`WRITE_S` of ``clock`` (the loop's time in the test), if given."""

    closed = False

    def __init__(self, master: _Master, clock: list[float] | None = None) -> None:
        self.master = master
        self.sent: list[tuple[int, int]] = []
        self.texts: list[str] = []
        self.on_send: dict[int, object] = {}
        self.clock = clock

    async def send_str(self, text: str) -> None:
        if self.clock is not None:
            self.clock[0] += WRITE_S
        self.sent.append((json.loads(text)["re"], self.master.commits))
        self.texts.append(text)
        hook = self.on_send.pop(len(self.sent), None)
        if hook is not None:
            hook()  # type: ignore[operator]


def _post(channels: Channels, ws: _Socket, seq: int) -> None:
    asked = _Asked(seq)
    asked.reply = REPLY
    asked.waiting.append(ws)  # type: ignore[arg-type]
    channels._post(asked)


async def _sent(channels: Channels) -> None:
    """Return once the outbox is empty."""
    while channels._flushing is not None:
        await asyncio.sleep(0)


def test_a_burst_goes_out_a_slice_at_a_time_and_a_reply_made_meanwhile_after_its_slice() -> None:
    """The burst is written with no turn of the loop for a slice: the requests it brings wait
    (they cannot close a round before it is out). A reply made meanwhile goes out after the
    slice it came in, before the rest of the burst."""

    async def main() -> None:
        clock = [0.0]
        asyncio.get_running_loop().time = lambda: clock[0]  # type: ignore[method-assign]
        master = _Master()
        channels = Channels([], SimpleNamespace(master=master))  # type: ignore[arg-type]
        ws = _Socket(master, clock)
        channels.open[ws] = None  # type: ignore[index]
        commits_when_made: dict[int, int] = {}

        def made_meanwhile() -> None:  # a heartbeat answered while the burst is sent
            commits_when_made[-1] = master.commits
            _post(channels, ws, -1)

        ws.on_send[10] = made_meanwhile
        for seq in range(BURST):
            _post(channels, ws, seq)
        await _sent(channels)

        order = [seq for seq, _ in ws.sent]
        assert sorted(order) == [-1, *range(BURST)], "every reply sent exactly once"
        # The slice is written whole (no turn), then the reply made in it.
        assert abs(order.index(-1) - SLICE) <= 1, f"it went out after {order.index(-1)} replies"
        assert [s for s in order if s >= 0] == list(range(BURST)), "the burst kept its order"
        # Each reply after a journal write that followed its making.
        commits = dict(ws.sent)
        assert commits[-1] > commits_when_made[-1]
        assert all(commits[s] >= 1 for s in range(BURST))

    asyncio.run(main())


class _Beat(BaseModel):
    due: bool


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True)
    action: str


CALLS: list[bool] = []


def _answer(_: object, beat: _Beat) -> _Reply:
    CALLS.append(beat.due)
    return _Reply(action="restart" if beat.due else "none")


BEAT = Route(
    "POST",
    f"{API_PREFIX}/beat",
    _Beat,
    _Reply,
    "a heartbeat",
    _answer,
    channel=True,
    idle=lambda reply: reply.action == "none",
)


def test_a_reply_that_tells_of_nothing_decided_goes_at_once_and_is_kept() -> None:
    """ "Nothing due" is sent by the message's own turn, with no journal write awaited; a
    reply with an action waits for the write. Both are kept for a request sent again."""

    async def main() -> None:
        master = _Master()
        channels = Channels([BEAT], SimpleNamespace(master=master))  # type: ignore[arg-type]
        ws, again = _Socket(master), _Socket(master)
        channels.open[ws] = channels.open[again] = None  # type: ignore[index]
        client = channels.client("agent")

        def message(seq: int, due: bool, open_: list[int]) -> WSMessage:
            text = json.dumps({"seq": seq, "op": "/beat", "body": {"due": due}, "open": open_})
            return WSMessage(WSMsgType.TEXT, text, None)

        CALLS.clear()
        assert await channels._take(ws, client, message(1, False, [1]))  # type: ignore[arg-type]
        assert ws.sent == [(1, 0)], "sent within its own turn, before any journal write"
        # The agent has not had reply 1 (its connection is dropping): it still lists it.
        assert await channels._take(ws, client, message(2, True, [1, 2]))  # type: ignore[arg-type]
        assert ws.sent == [(1, 0)], "an action waits for the journal"
        await _sent(channels)
        assert ws.sent == [(1, 0), (2, 1)]
        # Both sent again on a new connection: the kept replies, not new calls.
        for seq, due in ((1, False), (2, True)):
            sent = message(seq, due, [1, 2])
            assert await channels._take(again, client, sent)  # type: ignore[arg-type]
        await _sent(channels)
        assert sorted(seq for seq, _ in again.sent) == [1, 2]
        assert CALLS == [False, True], "each request served once"

    asyncio.run(main())


def test_a_reply_whose_journal_write_failed_says_so() -> None:
    """A reply may not say its request was taken when what it changed is not on disk."""

    async def main() -> None:
        master = _Master()
        master.fails = OSError(28, "No space left on device")
        channels = Channels([], SimpleNamespace(master=master))  # type: ignore[arg-type]
        ws = _Socket(master)
        channels.open[ws] = None  # type: ignore[index]
        _post(channels, ws, 7)
        await _sent(channels)
        (text,) = ws.texts
        reply = json.loads(text)
        assert reply["re"] == 7 and reply["status"] == 500
        assert "the master's journal failed" in reply["body"]["error"]
        assert "No space left on device" in reply["body"]["error"]

    asyncio.run(main())
