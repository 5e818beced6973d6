"""Parsers of npu-smi's output: the ``npu-smi info`` tables and the ``-t`` key/value queries.

``npu-smi info`` prints box tables (shortened here)::

    +-------------------+-------------+--------------------------------------------+
    | NPU   Name        | Health      | Power(W)    Temp(C)   Hugepages-Usage(page)|
    | Chip              | Bus-Id      | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)|
    +===================+=============+============================================+
    | 0     910B3       | OK          | 93.6        36        0    / 0             |
    | 0                 | 0000:C1:00.0| 0           0    / 0  3379 / 65536         |
    +===================+=============+============================================+

Each device takes two rows laid out like the two header rows; the columns inside a cell are
named by the header and separated by spaces (``0    / 0`` is one value). Models differ in their
columns (310P adds ``Device``, A3 boards ``Phy-ID``, older ones have no ``HBM-Usage``), so cells
are read by the names in the header, not by position. Lines outside the tables are ignored;
a row inside a table that does not fit its header is an error naming the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SLASH = re.compile(r"\s*/\s*")
_VERSION = re.compile(r"npu-smi\s+(\S+)", re.IGNORECASE)
_NO_PROCESSES = re.compile(r"^No running processes found in NPU\s+(\d+)", re.IGNORECASE)


class NpuSmiParseError(ValueError):
    """npu-smi printed something this parser cannot read."""


@dataclass(frozen=True)
class Chip:
    """One row pair of the device table: one NPU chip (a torch device)."""

    npu: int
    chip: int
    name: str
    health: str
    line: int
    fields: dict[str, str] = field(default_factory=dict)
    """Every column by its header name, as printed (``"Temp(C)": "36"``)."""

    def number(self, *names: str) -> float | None:
        """The first of ``names`` that holds a number (``NA`` and ``-`` hold none)."""
        for name in names:
            raw = self.fields.get(name.lower())
            if raw is None:
                continue
            try:
                return float(raw)
            except ValueError:
                continue
        return None

    def usage(self, name: str) -> tuple[float, float] | None:
        """``"3379/65536"`` -> ``(3379.0, 65536.0)``."""
        raw = self.fields.get(name.lower())
        if raw is None or "/" not in raw:
            return None
        used, _, total = raw.partition("/")
        try:
            return float(used), float(total)
        except ValueError:
            return None


@dataclass(frozen=True)
class Process:
    npu: int
    chip: int
    pid: int
    name: str
    memory_mb: float | None


@dataclass
class Info:
    version: str | None = None
    chips: list[Chip] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") else body
    return [cell.strip() for cell in body.split("|")]


def _tokens(cell: str) -> list[str]:
    return _SLASH.sub("/", cell).split()


def _is_header(cells: list[str], first: str, second: str) -> bool:
    words = [w.lower() for w in _tokens(cells[0])] if cells else []
    return words[:2] == [first, second]


class _Layout:
    """The column names of the two header rows, per cell."""

    def __init__(self, first: list[str], second: list[str]) -> None:
        self.rows = ([_tokens(c) for c in first], [_tokens(c) for c in second])

    def read(self, row: int, cells: list[str], number: int, line: str) -> dict[str, str]:
        names = self.rows[row]
        if len(cells) != len(names):
            raise NpuSmiParseError(
                f"line {number}: expected {len(names)} cells like the header, "
                f"found {len(cells)}: {line.strip()!r}"
            )
        values: dict[str, str] = {}
        for cell_names, cell in zip(names, cells, strict=True):
            tokens = _tokens(cell)
            if len(tokens) != len(cell_names):
                raise NpuSmiParseError(
                    f"line {number}: cell {cell!r} holds {len(tokens)} value(s) but its header "
                    f"names {len(cell_names)} ({' '.join(cell_names)}): {line.strip()!r}"
                )
            values.update((n.lower(), t) for n, t in zip(cell_names, tokens, strict=True))
        return values


def _int(value: str | None, what: str, number: int, line: str) -> int:
    try:
        return int(value or "")
    except ValueError:
        raise NpuSmiParseError(
            f"line {number}: {what} {value!r} is not a number: {line.strip()!r}"
        ) from None


def parse_info(text: str) -> Info:
    """Parse ``npu-smi info``. Raises :class:`NpuSmiParseError` naming the line it cannot read,
    or saying that no device table was found."""
    info = Info()
    lines = text.splitlines()
    state = "outside"
    header: list[list[str]] = []
    layout: _Layout | None = None
    pending: tuple[int, str, dict[str, str]] | None = None
    found_table = False
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped.startswith(("|", "+")):
            continue  # text around the tables: warnings, blank lines, other tools' output
        if stripped.startswith("+"):
            continue  # a border: +----+ or +====+
        cells = _cells(stripped)
        if info.version is None and len(cells) == 1 and (match := _VERSION.search(cells[0])):
            info.version = match.group(1)
            continue
        if _is_header(cells, "npu", "name"):
            state, header, found_table = "device-header", [cells], True
            continue
        if _is_header(cells, "npu", "chip"):
            if pending is not None:
                raise NpuSmiParseError(
                    f"line {pending[0]}: the device row has no second row: {pending[1].strip()!r}"
                )
            state = "processes"
            continue
        if state == "device-header":
            header.append(cells)
            layout = _Layout(header[0], header[1])
            state = "devices"
            continue
        if state == "devices":
            assert layout is not None
            if pending is None:
                pending = (number, line, layout.read(0, cells, number, line))
                continue
            first_number, first_line, first = pending
            second = layout.read(1, cells, number, line)
            pending = None
            merged = {**first, **second}
            info.chips.append(
                Chip(
                    npu=_int(first.get("npu"), "NPU id", first_number, first_line),
                    chip=_int(second.get("chip"), "chip id", number, line),
                    name=first.get("name", ""),
                    health=first.get("health", ""),
                    line=first_number,
                    fields=merged,
                )
            )
            continue
        if state == "processes":
            if len(cells) == 1 and _NO_PROCESSES.match(cells[0]):
                continue
            info.processes.append(_process(cells, number, line))
            continue
        # A row of a table this parser does not know: ignored.
    if pending is not None:
        raise NpuSmiParseError(
            f"line {pending[0]}: the device row has no second row: {pending[1].strip()!r}"
        )
    if not found_table:
        opening = next((ln.strip() for ln in lines if ln.strip()), "")
        raise NpuSmiParseError(
            "no device table (a header row starting with 'NPU  Name') in the output"
            + (f"; it begins with {opening[:120]!r}" if opening else "; the output is empty")
        )
    missing = [c for c in ("health",) if info.chips and c not in info.chips[0].fields]
    if missing:
        raise NpuSmiParseError(
            f"line {info.chips[0].line}: the device table has no {missing[0]!r} column"
        )
    return info


def _process(cells: list[str], number: int, line: str) -> Process:
    if len(cells) != 4:
        raise NpuSmiParseError(
            f"line {number}: a process row has 4 cells (NPU Chip | pid | name | memory), "
            f"found {len(cells)}: {line.strip()!r}"
        )
    ids = cells[0].split()
    if len(ids) != 2:
        raise NpuSmiParseError(f"line {number}: expected 'NPU Chip' ids: {line.strip()!r}")
    try:
        memory: float | None = float(cells[3])
    except ValueError:
        memory = None
    return Process(
        npu=_int(ids[0], "NPU id", number, line),
        chip=_int(ids[1], "chip id", number, line),
        pid=_int(cells[1], "process id", number, line),
        name=cells[2],
        memory_mb=memory,
    )


def parse_fields(text: str) -> dict[str, str]:
    """Parse the ``Key : value`` lines of ``npu-smi info -t ...`` (keys as printed, the first
    occurrence wins). Raises :class:`NpuSmiParseError` when there is not one such line."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields.setdefault(key.strip(), value.strip())
    if not fields:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        raise NpuSmiParseError(
            "no 'Key : value' line in the output"
            + (f"; it begins with {first[:120]!r}" if first else "; the output is empty")
        )
    return fields


def field_number(fields: dict[str, str], *keys: str) -> float | None:
    """The first of ``keys`` holding a number; ``NA`` means not reported."""
    for key in keys:
        raw = fields.get(key)
        if raw is None:
            continue
        try:
            return float(raw.split()[0]) if raw.split() else None
        except ValueError:
            continue
    return None
