"""Slurm's own commands (``sinfo``, ``squeue``, ``scancel``, ``scontrol``, ``sbatch``) run with
a timeout, and parsers of their parsable output formats.

Every command is an argument list (never a shell line); one that fails raises a
:class:`SlurmCommandError` carrying Slurm's own message, since that is what tells the user what
to fix ("Invalid partition name specified", "Requested node configuration is not available").
The parsers are pure functions, tested on recorded output.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from planaria import process
from planaria.plugin import SchedulerError

TIMEOUT = 30.0

# Node states (sinfo %T) in which no step of ours can run, or should: the node is gone or an
# operator took it out of service.
BAD_STATES = frozenset(
    {"down", "drained", "draining", "drain", "fail", "failing", "future", "unknown", "inval"}
)
# Flags sinfo appends to %T: * not responding, ~ powered off, # powering up, % powering down,
# ! pending power down, $ maintenance reservation, @ pending reboot, ^ rebooting, - planned.
_FLAGS = "*~#%!$@^-+"


class SlurmMissingError(SchedulerError):
    """Slurm's client commands are not installed on this machine."""


class SlurmCommandError(SchedulerError):
    """A Slurm command failed; the message holds Slurm's own."""


def installed() -> bool:
    return shutil.which("srun") is not None and shutil.which("squeue") is not None


def run(
    args: Sequence[str], *, timeout: float = TIMEOUT, check: bool = True, cwd: Path | None = None
) -> str:
    """Run a Slurm command (in ``cwd``, or here) and return its stdout; :class:`SlurmCommandError`
    with its stderr when it fails (``check``), :class:`SlurmMissingError` when it is not
    installed. Short-lived and bounded by ``timeout``, so it needs no death signal; its group is
    killed on timeout."""
    return run_both(args, timeout=timeout, check=check, cwd=cwd)[0]


def run_both(
    args: Sequence[str], *, timeout: float = TIMEOUT, check: bool = True, cwd: Path | None = None
) -> tuple[str, str]:
    """:func:`run`, with stderr too: some commands say what they have not only there, and
    exit 0 (``scontrol show topology`` on a cluster without a topology plugin)."""
    argv = list(args)
    try:
        proc = process.popen(
            argv,
            die_with_parent=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
    except FileNotFoundError as exc:
        if cwd is not None and exc.filename in (cwd, str(cwd)):
            raise SchedulerError(f"cannot run {argv[0]} in {cwd}: it does not exist") from None
        raise SlurmMissingError(
            f"{argv[0]} not found: Slurm's client commands are not installed on this machine "
            "(or not on PATH); run planaria where sbatch and srun work"
        ) from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill_group(proc.pid, 0.0)
        proc.communicate()
        raise SlurmCommandError(
            f"{' '.join(argv)} did not answer within {timeout:g}s: is slurmctld reachable?"
        ) from None
    if check and proc.returncode != 0:
        message = " ".join(line.strip() for line in stderr.splitlines() if line.strip())
        raise SlurmCommandError(
            f"{' '.join(argv)} failed (exit {proc.returncode}): {message or 'no message'}"
        )
    return str(stdout), str(stderr)


@dataclass(frozen=True)
class NodeStatus:
    """A node as ``sinfo -h -N -o '%N|%T|%E'`` shows it."""

    name: str
    state: str
    """The base state in lower case, without sinfo's flags (``down``, ``idle``, ``mixed``)."""
    responding: bool
    reason: str = ""

    @property
    def usable(self) -> bool:
        return self.responding and not (set(self.state.split("+")) & BAD_STATES)

    def describe(self) -> str:
        what = self.state if self.responding else f"{self.state}, not responding"
        return f"Slurm node {self.name} is {what}" + (f" ({self.reason})" if self.reason else "")


def parse_node_states(text: str) -> dict[str, NodeStatus]:
    """``node1|idle|none`` lines -> {name: status}. A node listed twice (in two partitions)
    keeps its first line; lines that are not of that form are skipped."""
    nodes: dict[str, NodeStatus] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) < 2 or not parts[0] or not parts[1]:
            continue
        name, raw = parts[0], parts[1].strip().lower()
        reason = parts[2].strip() if len(parts) > 2 else ""
        state = raw.rstrip(_FLAGS)
        responding = "*" not in raw[len(state) :]
        if reason.lower() == "none":
            reason = ""
        nodes.setdefault(name, NodeStatus(name, state or raw, responding, reason))
    return nodes


def parse_steps(text: str) -> dict[str, str]:
    """``squeue -h -s -o '%i|%j'`` lines (``7.0|name``) -> {step name: step id}; the batch and
    extern steps are left out (they are no node of ours)."""
    steps: dict[str, str] = {}
    for line in text.splitlines():
        step_id, sep, name = line.strip().partition("|")
        if not sep or "." not in step_id:
            continue
        if step_id.rsplit(".", 1)[1] in ("batch", "extern", "interactive"):
            continue
        steps[name.strip()] = step_id
    return steps


