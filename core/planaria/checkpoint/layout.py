"""How a state dict becomes raw tensor bytes plus a small JSON record, and back.

A state is a tree of dicts, lists and tuples whose leaves are tensors or small plain values.
:func:`plan` walks it once and returns a :class:`Layout`: every tensor gets an aligned byte range
in one flat buffer, and the tree itself is encoded as JSON in which each tensor is a reference
``{"T": index}``. Tensor data is never pickled; plain values travel in the JSON with tags for
what JSON cannot say (``{"t": [...]}`` a tuple, ``{"d": [[key, value], ...]}`` a dict whose keys
are not all strings, ``{"b": base64}`` bytes, ``{"dtype": "float32"}`` a dtype).

A ``DTensor`` (FSDP2, tensor parallel) is stored as its local shard plus where that shard sits in
the global tensor (``global_shape``, ``offset``), which is what loading into a different sharding
needs.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64
"""Byte alignment of every tensor in the flat buffer (a cache line; also any dtype's size)."""

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


class LayoutError(TypeError):
    """A value that a flash checkpoint cannot hold; the message names its path in the state."""


_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise LayoutError(f"tensors of dtype {dtype} cannot be saved in a flash checkpoint")
    return name


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutError(f"unknown tensor dtype {name!r} in checkpoint metadata") from None


@dataclass(slots=True)  # not frozen: a save builds hundreds, and frozen init is slower
class TensorEntry:
    """One tensor's place in the flat buffer."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    global_shape: tuple[int, ...] | None = None
    """Set for a DTensor's local shard: the shape of the whole tensor..."""
    global_offset: tuple[int, ...] | None = None
    """...and where this shard starts in it."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }
        if self.global_shape is not None:
            out["global_shape"] = list(self.global_shape)
            out["global_offset"] = list(self.global_offset or ())
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TensorEntry:
        shape = tuple(int(x) for x in raw["shape"])
        dtype = str(raw["dtype"])
        nbytes = int(raw["nbytes"])
        expected = math.prod(shape) * dtype_of(dtype).itemsize
        if nbytes != expected or int(raw["offset"]) < 0:
            raise ValueError(
                f"tensor {raw.get('path')!r}: {nbytes} bytes recorded, {expected} expected for "
                f"{dtype}{list(shape)} at offset {raw['offset']}"
            )
        gshape = raw.get("global_shape")
        goffset = raw.get("global_offset")
        return cls(
            path=str(raw["path"]),
            dtype=dtype,
            shape=shape,
            offset=int(raw["offset"]),
            nbytes=nbytes,
            global_shape=tuple(int(x) for x in gshape) if gshape is not None else None,
            global_offset=tuple(int(x) for x in goffset) if goffset is not None else None,
        )


@dataclass
class Layout:
    """A state's tensors (in order) and its tree as JSON."""

    tree: Any
    entries: list[TensorEntry] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    """The tensors to copy, in entry order (local shards for DTensors)."""

    @property
    def data_bytes(self) -> int:
        if not self.entries:
            return 0
        last = self.entries[-1]
        return _align(last.offset + last.nbytes)

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """What must match for a reused buffer to fit the same offsets."""
        return tuple((e.path, e.dtype, e.shape) for e in self.entries)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def local_offset(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, global offset of the local shard) of a DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(value.shape), tuple(int(x) for x in offset)


def plan(state: Any) -> Layout:
    """The layout of ``state``; :class:`LayoutError` naming the path of anything unsupported."""
    layout = Layout(tree=None)
    offset = 0

    def add(path: str, tensor: torch.Tensor, dtensor: Any = None) -> dict[str, int]:
        nonlocal offset
        if tensor.layout != torch.strided:
            raise LayoutError(f"{path}: sparse tensors cannot be saved in a flash checkpoint")
        nbytes = tensor.numel() * tensor.element_size()
        gshape = goffset = None
        if dtensor is not None:
            gshape, goffset = local_offset(dtensor)
        entry = TensorEntry(
            path, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes, gshape, goffset
        )
        offset = _align(offset + nbytes)
        layout.entries.append(entry)
        layout.tensors.append(tensor)
        return {"T": len(layout.entries) - 1}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if _is_dtensor(value):
                return add(path, value.to_local(), value)  # type: ignore[attr-defined]
            return add(path, value)
        if value is None or isinstance(value, (bool, int, float, str)):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 63:
                return {"i": str(value)}
            return value
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):
                out = {k: walk(v, f"{path}.{k}" if path else k) for k, v in value.items()}
                # A string-keyed dict that looks like a tag would be misread: wrap it.
                return {"d": [[k, v] for k, v in out.items()]} if _looks_tagged(out) else out
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                    raise LayoutError(
                        f"{path or 'state'}: dict key {k!r} of type {type(k).__name__} cannot "
                        "be saved (keys must be str, int, float, bool, None or tuples of them)"
                    )
                items.append([walk(k, f"{path}[{k!r}]"), walk(v, f"{path}[{k!r}]")])
            return {"d": items}
        if isinstance(value, torch.Size):
            return {"t": [int(x) for x in value]}
        if isinstance(value, tuple):
            return {"t": [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, (bytes, bytearray)):
            return {"b": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, torch.dtype):
            return {"dtype": dtype_name(value)}
        raise LayoutError(
            f"{path or 'state'}: a value of type {type(value).__name__} cannot be saved in a "
            "flash checkpoint (tensors, dicts, lists, tuples, str, int, float, bool, None, "
            "bytes and dtypes can)"
        )

    layout.tree = walk(state, "")
    return layout


_TAGS = {"T", "t", "d", "b", "i", "dtype"}


def _looks_tagged(obj: dict[str, Any]) -> bool:
    return len(obj) == 1 and next(iter(obj)) in _TAGS


def rebuild(tree: Any, tensor: Callable[[int, Any], Any], template: Any = None) -> Any:
    """The state encoded by ``tree``. ``tensor(index, old)`` supplies each tensor, where ``old``
    is the value at the same place in ``template`` (None if it has none there)."""

    def child(tmpl: Any, key: Any) -> Any:
        if isinstance(tmpl, dict):
            return tmpl.get(key)
        if isinstance(tmpl, (list, tuple)) and isinstance(key, int) and 0 <= key < len(tmpl):
            return tmpl[key]
        return None

    def walk(value: Any, tmpl: Any) -> Any:
        if isinstance(value, list):
            return [walk(v, child(tmpl, i)) for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((tag, inner),) = value.items()
            if tag == "T":
                return tensor(int(inner), tmpl)
            if tag == "t":
                return tuple(walk(v, child(tmpl, i)) for i, v in enumerate(inner))
            if tag == "d":
                out = {}
                for k, v in inner:
                    key = _hashable(walk(k, None))
                    out[key] = walk(v, child(tmpl, key))
                return out
            if tag == "b":
                return base64.b64decode(inner)
            if tag == "i":
                return int(inner)
            if tag == "dtype":
                return dtype_of(inner)
        return {k: walk(v, child(tmpl, k)) for k, v in value.items()}

    return walk(tree, template)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
