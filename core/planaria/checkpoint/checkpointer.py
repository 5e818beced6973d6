"""The training side of the flash checkpoint: :class:`Checkpointer`."""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import select
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planaria import monitor, process
from planaria.checkpoint import persister
from planaria.checkpoint.device import Device, Done, device_for
from planaria.checkpoint.env import (
    GENERATION_ENV,
    KEEP_LAST_ENV,
    PERSIST_EVERY_ENV,
    PERSISTER_TIMEOUT_ENV,
    REQUIRE_RESTORE_ENV,
    RESTORE_ENV,
    SEGMENT_ENV,
    SOCKET_ENV,
    STORAGE_ENV,
)
from planaria.checkpoint.layout import Layout, TensorEntry, dtype_of, plan, rebuild
from planaria.checkpoint.persisted import Manifest, PersistedCheckpoints, ShardRecord
from planaria.checkpoint.persister import SOCKET_DIR_KIND
from planaria.checkpoint.segment import SHM_DIR, SLOTS, Segment, SegmentBusyError, SegmentError
from planaria.errors import CheckpointCorruptError, CheckpointRestoreError, StorageError
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
        self._lost = False
        """Under ``planaria run``: the persister stopped answering; the next connection hands
        the agent's new one what was pending."""
        self._copying: _Copy | None = None
        """The save whose copies are enqueued and not yet known done (``blocking=False``)."""
        self.managed = SOCKET_ENV in os.environ and SEGMENT_ENV in os.environ
        self._segment: Segment | None = None
        self._announced: Segment | None = None
        """The segment the persister has open."""
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
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._pending: collections.deque[int] = collections.deque(maxlen=3)
        """Steps handed to the persister since it last said ``idle``: a restarted persister
        is asked for them again (older ones are no longer in memory: three slots)."""
        self._rejected: dict[int, str] = {}
        """Committed steps a restore rejected, and why (the persister never counts them)."""
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False
        """Standalone: whether the persister said it serves its socket."""
        self._tmpdir: str | None = None
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
    ) -> None:
        """Copy ``state`` into shared memory (training blocks only for this copy), report the
        step to the agent (with its training ``loss``, when given: see
        :func:`planaria.monitor.step`), and hand it to the persister when ``persist``
        (default: every ``persist_every`` steps).

        ``blocking=False``: enqueue the copies of device tensors on a side stream and return at
        once; the save completes (the step is published in memory, reported and handed to the
        persister) once they are done, which the next :meth:`save`, :meth:`wait_copy`,
        :meth:`wait`, :meth:`load` or :meth:`close` waits for. Nothing may change the state's
        tensors meanwhile: :meth:`guard` makes the optimizer (and the modules given) wait.
        Tensors in host memory are copied before it returns, as with ``blocking=True``."""
        if loss is not None:  # a wrong one fails here, not in a later call that completes it
            loss = monitor.loss_value(loss, step)
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
            monitor.step(step, loss=loss)
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
            self._persist(copy.step)
        monitor.step(copy.step, loss=copy.loss)

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

    def _connect(self, hello: bool = True) -> None:
        if self._sock is not None:
            return
        path = os.environ[SOCKET_ENV] if self.managed else self._start_persister()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The node's persister may be (re)starting; once training runs, not for longer than a
        # save may wait for it.
        deadline = time.monotonic() + (self.persister_timeout if self._lost else 30)
        while True:
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.05)
        self._sock = sock
        self._reader = sock.makefile("rb")
        if hello:
            self._hello()

    def _hello_message(self) -> dict[str, Any]:
        return {
            "op": "hello",
            "segment": str(self.segment_path),
            "storage": self.spec,
            "keep_last": self.keep_last,
            "rejected": sorted(self._rejected),
            "generation": _generation(),
        }

    def _hello(self) -> None:
        self._request(self._hello_message(), "ready")
        self._announced = self._segment

    def _start_persister(self) -> str:
        if self._process is None:
            self._spawn_persister()
        assert self._process is not None and self._process.stdout is not None
        path = self._socket_path()
        if self._ready:
            return path
        ready, _, _ = select.select([self._process.stdout], [], [], 60)
        line = self._process.stdout.readline() if ready else b""
        self._ready = line.strip() == b"ready"
        if not self._ready:
            self._process.kill()
            self._process.wait()
            self._process = None  # the private directory goes at close()
            raise StorageError(f"the checkpoint persister did not start: {line!r}")
        return path

    def _spawn_persister(self) -> None:
        """Start the persister, without waiting for it to be ready (:meth:`_start_persister`
        does, at its first use)."""
        assert self._private is not None
        self._tmpdir = str(self._private)
        # It follows this process itself (--parent), to finish a persist first.
        self._process = process.popen(
            persister.command(
                self._socket_path(), self.spec, self.keep_last, str(self.segment_path)
            ),
            die_with_parent=False,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        self._ready = False

    def _ask(
        self,
        message: dict[str, Any],
        expect: str,
        timeout: float | None = -1.0,
        *,
        sent: bool = False,
    ) -> dict[str, Any]:
        """One request, answered within ``timeout`` (default :attr:`persister_timeout`; None:
        no limit); :class:`ConnectionError` if the persister is gone, :class:`TimeoutError` if
        it does not answer (the connection is dropped: a late answer would be misread)."""
        assert self._sock is not None
        self._sock.settimeout(self.persister_timeout if timeout == -1.0 else timeout)
        try:
            return persister.ask(self._sock, self._reader, message, expect, send=not sent)
        except ConnectionError:
            raise
        except TimeoutError:
            self._drop()
            raise
        except OSError as exc:
            raise StorageError(str(exc)) from exc

    def _request(
        self,
        message: dict[str, Any],
        expect: str,
        timeout: float | None = -1.0,
        *,
        sent: bool = False,
    ) -> dict[str, Any]:
        """One request. A persister that stopped answering is replaced (standalone here,
        under ``planaria run`` by the agent) and the request is not waited for any longer.
        Under ``planaria run`` a persister that died is restarted by the agent: reconnect,
        hand the new one what the old one had, and ask again."""
        try:
            return self._ask(message, expect, timeout, sent=sent)
        except TimeoutError as exc:
            self._hung(message)
            raise StorageError(
                f"the checkpoint persister did not answer within {self.persister_timeout:g}s"
            ) from exc
        except ConnectionError as exc:
            if not self.managed:
                raise StorageError(str(exc)) from exc
            log.warning("the persister went away; reconnecting", error=str(exc))
            try:
                self._reconnect()
                return self._ask(message, expect, timeout)
            except OSError as again:  # ConnectionError included
                self._drop()
                raise StorageError(f"the node's persister is gone: {again}") from again

    def _hung(self, message: dict[str, Any]) -> None:
        """The persister stopped answering (stopped, or hung in the kernel on its storage)."""
        if self.managed:
            log.warning(
                "the node's persister stopped answering; its agent replaces it",
                op=message.get("op"),
                timeout=self.persister_timeout,
            )
            self._lost = True
            return
        old = self._process
        log.warning(
            "the checkpoint persister stopped answering; replacing it",
            op=message.get("op"),
            timeout=self.persister_timeout,
            pid=old.pid if old is not None else None,
        )
        self._drop()
        if old is not None:
            old.kill()  # SIGKILL ends a stopped process too; its locks go with it
            old.wait()
            self._process = None
        try:  # started now, connected to at the next persist or wait: nobody waits for it
            self._spawn_persister()
        except OSError as exc:
            log.warning("cannot start a new checkpoint persister", error=str(exc))
        self._lost = True

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = self._reader = None

    def _reconnect(self) -> None:
        announced = self._announced is not None
        self._drop()
        self._connect(hello=False)
        if announced:
            self._ask(self._hello_message(), "ready")
            self._announced = self._segment
        # What was committed meanwhile needs nothing; what was only pinned is asked again.
        store = self.store
        store.reject(self._rejected)
        newest = next((s for s in store.committed_steps() if store.usable(s)), -1)
        for step in [s for s in self._pending if s > newest]:
            try:
                self._ask({"op": "persist", "step": step}, "pinned")
            except StorageError as exc:  # no longer in memory: the persister reported it
                log.warning(
                    "cannot persist again after a persister restart", step=step, error=str(exc)
                )

    def _persist(self, step: int) -> None:
        # Pending from now on: a persister replaced before it answers is asked again.
        self._pending.append(step)
        try:
            if self._lost and self._sock is None:
                self._reconnect()
                self._lost = False
                return  # handed over with what was pending
            self._connect()
            if self._announced is not self._segment:  # a new (larger) segment replaced it
                self._hello()
            self._request({"op": "persist", "step": step}, "pinned")
        except (OSError, StorageError) as exc:
            if self._sock is None and self.managed:
                self._lost = True
            log.warning("cannot persist", step=step, error=str(exc))

    def wait(self) -> None:
        """Block until every step handed to the persister is durable (and, on rank 0,
        committed). What failed: standalone, a :class:`StorageError`; under ``planaria run``
        a warning, because the persister reported it to the job already, whose end says
        whether its last step was persisted (``checkpoint.allow_unpersisted_end``): a
        failed persist is no reason to restart the workers."""
        self.wait_copy()
        if self._lost and self._sock is None and self._pending:
            with contextlib.suppress(OSError, StorageError):
                self._reconnect()
                self._lost = False
        if self._sock is None:
            return
        reply = self._wait_idle()
        self._pending.clear()
        if reply.get("errors"):
            message = "persisting failed: " + "; ".join(reply["errors"])
            if not self.managed:
                raise StorageError(message)
            log.warning("persisting failed; the job's timeline has it", errors=reply["errors"])

    def _wait_idle(self) -> dict[str, Any]:
        """``wait``, as long as persisting takes, but not on a persister that stopped
        answering: every :attr:`persister_timeout` without an answer it is pinged on a
        connection of its own; one that does not answer is replaced (standalone here, under
        ``planaria run`` by the agent, which ends this connection) and asked again."""
        message = {"op": "wait"}
        while True:
            assert self._sock is not None
            try:
                self._sock.settimeout(None)
                self._sock.sendall(json.dumps(message).encode() + b"\n")
                while not select.select([self._sock], [], [], self.persister_timeout)[0]:
                    if not self._answers_ping() and not self.managed:
                        raise TimeoutError("no answer to a ping")
                return self._request(message, "idle", None, sent=True)
            except TimeoutError:
                self._hung(message)
                self._reconnect()  # the new one is asked what the old one had, and waited for
                self._lost = False
            except ConnectionError:
                return self._request(message, "idle", None)  # reconnects under planaria run

    def _answers_ping(self) -> bool:
        path = os.environ[SOCKET_ENV] if self.managed else self._socket_path()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.persister_timeout)
                sock.connect(path)
                with sock.makefile("rb") as reader:
                    persister.ask(sock, reader, {"op": "ping"}, "pong")
            return True
        except (OSError, ValueError):
            return False

    def _socket_path(self) -> str:
        return os.path.join(self._tmpdir or "", "persister.sock")

    def _report(self, event: str, **fields: Any) -> None:
        """Tell the job (through the node's persister) how the restore went."""
        if not self.managed:
            return
        try:
            self._connect(hello=False)
            self._request({"op": "report", "event": event, **fields}, "reported")
        except (OSError, StorageError) as exc:
            log.warning("cannot report to the agent", event=event, error=str(exc))

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
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._views, self._views_segment = {}, None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if not self.managed:
            with contextlib.suppress(FileNotFoundError):
                self.segment_path.unlink()
        if self._tmpdir is not None:  # a persister that was killed leaves its socket
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._tmpdir, "persister.sock"))
            with contextlib.suppress(OSError):
                os.rmdir(self._tmpdir)
            self._tmpdir = None
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
        result = self._load_storage(state)
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
        segment = self._open_segment()
        rank, world = self.rank, self.world
        mine = -1
        if segment is not None:
            mine = max(
                (i.step for i in segment.valid() if i.rank == rank and i.world == world),
                default=-1,
            )
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            bounds = torch.tensor([mine, -mine], dtype=torch.int64)
            torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
            if int(bounds[0]) != mine or -int(bounds[1]) != mine:
                return None
        elif world > 1:
            return None  # no way to agree with the other ranks: storage is the safe choice
        return mine if mine >= 0 else None

    def _load_memory(self, step: int, template: Any) -> Any:
        segment = self._open_segment()
        if segment is None:
            raise LookupError(f"no shared memory at {self.segment_path}")
        with segment.reading(step) as info:
            if info.rank != self.rank or info.world != self.world:
                raise LookupError(
                    f"memory holds rank {info.rank} of {info.world}, this is rank {self.rank} "
                    f"of {self.world}"
                )
            meta = segment.meta(info)
            entries = [TensorEntry.from_json(e) for e in meta["tensors"]]
            reads: list[tuple[torch.Tensor, int]] = []
            devices: dict[int, Device] = {}

            def tensor(index: int, old: Any) -> Any:
                entry = entries[index]
                target = _target(old, entry)
                if (
                    target is not None
                    and entry.nbytes
                    and (self._device is not None or not target.is_cpu)
                ):
                    # Into device memory: from the registered segment, on the side stream.
                    device = self._device or device_for(target.device)
                    if id(device) not in devices:
                        devices[id(device)] = device
                        segment.register_host(device, background=False, slots=(info.slot,))
                        device.start()
                    raw = segment.tensor(info, entry.offset, entry.nbytes)
                    device.copy(target, raw.view(dtype_of(entry.dtype)).view(entry.shape))
                    return old
                if (
                    not self._wrote  # a restarted worker: nothing of the segment mapped here
                    and target is not None
                    and entry.nbytes
                    and target.device.type == "cpu"
                    and target.is_contiguous()
                ):
                    reads.append((target, entry.offset))
                    return old
                raw = segment.tensor(info, entry.offset, entry.nbytes)
                return _fill(raw, entry, old)

            try:
                restored = rebuild(meta["tree"], tensor, template)
                segment.read_into(info, reads)
            finally:
                for device in devices.values():  # one wait each, while the slot is held
                    device.finish().wait()
            return restored

    def _load_storage(self, template: Any) -> tuple[int, Any] | None:
        store = self.store
        rank, world = self.rank, self.world
        distributed = (
            world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        )
        committed = store.committed_steps()
        for step in committed:
            try:
                manifest = store.manifest(step)
                loader = _StorageShards(store, step, manifest)
                saved_world = manifest.world
                primary = rank if rank < saved_world else 0
                if distributed:
                    loader.verify([primary])
                else:  # every rank must reach the same verdict without talking: check all
                    loader.verify(range(saved_world))
                ok = True
            except CheckpointCorruptError as exc:
                warnings.warn(f"skipping checkpoint step-{step}: {exc}", stacklevel=2)
                log.warning("skipping corrupt checkpoint", step=step, error=str(exc))
                self._rejected[step] = str(exc)
                self._report("checkpoint_skipped", step=step, rank=rank, error=str(exc))
                ok = False
            if distributed:
                flag = torch.tensor([1 if ok else 0])
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
                if ok and not int(flag[0]):
                    log.warning("another rank rejected checkpoint; trying an older one", step=step)
                    self._rejected[step] = "rejected by another rank"
                ok = bool(int(flag[0]))
            if not ok:
                continue
            return step, loader.rebuild(primary, template)
        if committed:  # there were steps, and none verified
            listed = ", ".join(map(str, committed))
            where = _where(self.spec)
            why = f"committed checkpoint steps {listed} in {where} all failed verification"
            if rank == 0:
                self._report("started_from_scratch", rank=rank, steps=committed, error=why)
            if self.require_restore:
                raise CheckpointRestoreError(
                    f"nothing to restore: {why}, and restoring one is required "
                    "(checkpoint.require_restore): repair or remove them, or allow a start "
                    "from scratch"
                )
        return None


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