def hostnames(nodelist: str) -> list[str]:
    """``node[1-3],gpu7`` -> the node names, in Slurm's order (``scontrol show hostnames``)."""
    if not nodelist.strip():
        return []
    return run(["scontrol", "show", "hostnames", nodelist]).split()


def node_states(names: Sequence[str] | None = None) -> dict[str, NodeStatus]:
    args = ["sinfo", "-h", "-N", "-o", "%N|%T|%E"]
    if names:
        args += ["-n", ",".join(names)]
    return parse_node_states(run(args))


def parse_node_addresses(text: str) -> dict[str, str]:
    """``sinfo -h -N -o '%N|%o'`` lines (``node1|10.0.0.11``) -> {name: NodeAddr}; a node
    listed twice keeps its first line, lines of another form are skipped."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, address = line.strip().partition("|")
        if sep and name and address.strip():
            found.setdefault(name, address.strip())
    return found


def node_addresses(names: Sequence[str]) -> list[str]:
    """Where Slurm reaches each of ``names`` (its ``NodeAddr``, which is the node's name
    unless slurm.conf says otherwise), in order."""
    if not names:
        return []
    found = parse_node_addresses(run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N|%o"]))
    return [found.get(name, name) for name in names]


def job_steps(job_id: str) -> dict[str, str]:
    return parse_steps(run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"]))


def job_nodes(job_id: str) -> list[str]:
    """The nodes of a running job, in order; an error naming the job when it is not running."""
    line = run(["squeue", "-h", "-j", job_id, "-o", "%T|%N"]).strip()
    state, _, nodelist = line.partition("|")
    if not line:
        raise SlurmCommandError(
            f"Slurm job {job_id} does not exist (or has ended): run planaria inside a running "
            "allocation (sbatch, salloc), or use `planaria submit`"
        )
    if state != "RUNNING":
        raise SlurmCommandError(
            f"Slurm job {job_id} is {state.lower()}, not running: its nodes are not allocated yet"
        )
    return hostnames(nodelist)


NO_TOPOLOGY = "No topology information available"
"""What ``scontrol show topology`` says (on stderr, exit 0) where no topology plugin is
configured: no node has a label then, and that is no error."""


@dataclass(frozen=True)
class TopologyGroup:
    """A leaf switch (topology/tree) or a block (topology/block), as ``scontrol show
    topology`` lists it."""

    label: str
    """The label it gives its nodes: ``switch`` or ``block``."""
    name: str
    nodes: str
    """Its nodes as a Slurm hostlist expression (``node[1-2]``): :func:`hostnames` expands it."""


def parse_topology(stdout: str, stderr: str = "") -> list[TopologyGroup]:
    """``scontrol show topology`` -> the groups nodes are labelled with: the leaf switches
    (``SwitchName=s1 Level=0 ... Nodes=node[1-2]``; a switch of a higher level joins leaf
    switches and labels no node) and the blocks (``BlockName=b1 BlockIndex=0
    Nodes=node[1-4] BlockSize=4``). No topology plugin (:data:`NO_TOPOLOGY`): none. Anything
    else on stderr with nothing on stdout is an error, with scontrol's message."""
    groups: list[TopologyGroup] = []
    for line in stdout.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part and part[0] != "=")
        nodes = fields.get("Nodes", "")
        if not nodes or nodes == "(null)":
            continue
        if fields.get("SwitchName") and fields.get("Level", "0") == "0":
            groups.append(TopologyGroup("switch", fields["SwitchName"], nodes))
        elif fields.get("BlockName"):
            groups.append(TopologyGroup("block", fields["BlockName"], nodes))
    message = " ".join(line.strip() for line in stderr.splitlines() if line.strip())
    if not groups and not stdout.strip() and message and NO_TOPOLOGY not in message:
        raise SlurmCommandError(f"scontrol show topology failed: {message}")
    return groups


def topology_labels(
    groups: Sequence[TopologyGroup], names: Sequence[str], expand: Callable[[str], list[str]]
) -> dict[str, dict[str, str]]:
    """Node name -> its labels (``{"switch": "s1"}``), for the nodes in ``names`` only; a
    node in two groups of one label keeps the first. ``expand`` turns a hostlist expression
    into node names (:func:`hostnames`, one ``scontrol show hostnames`` a group)."""
    wanted = set(names)
    labels: dict[str, dict[str, str]] = {}
    for group in groups:
        for node in expand(group.nodes):
            if node in wanted:
                labels.setdefault(node, {}).setdefault(group.label, group.name)
    return labels


def node_topology(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """Where Slurm's topology plugin puts each of ``names``: its leaf switch (``switch``)
    or block (``block``); none without a topology plugin. One ``scontrol show topology``,
    and one ``scontrol show hostnames`` a group."""
    if not names:
        return {}
    groups = parse_topology(*run_both(["scontrol", "show", "topology"]))
    return topology_labels(groups, names, hostnames)
