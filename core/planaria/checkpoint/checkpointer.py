"""The training side of the flash checkpoint: :class:`Checkpointer`.

What stands alone lives beside it: reading a step back from memory or storage (resharding
included) is :mod:`planaria.checkpoint.restore`'s, the link to the persister and its failures
:mod:`planaria.checkpoint.persister_client`'s.

Why one module: what is left is the one object a training script holds, and its parts share
one state: the segment, the views of its slots that the next save reuses, and the save whose
copies are still in flight, which :meth:`Checkpointer.load`, :meth:`Checkpointer.wait` and
:meth:`Checkpointer.close` must complete first. Split, each part would reach into the others.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planaria import monitor
from planaria.checkpoint import restore
from planaria.checkpoint.device import Device, Done, device_for
from planaria.checkpoint.env import (
    KEEP_LAST_ENV,
    PERSIST_EVERY_ENV,
    PERSISTER_TIMEOUT_ENV,
    REQUIRE_RESTORE_ENV,
    RESTORE_ENV,
    SEGMENT_ENV,
    SOCKET_ENV,
    STORAGE_ENV,
)
from planaria.checkpoint.layout import Layout, dtype_of, plan
from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.checkpoint.persister import SOCKET_DIR_KIND
from planaria.checkpoint.persister_client import PersisterClient
from planaria.checkpoint.segment import SHM_DIR, SLOTS, Segment, SegmentBusyError, SegmentError
from planaria.errors import StorageError
from planaria.log import get_logger
from planaria.shm import make_temp_dir, name_prefix, remove_dir

log = get_logger("checkpoint")


META_RESERVE = 1 << 20
"""Room for the metadata beyond what the first save needs (it grows a little with the step)."""
PERSISTER_TIMEOUT = 5.0
"""The most seconds a save waits for the persister, by default."""


@dataclass
class _Copy:
    """A save whose copies are enqueued: its slot stays held until they are done."""

    step: int
    segment: Segment
    slot: int
    held: contextlib.ExitStack
    dones: list[Done]
    devices: list[Device]
    data_len: int
    meta: bytes
    rank: int
    world: int
    persist: bool | None
    loss: float | None = None
    tokens: float | None = None


def storage_spec(target: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """``{backend, options}`` for a path (``local``), a URL (``fsspec``) or a spec as is."""
    if isinstance(target, dict):
        return target
    text = os.fspath(target)
    if "://" in text and not text.startswith("file://"):
        return {"backend": "fsspec", "options": {"url": text}}
    path = text.removeprefix("file://")
    return {"backend": "local", "options": {"path": str(Path(path).absolute())}}


class Checkpointer:
    """Save a training state to shared memory every step; persist it in the background.

    ``storage`` is a directory, an fsspec URL (``s3://bucket/run``, with ``planaria-fsspec``
    installed) or a ``{backend, options}`` mapping; under ``planaria run`` it defaults to the job's
    ``checkpoint.storage``. ``persist_every`` (default: the job's ``checkpoint.persist_every``)
    decides which saves are also persisted when :meth:`save` is not told.

    Under ``planaria run`` the agent hosts the shared memory and the persister, so a restarted
    worker restores from memory. Standalone (torchrun, one process), the checkpointer starts
    its own persister process, and restores from storage after a restart.

    ``require_restore`` (default: the job's ``checkpoint.require_restore``): when committed steps
    exist but none verifies, :meth:`load` raises :class:`CheckpointRestoreError` instead of
    returning None (a start from scratch).

    ``persister_timeout`` (default: the job's ``checkpoint.persister_timeout``, else 5 s): the
    most a save waits for the persister; one that does not answer is replaced (standalone by
    this checkpointer, under ``planaria run`` by the agent) and training goes on.

    ``device``: the :class:`~planaria.checkpoint.device.Device` that copies every tensor (a
    test's fake); by default each tensor's own device's.
    """

    def __init__(
        self,
        storage: str | os.PathLike[str] | dict[str, Any] | None = None,
        *,
        keep_last: int | None = None,
        persist_every: int | None = None,
        require_restore: bool | None = None,
        persister_timeout: float | None = None,
        device: Device | None = None,
    ) -> None:
        env_storage = os.environ.get(STORAGE_ENV)
        if storage is None and env_storage is None:
            raise StorageError(
                "Checkpointer needs a storage: a directory, a URL or {backend, options} "
                "(under planaria run it comes from the job's checkpoint.storage)"
            )
        self.spec = storage_spec(storage) if storage is not None else json.loads(env_storage or "")
        self.keep_last = keep_last or int(os.environ.get(KEEP_LAST_ENV, "3"))
        every = persist_every or int(os.environ.get(PERSIST_EVERY_ENV, "0") or 0)
        self.persist_every = every
        if require_restore is None:
            require_restore = os.environ.get(REQUIRE_RESTORE_ENV, "") == "1"
        self.require_restore = require_restore
        if persister_timeout is None:
            persister_timeout = float(
                os.environ.get(PERSISTER_TIMEOUT_ENV, "") or PERSISTER_TIMEOUT
            )
        if not persister_timeout > 0:
            raise ValueError(f"persister_timeout must be > 0 seconds, not {persister_timeout}")
        self.persister_timeout = persister_timeout
        self._device = device
        self._copying: _Copy | None = None
        """The save whose copies are enqueued and not yet known done (``blocking=False``)."""
        self.managed = SOCKET_ENV in os.environ and SEGMENT_ENV in os.environ
        self._segment: Segment | None = None
        self._prefault_after_save = False
        self._wrote = False
        """Whether this process saved into the segment (its pages are mapped here)."""
        self._signature: tuple[Any, ...] | None = None
        """The layout of the last save; while it stays the same, its views and metadata are
        reused."""
        self._tensors_json = b"[]"
        self._views_segment: Segment | None = None
        self._views: dict[int, list[torch.Tensor | None]] = {}
        self._store: PersistedCheckpoints | None = None
        self._rejected: dict[int, str] = {}
        """Committed steps a restore rejected, and why (the persister never counts them)."""
        self._private: Path | None = None
        """Standalone: this checkpointer's own 0700 directory in /dev/shm (segment, socket)."""
        self.restored_from: str | None = None
        """``"memory"`` or ``"storage"`` after a :meth:`load` that found a step."""
        if self.managed:
            self.segment_path = Path(os.environ[SEGMENT_ENV])
        else:
            # A fresh private directory with an unpredictable name: nobody else can put a
            # link or a file where this process will write.
            self._private = make_temp_dir(name_prefix() + SOCKET_DIR_KIND, SHM_DIR)
            self.segment_path = self._private / f"rank-{self.rank}.ckpt"
        self._persister = PersisterClient(
            spec=self.spec,
            keep_last=self.keep_last,
            segment_path=self.segment_path,
            managed=self.managed,
            timeout=self.persister_timeout,
            directory=self._private,
            segment=lambda: self._segment,
            store=lambda: self.store,
            rejected=self._rejected,
        )
        if not self.managed:
            atexit.register(self.close)

    # -- identity ------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return int(os.environ.get("RANK", "0"))

    @property
    def world(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def store(self) -> PersistedCheckpoints:
        if self._store is None:
            self._store = PersistedCheckpoints.open(self.spec, self.keep_last)
        return self._store

    # -- saving --------------------------------------------------------------------------------

    def prepare(self, state: Any) -> None:
        """Allocate and pre-fault the shared memory for ``state``'s layout in the background,
        so that the first :meth:`save` copies at memory speed. Optional."""
        self.wait_copy()
        layout = plan(state)
        segment = self._ensure_segment(layout, len(_meta_bytes(layout, 0)), background=True)
        for device in self._devices(layout.tensors):
            segment.register_host(device, background=True)

    def _devices(self, tensors: list[torch.Tensor]) -> list[Device]:
        """The devices that copy these tensors, in order of first use."""
        if self._device is not None:
            return [self._device]
        found: dict[tuple[str, int | None], Device] = {}
        for tensor in tensors:
            key = (tensor.device.type, tensor.device.index)
            if key not in found:
                found[key] = device_for(tensor.device)
        return list(found.values())

    def _ensure_segment(self, layout: Layout, meta_len: int, *, background: bool) -> Segment:
        needed = layout.data_bytes + meta_len
        segment = self._segment
        if segment is not None and segment.capacity >= needed:
            return segment
        if segment is None and self.segment_path.exists():
            with contextlib.suppress(OSError, SegmentError):
                reused = Segment.open(self.segment_path, writable=True)
                if reused.capacity >= needed:
                    reused.prefault(fresh=False, background=background)
                    self._segment = reused
                    return reused
                reused.close()
        if segment is not None:
            self._views, self._views_segment = {}, None  # views would keep the old map open
            segment.close()
        capacity = layout.data_bytes + max(META_RESERVE, 2 * meta_len)
        self._segment = Segment.create(self.segment_path, capacity)
        if background:  # ahead of time (prepare): both slots
            self._segment.prefault(fresh=True, background=True)
        else:
            # In a save: the save itself touches slot 0 (a new segment's first save goes
            # there); slot 1 is readied once it returns, not meanwhile (the two would compete
            # for the same memory bandwidth and cores).
            self._prefault_after_save = True
        return self._segment

    def save(
        self,
        step: int,
        state: Any,
        persist: bool | None = None,
        blocking: bool = True,
        loss: float | None = None,
        tokens: float | None = None,
    ) -> None:
        """Copy ``state`` into shared memory (training blocks only for this copy), report the
        step to the agent (with its training ``loss`` and the ``tokens`` the job processed in
        it, when given: see :func:`planaria.monitor.step`), and hand it to the persister when
        ``persist`` (default: every ``persist_every`` steps).

        ``blocking=False``: enqueue the copies of device tensors on a side stream and return at
        once; the save completes (the step is published in memory, reported and handed to the
        persister) once they are done, which the next :meth:`save`, :meth:`wait_copy`,
        :meth:`wait`, :meth:`load` or :meth:`close` waits for. Nothing may change the state's
        tensors meanwhile: :meth:`guard` makes the optimizer (and the modules given) wait.
        Tensors in host memory are copied before it returns, as with ``blocking=True``."""
        if loss is not None:  # a wrong one fails here, not in a later call that completes it
            loss = monitor.loss_value(loss, step)
        if tokens is not None:
            tokens = monitor.tokens_value(tokens, step)
        self.wait_copy()
        layout = plan(state)
        signature = layout.signature()
        same = signature == self._signature
        if not same:
            self._tensors_json = _tensors_json(layout)
        meta = _meta_bytes(layout, step, self._tensors_json)
        segment = self._ensure_segment(layout, len(meta), background=False)
        if not same or segment is not self._views_segment:
            self._signature, self._views_segment, self._views = signature, segment, {}
        held = contextlib.ExitStack()
        try:
            slot, view = held.enter_context(segment.writing(self.persister_timeout))
        except SegmentBusyError as exc:
            # The persister holds every other slot and stopped answering: training goes on,
            # the newest step in memory stays; the persister is being replaced.
            log.warning("save skipped: the persister holds the memory", step=step, error=str(exc))
            monitor.step(step, loss=loss, tokens=tokens)
            return
        try:
            # The same layout as the last save (the usual case): reuse the slot's views.
            targets = self._views.get(slot)
            if targets is None:
                targets = self._views[slot] = [
                    view[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
                    if e.nbytes
                    else None
                    for e in layout.entries
                ]
            devices: dict[int, Device] = {}
            fixed = self._device
            for target, tensor in zip(targets, layout.tensors, strict=True):
                if target is None:
                    continue
                if fixed is None and tensor.is_cpu:
                    target.copy_(tensor)
                    continue
                device = fixed or device_for(tensor.device)
                if id(device) not in devices:
                    devices[id(device)] = device
                    device.start()
                device.copy(target, tensor)
            dones = [device.finish() for device in devices.values()]
        except BaseException:
            held.close()
            raise
        self._copying = _Copy(
            step,
            segment,
            slot,
            held,
            dones,
            list(devices.values()),
            layout.data_bytes,
            meta,
            self.rank,
            self.world,
            persist,
            loss,
            tokens,
        )
        if blocking or all(done.query() for done in dones):
            self.wait_copy()

    def wait_copy(self) -> None:
        """Wait until the copies of a ``save(..., blocking=False)`` are done, and complete
        that save (publish the step in memory, report it, hand it to the persister)."""
        copy, self._copying = self._copying, None
        if copy is None:
            return
        segment = copy.segment
        try:
            for done in copy.dones:
                done.wait()
            segment.publish(
                copy.slot,
                step=copy.step,
                rank=copy.rank,
                world=copy.world,
                data_len=copy.data_len,
                meta=copy.meta,
            )
        finally:
            copy.held.close()
        self._wrote = True
        if self._prefault_after_save:
            self._prefault_after_save = False
            segment.prefault(fresh=True, background=True, slots=tuple(range(1, SLOTS)))
        for device in copy.devices:  # in the background, off the training path
            segment.register_host(device, background=True)
        persist = copy.persist
        if persist is None:
            persist = self.persist_every > 0 and copy.step % self.persist_every == 0
        if persist:
            self._persister.persist(copy.step)
        monitor.step(copy.step, loss=copy.loss, tokens=copy.tokens)

    def guard(self, optimizer: Any, *modules: Any) -> list[Any]:
        """Keep an overlapped save (``blocking=False``) consistent: ``optimizer.step()`` and
        the forward pass of each of ``modules`` run only after the pending save's copies (on a
        GPU the device orders them, the host does not wait). The optimizer changes the
        parameters and its state; a forward pass changes buffers such as BatchNorm's running
        statistics: pass the model for those. Returns the hooks' handles (``.remove()``)."""

        def before(*_: Any) -> None:
            self._order_copy()

        handles = [optimizer.register_step_pre_hook(before)]
        handles.extend(module.register_forward_pre_hook(before) for module in modules)
        return handles

    def _order_copy(self) -> None:
        copy = self._copying
        if copy is None:
            return
        if all(done.query() for done in copy.dones):
            self.wait_copy()  # done already: complete it now, for free
            return
        for done in copy.dones:
            done.order()

    # -- the persister -------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every step handed to the persister is durable (and, on rank 0,
        committed). What failed: standalone, a :class:`StorageError`; under ``planaria run``
        a warning, because the persister reported it to the job already, whose end says
        whether its last step was persisted (``checkpoint.allow_unpersisted_end``): a
        failed persist is no reason to restart the workers."""
        self.wait_copy()
        self._persister.wait()

    def close(self) -> None:
        """Wait for pending persists; standalone, stop the persister and free the memory."""
        try:
            self.wait_copy()
        except Exception as exc:  # the memory is freed all the same
            log.warning("the last save did not complete", error=str(exc))
            copy, self._copying = self._copying, None
            if copy is not None:
                copy.held.close()
        with contextlib.suppress(StorageError, OSError):
            self.wait()
        self._persister.close()
        self._views, self._views_segment = {}, None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if not self.managed:
            with contextlib.suppress(FileNotFoundError):
                self.segment_path.unlink()
        self._persister.remove_socket()  # a persister that was killed leaves its socket
        if self._private is not None:
            remove_dir(self._private)
            self._private = None

    # -- loading -------------------------------------------------------------------------------

    def load(self, state: Any = None) -> tuple[int, Any] | None:
        """The newest step every rank can restore: from shared memory when every rank holds
        it, else the newest committed step that verifies. Tensors of ``state`` (a template,
        e.g. ``{"model": model.state_dict(), ...}``) are filled in place; others are new.
        None when there is nothing to restore."""
        self.wait_copy()
        started = time.perf_counter()
        self.restored_from = None
        step = self._memory_step()
        if step is not None:
            try:
                restored = self._load_memory(step, state)
            except (LookupError, SegmentError, ValueError) as exc:
                log.warning("memory restore failed; using storage", step=step, error=str(exc))
            else:
                self.restored_from = "memory"
                log.info(
                    "restored from memory",
                    step=step,
                    seconds=round(time.perf_counter() - started, 4),
                )
                return step, restored
        result = restore.from_storage(
            self.store,
            state,
            rank=self.rank,
            world=self.world,
            rejected=self._rejected,
            report=self._persister.report,
            require_restore=self.require_restore,
            where=_where(self.spec),
        )
        if result is not None:
            self.restored_from = "storage"
            log.info(
                "restored from storage",
                step=result[0],
                seconds=round(time.perf_counter() - started, 4),
            )
        return result

    def _open_segment(self) -> Segment | None:
        if self._segment is None and self.segment_path.exists():
            try:
                self._segment = Segment.open(self.segment_path, writable=True)
            except (OSError, SegmentError) as exc:
                log.warning("ignoring shared memory", path=str(self.segment_path), error=str(exc))
                return None
        return self._segment

    def _memory_step(self) -> int | None:
        if RESTORE_ENV in os.environ:  # decided by the master for every rank at once
            kind, _, value = os.environ[RESTORE_ENV].partition(":")
            return int(value) if kind == "memory" and value.lstrip("-").isdigit() else None
        return restore.agreed_memory_step(self._open_segment(), self.rank, self.world)

    def _load_memory(self, step: int, template: Any) -> Any:
        segment = self._open_segment()
        if segment is None:
            raise LookupError(f"no shared memory at {self.segment_path}")
        return restore.from_memory(
            segment,
            step,
            template,
            rank=self.rank,
            world=self.world,
            device=self._device,
            mapped=self._wrote,
        )


def _where(spec: dict[str, Any]) -> str:
    options = spec.get("options") or {}
    return str(options.get("path") or options.get("url") or spec.get("backend"))


def _tensors_json(layout: Layout) -> bytes:
    return json.dumps([e.to_json() for e in layout.entries], separators=(",", ":")).encode()


def _meta_bytes(layout: Layout, step: int, tensors: bytes | None = None) -> bytes:
    """The slot's metadata: ``{"tensors": [...], "tree": ..., "step": N}``."""
    tree = json.dumps(layout.tree, separators=(",", ":")).encode()
    tensors = _tensors_json(layout) if tensors is None else tensors
    return b'{"tensors":' + tensors + b',"tree":' + tree + b',"step":' + str(step).encode() + b"}"
