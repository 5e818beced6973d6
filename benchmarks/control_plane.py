"""How the master's cost grows with the number of nodes: N simulated agents against one real
master, for N in 100, 1,000 and 10,000.

The master is a real ``planaria run`` process (its own journal, timeline and API, plain HTTP
on loopback) whose scheduler (``simulated_nodes.py``) starts no process: the agents are asyncio
clients in this process that speak the agents' channel (:mod:`planaria.master.channel`: one
WebSocket per agent, the JSON of :mod:`planaria.protocol`), each from an address of its own in
127.0.0.0/8 as agents on different hosts would be. No workers run behind them. Each agent
registers, joins the first round, then keeps a standing ``/actions`` request and sends a
heartbeat with progress each ``master.heartbeat_interval`` (1 s; ``--interval``), as a notice
that wants no reply as agents send them, but one in :data:`TIMED`, sent as a request and timed.
It goes through a restart round (one agent reports a worker failure: every node restarts in
place) and a node replacement (one agent falls silent; the master declares it lost after
``heartbeat_timeout``, the scheduler hands out a new node id, a new agent registers as it and a
new round forms).

Figures, for each N:

- ``round_s``: from the last agent's join to the last agent's ``ready`` (the round complete)
  in its code; ``round_read_s``: to the last ``ready`` read off its agent's connection (the
  two differ by the queue of this one process of agents, as the action's figures below);
- ``restart_round_s`` (``restart_round_read_s``): from the failure report to every agent
  ``ready`` in the next round;
- ``action_all_ms`` (``action_p50_ms``): from the master's decision to restart to the last
  agent (the median one) holding the pushed action in its code; ``action_read_all_ms``
  (``action_read_p50_ms``): to the last (the median) agent's connection reading its frame,
  which is when an agent of its own host would have it (here the 10,000 agents share one
  process, and each one's code runs after the frames of all the others were read);
  ``master_push_ms``: from the first reply made to the last written (the master's
  ``planaria_channel_last_push_seconds{op="/actions"}``); and their floor on this machine
  (``push_floor_write_ms``, ``push_floor_all_ms``): a message of the same size written to N
  loopback connections by plain asyncio transports, read by another process;
- ``replace_s``: from the master's ``node_lost`` event to every agent ``ready`` in the round
  with the replacement (``replace_total_s`` adds the heartbeat timeout before it);
- heartbeats: sent per second over a steady window, and the latency of the timed ones
  (p50/p99): the wait in front of the master's loop. The window starts :data:`SETTLE` seconds
  after the first round; the p99 of the beats before it, the round's aftermath, is
  ``after_round_p99_ms``;
- the master's CPU seconds per second of wall time (``/proc/PID/stat``, user + system) over the
  heartbeat window, and its resident memory (VmRSS) and peak (VmHWM).

The baseline of the growth table is the smallest N measured in the same run: each row's cost
per agent against it shows what grows faster than linearly. The last line is one JSON object
for the largest N.

    python benchmarks/control_plane.py                  # 100, 1000, 10000
    python benchmarks/control_plane.py --agents 100 1000 --beat-window 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as ``python benchmarks/control_plane.py``: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import exit_on_sigterm

HERE = Path(__file__).resolve().parent
HOLD = 1.0  # master.heartbeat_interval: how often each agent beats (--interval)
SETTLE = 5.0
"""Seconds from the first round's end to the steady window: when a round forms, every agent
is told ``ready`` at once and beats at once, a wave the master takes a few seconds to absorb at
10,000 agents. The beats in between are measured too (``after_round_p99_ms``)."""
TIMEOUT = 5.0  # master.heartbeat_timeout: silence after which a node is lost
TIMED = 10
"""One heartbeat in this many is sent as a request and timed: its reply comes once the master
took every message the agent sent before it, so its latency is the wait in front of the
master's loop. The others are notices, as agents send them (no reply)."""

CONFIG = """\
job:
  name: control-plane
  command: [python, -c, "pass"]
  nodes: {n}
  procs_per_node: 1
  max_restarts: 1000
  workdir: {workdir}
scheduler: {{backend: simulated}}
rendezvous: {{join_timeout: 600s}}
diagnosis: {{checks: [], preflight: false}}
master: {{heartbeat_interval: {hold}s, heartbeat_timeout: {timeout}s, grace: 60s}}
chaos: []
"""


