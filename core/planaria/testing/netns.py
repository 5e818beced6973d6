"""Real network partitions on one machine: network namespaces joined by a bridge.

A :class:`Network` gives every participant of a job (the master, each node) a network
namespace of its own, ``pl-<tag>-<name>``, with ``lo`` up and one interface, ``eth0``, holding
its address ``10.214.<k>.<n>/24``. Each ``eth0`` is one end of a veth pair whose other end,
``v-<name>``, is a port of a bridge. :meth:`Network.cut` separates a participant from all the
others and :meth:`Network.heal` joins it again; ``ip netns exec`` (:meth:`Network.exec`) runs a
command inside one. Creating and removing namespaces needs root; :func:`unavailable` says why a
machine cannot (tests skip with that reason).

Why the bridge lives in a namespace of its own (``pl-<tag>-hub``), not in the root namespace:
the root namespace's links, routes and firewall stay untouched (nothing of a test can reach
this machine's real network, or be reached from it), two networks made at once never share a
link name or a subnet, and deleting the hub deletes the bridge and every veth pair with it, so
teardown cannot leave a link behind. ``<k>`` is random all the same, so that addresses seen in
two runs' logs are told apart.

Two kinds of cut:

- ``drop`` (the default): the participant's bridge port is disabled. Both links stay up, and
  every frame to or from the participant vanishes, as in a real partition: a connection in
  flight stalls and retransmits, a new ``connect()`` times out. Every namespace holds permanent
  neighbour (ARP) entries for the others, so that a cut is never turned into a fast "no route
  to host" by a failed address resolution. (A bridge port rather than ``tc ... netem loss
  100%``: ``sch_netem`` is a kernel module that many kernels, this project's CI VMs included,
  do not have.)
- ``down``: the hub's end of the veth pair goes down, so the participant's ``eth0`` loses its
  carrier, the way a pulled cable looks to the host itself (its kernel knows the link is down).

``Network(names, host=True)`` also joins the creator's own namespace (the machine's, for a test
run as usual) to the bridge: a veth pair whose outer end, ``pl-<tag>-h``, holds
``10.214.<k>.254/24``. Then a daemon or a master on this machine reaches every participant, and
they reach it, by a routable address of its own (:attr:`Network.host_address`), as the nodes of
a real cluster reach a login host: a Slurm controller, a Ray driver or an API server can stay
on this machine while each node is a host of its own. This is the one link the module adds to
the creator's namespace; ``<k>`` is then chosen so that no address of that namespace is in the
subnet, and deleting the hub removes the link with its veth pair. :meth:`Network.cut` of
``"host"`` separates the machine from the participants.

Teardown (:meth:`Network.close`, also on leaving the ``with`` block) always removes
everything: it kills every process still in one of the namespaces (``ip netns pids``), then
deletes the namespaces. Each network is recorded under :data:`REGISTRY` with its creator's pid;
a network whose creator died without its teardown (a SIGKILLed test run) is removed by the next
:class:`Network` created on this machine.

Why one module: a network is made, cut, healed and torn down by the same few ``ip`` calls on
the same names and records; the process killing and the sweep of stale networks are its
teardown, which a network created later runs for one whose creator died.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from planaria.process import proc_stat

PREFIX = "pl-"
SUBNET = "10.214"
NETNS_DIR = Path("/run/netns")
REGISTRY = Path("/run/planaria-netns")
"""One file per live network, named by its tag: the creator's pid and start time, then the
namespaces, one a line."""
BRIDGE = "br0"
INTERFACE = "eth0"
HOST = "host"
"""The name of the creator's own namespace in a network made with ``host=True``."""
HOST_NUMBER = 254
IFNAMSIZ = 15
"""The kernel's limit on a link name (and what this module keeps namespace names within)."""
KILL_WAIT = 10.0

