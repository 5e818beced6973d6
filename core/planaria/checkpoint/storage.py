"""Building a storage target from its config section (``{backend, options}``) in any process."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from planaria.errors import StorageError
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.storage.api import CheckpointStorage


def build_storage(spec: dict[str, Any]) -> CheckpointStorage[Any]:
    """The storage ``spec`` selects: ``{"backend": "local", "options": {"path": "ckpt"}}``."""
    if not isinstance(spec, dict) or not isinstance(spec.get("backend"), str):
        raise StorageError(f"a storage is {{backend: NAME, options: {{...}}}}, not {spec!r}")
    manager = PluginManager.from_entry_points()
    record = manager.resolve(PluginKind.CHECKPOINT_STORAGE, spec["backend"])
    try:
        options = record.options.model_validate(spec.get("options") or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'options'}: {e['msg']}" for e in exc.errors()
        )
        raise StorageError(
            f"checkpoint.storage.options for backend {spec['backend']!r}: {problems}"
        ) from exc
    storage: CheckpointStorage[Any] = record.factory(options)
    return storage