def _raise_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- one simulated agent -----------------------------------------------------------------------


class Rejected(Exception):
    pass


class _Frames(asyncio.Protocol):
    """The client side of one agent's channel (a WebSocket, ``GET /v1/channel``): the upgrade,
    then each reply (its ``re``, status and body bytes) handed to the request it answers, with
    no stream objects in between (the load generator must outrun the master). Its frames are
    masked with a zero key: valid on the wire, and no XOR to pay here."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.upgraded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting: dict[int, asyncio.Future[tuple[int, bytes, float]]] = {}
        """Requests waiting for their reply: status, body, and when its frame was read."""
        self.refused: str | None = None
        """What the master said when it refused a message that had no ``seq`` to answer."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.upgraded.done():
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            if not head.startswith(b"HTTP/1.1 101"):
                self.upgraded.set_exception(Rejected(head.split(b"\r\n", 1)[0].decode()))
                return
            self.upgraded.set_result(None)
        buffer = self.buffer
        read_at = time.time()
        while len(buffer) >= 2:
            opcode, size, at = buffer[0] & 0x0F, buffer[1] & 0x7F, 2
            if size == 126:
                size, at = int.from_bytes(buffer[2:4], "big"), 4
            elif size == 127:
                size, at = int.from_bytes(buffer[2:10], "big"), 10
            if len(buffer) < at + size:
                break
            payload, buffer = buffer[at : at + size], buffer[at + size :]
            if opcode == 8 and self.transport is not None:  # closed by the master
                self.transport.close()
            elif opcode == 1 and payload.startswith(b'{"re":null'):
                self.refused = payload.decode(errors="replace")  # a notice, or the channel
            elif opcode == 1:
                re_at = payload.index(b":") + 1
                seq = int(payload[re_at : payload.index(b",", re_at)])
                status_at = payload.index(b'"status":') + 9
                status = int(payload[status_at : status_at + 3])
                body = payload[payload.index(b'"body":', status_at) + 7 : -1]
                waiter = self.waiting.pop(seq, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result((status, body, read_at))
        self.buffer = buffer

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for waiter in self.waiting.values():
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the master closed the channel"))
        self.waiting.clear()


def _frame(payload: bytes) -> bytes:
    size = len(payload)
    if size < 126:
        head = bytes((0x81, 0x80 | size))
    elif size < 65536:
        head = bytes((0x81, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((0x81, 0x80 | 127)) + size.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


class Connection:
    """One agent's channel to the master, from a source address of its own."""

    def __init__(self, host: str, port: int, token: str, source: str) -> None:
        self.host, self.port, self.source = host, port, source
        client = source.replace(".", "-")
        self.upgrade = (
            f"GET /v1/channel?client={client} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: cGxhbmFyaWEtY2hhbm5lbA==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        self.frames: _Frames | None = None
        self.seq = 0

    async def post(self, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
        status, raw = await self.send(path, json.dumps(body, separators=(",", ":")).encode())
        return status, json.loads(raw) if raw else {}

    async def send(self, path: str, data: bytes) -> tuple[int, bytes]:
        status, raw, _ = await self.send_read(path, data)
        return status, raw

    async def send_read(self, path: str, data: bytes) -> tuple[int, bytes, float]:
        """Send a request; its reply's status and body, and when its frame was read (the
        wall clock)."""
        self.seq += 1
        seq = self.seq
        for attempt in range(50):
            try:
                if self.frames is None or self.frames.transport is None:
                    loop = asyncio.get_running_loop()
                    _, self.frames = await loop.create_connection(
                        _Frames, self.host, self.port, local_addr=(self.source, 0)
                    )
                    assert self.frames.transport is not None
                    self.frames.transport.write(self.upgrade)
                    await self.frames.upgraded
                frames = self.frames
                assert frames.transport is not None
                waiter = frames.waiting[seq] = asyncio.get_running_loop().create_future()
                # Every earlier reply came but those still waited for (``open``).
                waiting = ",".join(map(str, frames.waiting)).encode()
                frames.transport.write(
                    _frame(
                        b'{"seq":%d,"op":"%s","open":[%s],"body":%s}'
                        % (seq, path.encode(), waiting, data)
                    )
                )
                return await waiter
            except OSError:
                self.close()
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
        raise Rejected(f"{path}: no answer after 50 tries")

    def tell(self, path: str, data: bytes) -> bool:
        """Send a notice (no reply wanted, as agents send heartbeats) on the open channel:
        False when there is none (the agent's standing request opens the next)."""
        frames = self.frames
        if frames is None or frames.transport is None:
            return False
        if frames.refused is not None:
            raise Rejected(f"{path}: the master refused a notice: {frames.refused}")
        frames.transport.write(_frame(b'{"op":"%s","body":%s}' % (path.encode(), data)))
        return True

    def close(self) -> None:
        if self.frames is not None and self.frames.transport is not None:
            self.frames.transport.close()
        self.frames = None


BEAT = (
    b'{"node_id":"%s","round":%d,"activity":"running","progress":[{"local_rank":0,"step":%d,'
    b'"time":%.6f,"step_s":1.0,"busy_s":0.9,"first_step":1}],"wait":false}'
)
"""A heartbeat as an agent sends it in a running round: its progress."""


@dataclass
class Agent:
    node_id: str
    conn: Connection
    round: int = 0
    step: int = 0
    ready_at: dict[int, float] = field(default_factory=dict)
    """Round -> when this agent was told ``ready`` in it (its code had the reply)."""
    ready_read_at: dict[int, float] = field(default_factory=dict)
    """Round -> when that reply's frame was read off this agent's connection."""
    joined_at: dict[int, float] = field(default_factory=dict)
    """Round -> when this agent first asked to join after the previous one ended."""
    action_at: dict[int, float] = field(default_factory=dict)
    """Round -> when the master's action (restart, exit) that ended it reached this agent's
    code."""
    action_read_at: dict[int, float] = field(default_factory=dict)
    """Round -> when that action's frame was read off this agent's connection."""
    silent: bool = False
    timed_at: int = field(default_factory=lambda: random.randrange(TIMED))
    """Which of every :data:`TIMED` beats this agent times: a tenth of the agents each second."""
    beats: list[tuple[float, float | None]] = field(default_factory=list)
    """(sent or answered, latency) of each heartbeat (monotonic clock); the latency of the
    timed ones (one in :data:`TIMED`), None for the others."""

    async def register(self) -> None:
        body = {
            "node_id": self.node_id,
            "host": self.node_id,
            "addr": self.conn.source,
            "pid": os.getpid(),
        }
        while True:
            status, reply = await self.conn.post("/register", body)
            if status == 200:
                return
            if status != 503:  # 503: the node's launch (its replacement) is not known yet
                raise Rejected(f"{self.node_id}: register answered {status}: {reply}")
            await asyncio.sleep(0.05)

    async def join(self) -> str:
        body = {
            "node_id": self.node_id,
            "addr": self.conn.source,
            "port": 29500,
            "last_step": self.step,
        }
        self.joined_at.setdefault(self.round + 1, time.time())
        data = json.dumps(body, separators=(",", ":")).encode()
        while True:
            status, raw, read_at = await self.conn.send_read("/rendezvous/join", data)
            reply = json.loads(raw) if raw else {}
            if status != 200:
                raise Rejected(f"{self.node_id}: join answered {status}: {reply}")
            if reply["state"] == "ready":
                info = reply["info"]
                assert isinstance(info, dict)
                self.round = int(info["round"])
                self.ready_at[self.round] = time.time()
                self.ready_read_at[self.round] = read_at
                return "ready"
            if reply["state"] == "exit":
                return "exit"

    async def beat(self) -> str:
        """Heartbeats with progress, one per interval (the first at a random time within it,
        as agents do), until the master pushes an action."""
        ask = b'{"node_id":"%s","round":%d}' % (self.node_id.encode(), self.round)
        pushed = asyncio.ensure_future(self.conn.send_read("/actions", ask))
        try:
            await asyncio.wait({pushed}, timeout=random.random() * HOLD)
            while not self.silent and not pushed.done():
                self.step += 1
                body = BEAT % (self.node_id.encode(), self.round, self.step, time.time())
                sent = time.monotonic()
                if (self.step + self.timed_at) % TIMED:  # a notice, as agents send heartbeats
                    if self.conn.tell("/heartbeat", body):
                        self.beats.append((sent, None))
                    await asyncio.wait({pushed}, timeout=HOLD)
                    continue
                status, raw = await self.conn.send("/heartbeat", body)
                took = time.monotonic() - sent
                if status == 410 or self.silent:
                    return "fenced"
                if status != 200:
                    raise Rejected(f"{self.node_id}: heartbeat answered {status}: {raw!r}")
                self.beats.append((sent + took, took))
                await asyncio.wait({pushed}, timeout=max(0.0, HOLD - took))
            if self.silent:
                return "silent"
            status, raw, read_at = pushed.result()
            if status == 410:
                return "fenced"
            if status != 200:
                raise Rejected(f"{self.node_id}: actions answered {status}: {raw!r}")
            kind = str(json.loads(raw)["action"]["kind"])
            if kind == "none":  # woken for news of another kind: ask again
                return await self.beat()
            self.action_at[self.round] = time.time()
            self.action_read_at[self.round] = read_at
            return kind
        finally:
            pushed.cancel()

    async def live(self) -> None:
        await self.register()
        while True:
            if await self.join() == "exit":
                return
            action = await self.beat()
            if action in ("exit", "fenced", "silent"):
                self.conn.close()
                return


# -- the master --------------------------------------------------------------------------------


class MasterProcess:
    """``planaria run`` with the simulated scheduler, in a directory of its own."""

    def __init__(self, n: int, root: Path) -> None:
        self.root = root
        plugins = root / "plugins"
        info = plugins / "planaria_bench_simulated-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: planaria-bench-simulated\nVersion: 1.0\n"
        )
        (info / "entry_points.txt").write_text("[planaria]\nsimulated = simulated_nodes\n")
        config = root / "job.yaml"
        config.write_text(CONFIG.format(n=n, workdir=root, hold=HOLD, timeout=TIMEOUT))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(plugins), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.log = (root / "master.out").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "planaria", "--log-level", "warning", "run", str(config)],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_raise_open_files,
            start_new_session=True,
        )
        self.run_dir: Path | None = None
        self._events: list[dict[str, object]] = []
        self._read = 0

    async def address(self) -> tuple[str, int, str]:
        """The master's host, port and token, once its API listens (from its journal)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the master exited: {self.output()}")
            runs = list((self.root / "planaria-runs").glob("*/token"))
            if runs:
                self.run_dir = runs[0].parent
                text = (self.root / "master.out").read_text(errors="replace")
                if "master at http://" in text:
                    url = text.split("master at http://", 1)[1].split()[0]
                    host, port = url.rsplit(":", 1)
                    return host, int(port), runs[0].read_text().strip()
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the master did not start in 60 s: {self.output()}")

    def output(self) -> str:
        return (self.root / "master.out").read_text(errors="replace")[-3000:]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mib(self) -> tuple[float, float]:
        found = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) / 1024
        return found["VmRSS"], found["VmHWM"]

    def events(self, kind: str) -> list[dict[str, object]]:
        """The job's events of ``kind`` so far (its timeline, ``events.jsonl``)."""
        assert self.run_dir is not None
        with (
            contextlib.suppress(FileNotFoundError),
            (self.run_dir / "events.jsonl").open("rb") as f,
        ):
            f.seek(self._read)
            text = f.read()
            whole = text[: text.rfind(b"\n") + 1]  # a line half written is read whole next time
            self._read += len(whole)
            self._events += [json.loads(line) for line in whole.splitlines()]
        return [e for e in self._events if e.get("kind") == kind]

    def stop(self) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


# -- one measurement ---------------------------------------------------------------------------


def metrics(host: str, port: int, token: str) -> dict[str, str]:
    """The master's metrics (``GET /metrics``), by name with labels as written
    (``name{op="/actions"}``)."""
    request = urllib.request.Request(
        f"http://{host}:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        text = answer.read().decode()
    found = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line and not line.startswith("#"):
            found[name] = value
    return found


def source_address(i: int) -> str:
    return f"127.{1 + i // 62500}.{(i // 250) % 250}.{i % 250 + 1}"


async def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


def beat_rate(agents: list[Agent], t0: float, t1: float) -> float:
    """Heartbeats per second about [t0, t1]: the sum of each agent's own rate, from the first
    to the last of its beats answered from a hold before ``t0`` to ``t1`` (the beats are steady
    from the round on). Agents beat in step, each once per hold, so a plain count over a short
    window is off by up to one beat per agent."""
    total = 0.0
    for agent in agents:
        times = [answered for answered, _ in agent.beats if t0 - HOLD <= answered <= t1]
        if len(times) >= 2 and times[-1] > times[0]:
            total += (len(times) - 1) / (times[-1] - times[0])
    return total


def say(n: int, what: str) -> None:
    print(f"[{n} agents] {what}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(n: int, beat_window: float, root: Path) -> dict[str, float | int]:
    master = MasterProcess(n, root)
    tasks: list[asyncio.Task[None]] = []
    try:
        host, port, token = await master.address()
        agents = [
            Agent(f"node-{i}", Connection(host, port, token, source_address(i))) for i in range(n)
        ]
        start = time.time()
        for agent in agents:
            tasks.append(asyncio.create_task(agent.live()))
        await wait_for(lambda: all(1 in a.ready_at for a in agents), 300, "the first round")
        last_join = max(a.joined_at[1] for a in agents)
        round_s = max(a.ready_at[1] for a in agents) - last_join
        round_read_s = max(a.ready_read_at[1] for a in agents) - last_join
        startup_s = max(a.ready_at[1] for a in agents) - start
        say(
            n,
            f"first round: {round_s:.3f}s from the last join (read off the last agent's "
            f"connection at {round_read_s:.3f}s), {startup_s:.3f}s in all",
        )

        # Steady heartbeats: every agent long-polls; the window starts once the round's wave
        # has passed (SETTLE). The beats before it are the round's aftermath, measured apart.
        ready = time.monotonic() - (time.time() - max(a.ready_at[1] for a in agents))
        await asyncio.sleep(max(0.0, ready + SETTLE - time.monotonic()))
        cpu0, t0 = master.cpu_s(), time.monotonic()
        await asyncio.sleep(beat_window)
        cpu1, t1 = master.cpu_s(), time.monotonic()
        # Beats answered within the window: each agent's come once per hold (and latency)
        # wherever the window falls, which beats sent within it do not, the agents being in step.
        window = [
            late
            for a in agents
            for answered, late in a.beats
            if t0 <= answered <= t1 and late is not None
        ]
        aftermath = [
            late for a in agents for answered, late in a.beats if answered < t0 and late is not None
        ]
        rate = beat_rate(agents, t0, t1)
        rss, _ = master.memory_mib()
        say(
            n,
            f"heartbeats: {rate:.0f}/s, CPU {(cpu1 - cpu0) / (t1 - t0):.2f}/s",
        )

        # A restart round: one agent's worker fails, every node restarts in place.
        failing = agents[n // 2]
        report = {
            "node_id": failing.node_id,
            "round": failing.round,
            "succeeded": False,
            "failure": {
                "local_rank": 0,
                "rank": n // 2,
                "pid": 1,
                "exitcode": 1,
                "signal": None,
                "time": time.time(),
                "log_tail": "RuntimeError: simulated failure",
                "description": "exit code 1",
            },
        }
        reporter = Connection(host, port, token, "127.0.0.1")
        failed_at = time.time()
        status, reply = await reporter.post("/workers", report)
        reporter.close()
        if status != 200:
            raise Rejected(f"the failure report answered {status}: {reply}")
        await wait_for(lambda: all(1 in a.action_at for a in agents), 300, "the restart")
        # The master's own side of the push: the burst of /actions replies from the first made
        # to the last written (the round's ready, a burst of join replies, is another series).
        scrape = await asyncio.to_thread(metrics, host, port, token)
        push_s = scrape.get('planaria_channel_last_push_seconds{op="/actions"}', "nan")
        master_push_ms = float(push_s) * 1000
        await wait_for(lambda: all(2 in a.ready_at for a in agents), 300, "the restart round")
        restart_round_s = max(a.ready_at[2] for a in agents) - failed_at
        restart_round_read_s = max(a.ready_read_at[2] for a in agents) - failed_at
        decided_at = min(float(e["time"]) for e in master.events("workers_restarted"))
        pushed = sorted(a.action_at[1] - decided_at for a in agents)
        read = sorted(a.action_read_at[1] - decided_at for a in agents)
        say(
            n,
            f"restart round: {restart_round_s:.3f}s (read at {restart_round_read_s:.3f}s); "
            f"the restart reached every agent "
            f"{pushed[-1] * 1000:.0f} ms after the decision (p50 {pct(pushed, 0.5) * 1000:.0f}; "
            f"read off the last agent's connection at {read[-1] * 1000:.0f}); "
            f"the master wrote it to every socket in {master_push_ms:.0f} ms",
        )

        # A node replacement: one agent falls silent; the master declares it lost and asks the
        # scheduler for another node, whose agent then starts (as the scheduler would start it).
        await asyncio.sleep(HOLD * 2)
        lost = agents[n // 3]
        lost.silent = True
        lost.conn.close()
        silent_at = time.time()
        await wait_for(lambda: master.events("node_replaced"), 300 + TIMEOUT, "the replacement")
        replaced = master.events("node_replaced")[0]
        data = replaced["data"]
        assert isinstance(data, dict) and replaced["node"] == lost.node_id, replaced
        newcomer = Agent(str(data["replacement"]), Connection(host, port, token, source_address(n)))
        newcomer.round = lost.round
        tasks.append(asyncio.create_task(newcomer.live()))
        survivors = [a for a in agents if a is not lost] + [newcomer]
        await wait_for(
            lambda: all(3 in a.ready_at for a in survivors), 300, "the round with the replacement"
        )
        done_at = max(a.ready_at[3] for a in survivors)
        lost_at = min(
            float(e["time"])
            for e in master.events("fault_detected")
            if isinstance(e["data"], dict) and e["data"].get("fault") == "node_lost"
        )
        _, peak = master.memory_mib()
        return {
            "agents": n,
            "startup_s": round(startup_s, 3),
            "round_s": round(round_s, 3),
            "round_read_s": round(round_read_s, 3),
            "restart_round_s": round(restart_round_s, 3),
            "restart_round_read_s": round(restart_round_read_s, 3),
            "action_all_ms": round(pushed[-1] * 1000, 1),
            "action_p50_ms": round(pct(pushed, 0.5) * 1000, 1),
            "action_read_all_ms": round(read[-1] * 1000, 1),
            "action_read_p50_ms": round(pct(read, 0.5) * 1000, 1),
            "master_push_ms": round(master_push_ms, 1),
            "replace_s": round(done_at - lost_at, 3),
            "replace_total_s": round(done_at - silent_at, 3),
            "heartbeats_per_s": round(rate, 1),
            "heartbeat_p50_ms": round(pct(window, 0.5) * 1000, 1),
            "heartbeat_p99_ms": round(pct(window, 0.99) * 1000, 1),
            "after_round_p99_ms": round(pct(aftermath, 0.99) * 1000, 1),
            "master_cpu_per_s": round((cpu1 - cpu0) / (t1 - t0), 3),
            "master_rss_mib": round(rss, 1),
            "master_peak_rss_mib": round(peak, 1),
        }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        code = master.stop()
        if code not in (0, 1, -15, 143):
            print(f"master exited {code}:\n{master.output()}", file=sys.stderr)


SINK = """
import asyncio, sys, time
n, size = int(sys.argv[1]), int(sys.argv[2])
async def main():
    left, done = n * size, asyncio.get_running_loop().create_future()
    class Sink(asyncio.Protocol):
        def data_received(self, data):
            nonlocal left
            left -= len(data)
            if left <= 0 and not done.done():
                done.set_result(time.monotonic())
    server = await asyncio.get_running_loop().create_server(Sink, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    print(await done, flush=True)
asyncio.run(main())
"""
"""The far end of :func:`push_floor`: reads N messages, says when the last byte came."""


async def push_floor(n: int, size: int = 160) -> tuple[float, float]:
    """The floor under a push to ``n`` agents on this machine: one message of ``size`` bytes
    (a pushed action's) written to each of ``n`` loopback TCP connections by plain asyncio
    transports, no framing or JSON, and read by an asyncio process on the other end. The time
    to write them all and the time until the last one arrived, in ms."""
    sink = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SINK,
        str(n),
        str(size),
        stdout=asyncio.subprocess.PIPE,
        preexec_fn=_raise_open_files,
    )
    assert sink.stdout is not None
    transports: list[asyncio.BaseTransport] = []
    try:
        port = int(await sink.stdout.readline())
        loop = asyncio.get_running_loop()
        for first in range(0, n, 500):
            made = await asyncio.gather(
                *(
                    loop.create_connection(
                        asyncio.Protocol, "127.0.0.1", port, local_addr=(source_address(i), 0)
                    )
                    for i in range(first, min(n, first + 500))
                )
            )
            transports += [transport for transport, _ in made]
        await asyncio.sleep(0.5)  # every connection accepted at the far end
        message = b"x" * size
        start = time.monotonic()
        for transport in transports:
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(message)
        written = time.monotonic()
        arrived = float(await asyncio.wait_for(sink.stdout.readline(), 60))
        return (written - start) * 1000, (arrived - start) * 1000
    finally:
        for transport in transports:
            transport.close()
        with contextlib.suppress(ProcessLookupError):
            sink.kill()
        await sink.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument(
        "--beat-window", type=float, default=10.0, help="seconds of steady heartbeats measured"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="master.heartbeat_interval, seconds (docs/control-plane.md: 3 at 30,000 agents); "
        "the heartbeat timeout is 5 intervals",
    )
    parser.add_argument("--keep", action="store_true", help="keep the masters' run directories")
    args = parser.parse_args()
    global HOLD, TIMEOUT
    HOLD, TIMEOUT = args.interval, 5 * args.interval
    # Stopped from outside: the masters are stopped on the way out (finally), not left behind.
    exit_on_sigterm()
    _raise_open_files()
    # The load generator's own state (10,000 agents) is long-lived too: keep the collector
    # from walking it over and over, as the master does (planaria.master.scale).
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
    rows = []
    for n in args.agents:
        root = Path(tempfile.mkdtemp(prefix=f"planaria-cp-{n}-"))
        try:
            row = asyncio.run(measure(n, args.beat_window, root))
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        # The baseline of the push, on the same machine in the same run (the master is gone:
        # the connections are under the same open-file limit).
        floor_write, floor_all = asyncio.run(push_floor(n))
        row["push_floor_write_ms"], row["push_floor_all_ms"] = (
            round(floor_write, 1),
            round(floor_all, 1),
        )
        say(
            n,
            f"push: the master wrote it in {row['master_push_ms']:.0f} ms, plain asyncio writes "
            f"in {floor_write:.0f} ms ({row['master_push_ms'] / floor_write:.2f}x); every agent "
            f"had it in {row['action_all_ms']:.0f} ms, the plain messages in {floor_all:.0f} ms "
            f"({row['action_all_ms'] / floor_all:.2f}x)",
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    print()
    print(
        f"{'agents':>7} {'round_s':>8} {'restart_s':>9} {'replace_s':>9} {'beats/s':>8} "
        f"{'p50_ms':>7} {'p99_ms':>7} {'after_ms':>8} {'cpu/s':>6} {'rss_MiB':>8}  "
        f"{'ms/agent round':>14} {'x base':>7} {'cpu us/beat':>11} {'x base':>7}"
    )
    per_beat_base = base["master_cpu_per_s"] / max(base["heartbeats_per_s"], 1e-9)
    for row in rows:
        per_agent = row["restart_round_s"] / row["agents"] * 1000
        per_agent_base = base["restart_round_s"] / base["agents"] * 1000
        per_beat = row["master_cpu_per_s"] / max(row["heartbeats_per_s"], 1e-9)
        print(
            f"{row['agents']:>7} {row['round_s']:>8.3f} {row['restart_round_s']:>9.3f} "
            f"{row['replace_s']:>9.3f} {row['heartbeats_per_s']:>8.0f} "
            f"{row['heartbeat_p50_ms']:>7.1f} {row['heartbeat_p99_ms']:>7.1f} "
            f"{row['after_round_p99_ms']:>8.1f} "
            f"{row['master_cpu_per_s']:>6.2f} {row['master_rss_mib']:>8.1f}  "
            f"{per_agent:>14.3f} {per_agent / per_agent_base:>7.2f} "
            f"{per_beat * 1e6:>11.1f} {per_beat / per_beat_base:>7.2f}"
        )
    top = rows[-1]
    print(
        json.dumps(
            {
                k: top[k]
                for k in (
                    "agents",
                    "round_s",
                    "round_read_s",
                    "restart_round_s",
                    "restart_round_read_s",
                    "action_all_ms",
                    "action_read_all_ms",
                    "master_push_ms",
                    "push_floor_write_ms",
                    "push_floor_all_ms",
                    "heartbeat_p99_ms",
                    "after_round_p99_ms",
                    "master_cpu_per_s",
                    "master_rss_mib",
                )
            }
        )
    )


if __name__ == "__main__":
    main()