_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
_TAG_LEN = 4


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made, changed or removed."""


def unavailable() -> str | None:
    """Why this machine cannot make a :class:`Network`, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    for tool in ("ip", "bridge"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    probe = f"{PREFIX}probe-{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace here: {exc}"
    try:
        _ip("-n", probe, "link", "add", BRIDGE, "type", "bridge")
    except NetnsError as exc:
        return f"cannot create a bridge in a network namespace here: {exc}"
    finally:
        with contextlib.suppress(NetnsError):
            _ip("netns", "del", probe)
    return None


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _bridge(*args: str) -> str:
    return _run(["bridge", *args])


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(command)}` could not run: {exc}") from exc
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit code {done.returncode}"
        raise NetnsError(f"`{' '.join(command)}` failed: {why}")
    return done.stdout


@dataclass(frozen=True)
class Member:
    """One participant of a :class:`Network`."""

    name: str
    netns: str
    address: str
    veth: str
    """The hub's end of its veth pair (a port of the bridge)."""
    mac: str
    """Of its ``eth0``."""


class Network:
    """Namespaces ``pl-<tag>-<name>`` for ``names``, on one bridge (see the module docstring).

    Names are short (the namespace name must fit :data:`IFNAMSIZ`): lower-case letters, digits
    and dashes, e.g. ``master``, ``n0``, ``n1``. Use it as a context manager, or call
    :meth:`create` and then, always, :meth:`close`.
    """

    def __init__(self, names: Sequence[str], *, host: bool = False) -> None:
        if not names:
            raise ValueError("a network needs at least one participant")
        if len(set(names)) != len(names):
            raise ValueError(f"participant names repeat: {list(names)}")
        if len(names) > 253:
            raise ValueError(f"{len(names)} participants do not fit a /24: at most 253")
        longest = IFNAMSIZ - len(PREFIX) - _TAG_LEN - 1
        for name in names:
            if not _NAME.fullmatch(name) or len(name) > longest or name in ("hub", HOST):
                raise ValueError(
                    f"participant name {name!r}: use 1 to {longest} lower-case letters, digits "
                    f"or dashes (not 'hub' or {HOST!r}), so that its namespace name fits 15 "
                    "characters"
                )
        self.tag = ""
        self.subnet = random.randrange(256)
        self.names = list(names)
        self.members: dict[str, Member] = {}
        self.hub = ""
        self.joins_host = host
        self.host: Member | None = None
        """The creator's namespace's end of the bridge, with ``host=True`` (its ``netns`` is
        empty: commands for it run as they are)."""
        self._created: list[str] = []

    # -- life -------------------------------------------------------------------------------

    def __enter__(self) -> Network:
        self.create()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def create(self) -> None:
        """Make the hub, its bridge and every participant's namespace; on any failure, remove
        what was made and raise :class:`NetnsError`."""
        if self._created:
            raise NetnsError(f"network {self.tag} is already created")
        sweep_stale()
        self.tag = self._free_tag()
        self.hub = f"{PREFIX}{self.tag}-hub"
        if self.joins_host:
            self.subnet = _free_subnet()
        self.members = {
            name: Member(
                name=name,
                netns=f"{PREFIX}{self.tag}-{name}",
                address=f"{SUBNET}.{self.subnet}.{number}",
                veth=f"v-{name}",
                mac=f"02:d6:{self.subnet:02x}:{number >> 8:02x}:{number & 255:02x}:01",
            )
            for number, name in enumerate(self.names, start=1)
        }
        self._register()
        try:
            self._add_netns(self.hub)
            _ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0")
            _ip("-n", self.hub, "link", "set", BRIDGE, "up")
            for member in self.members.values():
                self._add_member(member)
            if self.joins_host:
                self.host = self._add_host()
            everyone = [*self.members.values(), *([self.host] if self.host else [])]
            for member in everyone:
                for other in everyone:
                    if other is not member:
                        link = INTERFACE if member.netns else self.host_link
                        _ip(*_in(member.netns), "neigh", "replace", other.address, "lladdr",
                            other.mac, "dev", link, "nud", "permanent")  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _free_tag(self) -> str:
        for _ in range(100):
            tag = secrets.token_hex(_TAG_LEN // 2)
            if not (REGISTRY / tag).exists() and not (NETNS_DIR / f"{PREFIX}{tag}-hub").exists():
                return tag
        raise NetnsError(f"no free network tag left under {REGISTRY}")

    def _register(self) -> None:
        REGISTRY.mkdir(mode=0o700, exist_ok=True)
        names = [self.hub, *(m.netns for m in self.members.values())]
        record = "\n".join([f"{os.getpid()} {_start_time(os.getpid())}", *names]) + "\n"
        (REGISTRY / self.tag).write_text(record)

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_member(self, member: Member) -> None:
        self._add_netns(member.netns)
        _ip("-n", self.hub, "link", "add", member.veth, "type", "veth", "peer", "name",
            INTERFACE, "address", member.mac, "netns", member.netns)  # fmt: skip
        _ip("-n", self.hub, "link", "set", member.veth, "master", BRIDGE, "up")
        _ip("-n", member.netns, "addr", "add", f"{member.address}/24", "dev", INTERFACE)
        _ip("-n", member.netns, "link", "set", INTERFACE, "up")

    def _add_host(self) -> Member:
        """The veth pair from the hub's bridge to the creator's namespace (see the module
        docstring)."""
        host = Member(
            name=HOST,
            netns="",
            address=f"{SUBNET}.{self.subnet}.{HOST_NUMBER}",
            veth=f"v-{HOST}",
            mac=f"02:d6:{self.subnet:02x}:00:{HOST_NUMBER:02x}:01",
        )
        outer = self.host_link
        _ip("link", "add", outer, "address", host.mac, "type", "veth", "peer", "name",
            host.veth, "netns", self.hub)  # fmt: skip
        _ip("-n", self.hub, "link", "set", host.veth, "master", BRIDGE, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", outer)
        _ip("link", "set", outer, "up")
        return host

    @property
    def host_link(self) -> str:
        """The name of the host's end of its veth pair, in the creator's namespace."""
        return f"{PREFIX}{self.tag}-h"

    @property
    def host_address(self) -> str:
        """The creator's namespace's address on the bridge (a network made with ``host=True``)."""
        if self.host is None:
            raise NetnsError("this network does not join the host: make it with host=True")
        return self.host.address

    def close(self) -> list[int]:
        """Kill every process left in the namespaces, delete them, forget the network. Returns
        the pids it had to kill (a test asserts none). Safe to call twice."""
        killed: list[int] = []
        errors: list[str] = []
        for name in reversed(self._created):
            try:
                killed += kill_processes(name)
            except NetnsError as exc:
                errors.append(str(exc))
        if self.host is not None:
            # Deleted here, not left to the hub's end: a namespace is destroyed by the kernel in
            # the background, and its links with it, a moment after `ip netns del` returns.
            try:
                _ip("link", "del", self.host_link)
            except NetnsError as exc:
                if self.host_link in _ip("-o", "link", "show"):
                    errors.append(str(exc))
            self.host = None
        for name in reversed(self._created):
            try:
                _ip("netns", "del", name)
            except NetnsError as exc:
                if (NETNS_DIR / name).exists():
                    errors.append(str(exc))
        self._created = []
        if self.tag:
            (REGISTRY / self.tag).unlink(missing_ok=True)
        if errors:
            raise NetnsError("teardown incomplete: " + "; ".join(errors))
        return killed

    # -- use --------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Member:
        if name == HOST and self.host is not None:
            return self.host
        try:
            return self.members[name]
        except KeyError:
            raise KeyError(
                f"no participant {name!r} in this network: it has {', '.join(self.names)}"
            ) from None

    def netns(self, name: str) -> str:
        return self[name].netns

    def address(self, name: str) -> str:
        return self[name].address

    def exec(self, name: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside ``name``'s namespace (same pid:
        ``ip netns exec`` execs the command); ``argv`` itself for the host."""
        netns = self.netns(name)
        return ["ip", "netns", "exec", netns, *argv] if netns else list(argv)

    def cut(self, name: str, how: str = "drop") -> None:
        """Separate ``name`` from every other participant: ``drop`` (silently, as in a real
        partition) or ``down`` (its link loses its carrier); see the module docstring."""
        veth = self[name].veth
        if how == "drop":
            _bridge("-n", self.hub, "link", "set", "dev", veth, "state", "0")  # disabled
        elif how == "down":
            _ip("-n", self.hub, "link", "set", veth, "down")
        else:
            raise ValueError(f"unknown cut {how!r}: use 'drop' or 'down'")

    def heal(self, name: str) -> None:
        """Undo :meth:`cut`, whichever kind it was."""
        veth = self[name].veth
        _ip("-n", self.hub, "link", "set", veth, "up")
        _bridge("-n", self.hub, "link", "set", "dev", veth, "state", "3")  # forwarding

    def is_cut(self, name: str) -> bool:
        shown = _bridge("-n", self.hub, "link", "show", "dev", self[name].veth)
        return "state forwarding" not in shown

    def pids(self, name: str | None = None) -> list[int]:
        """The processes in ``name``'s namespace, or in any of this network's."""
        names = [self.netns(name)] if name else list(self._created)
        return [pid for ns in names for pid in netns_pids(ns)]


def _in(netns: str) -> list[str]:
    """``ip``'s arguments that run it in ``netns`` (none for the creator's own)."""
    return ["-n", netns] if netns else []


def _free_subnet() -> int:
    """A ``<k>`` of ``10.214.<k>.0/24`` that no address of the creator's namespace is in."""
    shown = _ip("-4", "-o", "addr", "show")
    taken = {int(k) for k in re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", shown)}
    free = [k for k in range(256) if k not in taken]
    if not free:
        raise NetnsError(f"every {SUBNET}.<k>.0/24 is in use on this machine")
    return random.choice(free)


# -- processes and leftovers --------------------------------------------------------------------


def netns_pids(netns: str) -> list[int]:
    try:
        out = _ip("netns", "pids", netns)
    except NetnsError:
        if not (NETNS_DIR / netns).exists():
            return []
        raise
    return [int(word) for word in out.split()]


def kill_processes(netns: str, wait: float = KILL_WAIT) -> list[int]:
    """SIGKILL every process in ``netns`` until none is left; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while pids := [p for p in netns_pids(netns) if p != os.getpid()]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in {netns} survived SIGKILL for {wait:g}s")
        time.sleep(0.02)
    return killed


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot: with the pid, it names one process."""
    stat = proc_stat(pid)
    return "" if stat is None else stat.start_time


def _stale() -> Iterator[tuple[Path, list[str]]]:
    if not REGISTRY.is_dir():
        return
    for record in REGISTRY.iterdir():
        try:
            owner, *names = record.read_text().splitlines()
            pid, started = owner.split(" ", 1) if " " in owner else (owner, "")
            alive = _start_time(int(pid)) == started and started != ""
        except (OSError, ValueError):
            continue
        if not alive:
            yield record, names


def sweep_stale() -> list[str]:
    """Remove the networks whose creator died without tearing them down; the namespaces
    removed."""
    removed: list[str] = []
    for record, names in _stale():
        for name in names:
            if (NETNS_DIR / name).exists():
                with contextlib.suppress(NetnsError):
                    kill_processes(name)
                    _ip("netns", "del", name)
                    removed.append(name)
        record.unlink(missing_ok=True)
    return removed