def _target(old: Any, entry: TensorEntry) -> torch.Tensor | None:
    """The tensor to fill in place for ``entry``: ``old`` (or its local shard) if it fits."""
    if not isinstance(old, torch.Tensor):
        return None
    local = old.to_local() if hasattr(old, "to_local") and type(old).__name__ == "DTensor" else old
    if tuple(local.shape) == entry.shape and local.dtype == dtype_of(entry.dtype):
        return local
    return None


def _fill(raw: torch.Tensor, entry: TensorEntry, old: Any) -> torch.Tensor:
    src = raw.view(dtype_of(entry.dtype)).view(entry.shape) if entry.nbytes else None
    target = _target(old, entry)
    if target is not None:
        if src is not None:
            target.copy_(src)
        return old if isinstance(old, torch.Tensor) else target
    if src is None:
        return torch.empty(entry.shape, dtype=dtype_of(entry.dtype))
    return src.clone()


class _StorageShards:
    """One committed step's shards, read and verified on demand."""

    def __init__(self, store: PersistedCheckpoints, step: int, manifest: Manifest) -> None:
        self.store = store
        self.step = step
        self.manifest = manifest
        self._shards: dict[int, tuple[ShardRecord, bytes]] = {}

    def verify(self, ranks: Any) -> None:
        """Every file these ranks read matches the manifest, and their layout fits their data
        (before the ranks agree on the step: nothing may fail after that)."""
        for rank in ranks:
            _, data = self.shard(rank)
            for entry in self.entries(rank):
                if entry.offset + entry.nbytes > len(data):
                    raise CheckpointCorruptError(
                        f"step-{self.step}/rank-{rank}.bin: tensor {entry.path} lies beyond its end"
                    )

    def shard(self, rank: int) -> tuple[ShardRecord, bytes]:
        if rank not in self._shards:
            self._shards[rank] = self.store.shard(self.step, rank, self.manifest)
        return self._shards[rank]

    def entries(self, rank: int) -> list[TensorEntry]:
        record, _ = self.shard(rank)
        try:
            return [TensorEntry.from_json(e) for e in record.meta.tensors]
        except (ValueError, KeyError, TypeError) as exc:  # LayoutError is a TypeError
            raise CheckpointCorruptError(
                f"step-{self.step}/rank-{rank}.json: not a valid tensor layout ({exc})"
            ) from exc

    def raw(self, rank: int, entry: TensorEntry) -> torch.Tensor:
        _, data = self.shard(rank)
        if entry.offset + entry.nbytes > len(data):
            raise CheckpointCorruptError(
                f"step-{self.step}/rank-{rank}.bin: tensor {entry.path} lies beyond its end"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: every use copies out of them
            if not entry.nbytes:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(
                data, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset
            )

    def rebuild(self, primary: int, template: Any) -> Any:
        record, _ = self.shard(primary)
        entries = self.entries(primary)
        world = self.manifest.world

        def tensor(index: int, old: Any) -> Any:
            entry = entries[index]
            if entry.global_shape is not None and _is_resharded(old, entry):
                return _reshard(old, entry, self, world)
            return _fill(self.raw(primary, entry), entry, old)

        return rebuild(record.meta.tree, tensor, template)


def _is_resharded(old: Any, entry: TensorEntry) -> bool:
    if old is None or type(old).__name__ != "DTensor":
        return False
    from planaria.checkpoint.layout import local_offset

    gshape, goffset = local_offset(old)
    local = tuple(old.to_local().shape)
    return (gshape, goffset, local) != (entry.global_shape, entry.global_offset, entry.shape)


def _reshard(old: Any, entry: TensorEntry, shards: _StorageShards, world: int) -> Any:
    """Fill a DTensor's local shard from every saved shard that overlaps it."""
    from planaria.checkpoint.layout import local_offset

    gshape, goffset = local_offset(old)
    if tuple(gshape) != entry.global_shape:
        raise CheckpointCorruptError(
            f"{entry.path}: saved with global shape {list(entry.global_shape or ())}, the model "
            f"has {list(gshape)}"
        )
    target = old.to_local()
    want = [(o, o + n) for o, n in zip(goffset, target.shape, strict=True)]
    covered = 0
    for rank in range(world):
        for other in shards.entries(rank):
            if other.path != entry.path or other.global_offset is None:
                continue
            have = [(o, o + n) for o, n in zip(other.global_offset, other.shape, strict=True)]
            box = [
                (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(want, have, strict=False)
            ]
            if any(lo >= hi for lo, hi in box):
                continue
            src = shards.raw(rank, other).view(dtype_of(other.dtype)).view(other.shape)
            src_index = tuple(
                slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(box, have, strict=False)
            )
            dst_index = tuple(
                slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, want, strict=False)
            )
            target[dst_index].copy_(src[src_index])
            volume = 1
            for lo, hi in box:
                volume *= hi - lo
            covered += volume
    if covered != target.numel():
        raise CheckpointCorruptError(
            f"{entry.path}: the saved shards cover {covered} of the {target.numel()} elements "
            "this rank needs"
        )
    return old


def _generation() -> int:
    """The round this worker runs in (``PLANARIA_GENERATION``, set by its agent): what it
    persists carries it, so that a round the master fenced out cannot commit."""
    value = os.environ.get(GENERATION_ENV, "0")
    return int(value) if value.isdigit() else 0
