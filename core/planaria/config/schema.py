"""JSON Schema of the whole config file, with every installed plugin's options.

Editors (VS Code's YAML extension, JetBrains) complete and check a file against it: the
``backend`` of each section lists the installed names, and ``options`` follows the chosen one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from planaria.config.models import Config, backend_sections
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind

SECTION_KINDS: dict[type[BaseModel], PluginKind] = {
    section: section.kind for _, section in backend_sections()
}


def _stable_names(
    schema: dict[str, Any], refs: dict[Any, Any], models: list[type[BaseModel]]
) -> dict[str, Any]:
    """Name each plugin's options by its module and class, whatever else is installed (pydantic
    alone renames a model when another installed plugin's has the same class name, which
    breaks editors and tools that refer to the definitions)."""
    renamed: dict[str, str] = {}
    for model in models:
        old = str(refs[(model, "validation")]["$ref"]).rsplit("/", 1)[-1]
        renamed[old] = f"{model.__module__}.{model.__qualname__}"
    defs: dict[str, Any] = {renamed.get(k, k): v for k, v in schema["$defs"].items()}
    for new in renamed.values():
        defs[new]["title"] = new

    def fix(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.removeprefix("#/$defs/")
                node["$ref"] = f"#/$defs/{renamed.get(name, name)}"
            for value in node.values():
                fix(value)
        elif isinstance(node, list):
            for value in node:
                fix(value)

    fix(defs)
    fix(refs)
    return defs


def config_schema(manager: PluginManager) -> dict[str, Any]:
    per_kind = {kind: manager.records(kind) for kind in PluginKind}
    options_models = {
        (kind, name): record.options
        for kind, recs in per_kind.items()
        for name, record in recs.items()
    }
    models: list[type[BaseModel]] = [Config, *dict.fromkeys(options_models.values())]
    refs, schema = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/$defs/{model}"
    )
    defs = _stable_names(schema, refs, [m for m in models if m is not Config])
    root = dict(defs.pop(Config.__name__))
    for section, kind in SECTION_KINDS.items():
        definition = defs.get(section.__name__)
        if definition is None:
            continue
        names = sorted(per_kind[kind])
        backend = definition["properties"]["backend"]
        backend["description"] = f"installed: {', '.join(names) or '(none)'}"
        if names:
            backend["examples"] = names
        if not names:
            continue
        definition["allOf"] = [
            {
                "if": {"properties": {"backend": {"const": name}}, "required": ["backend"]},
                "then": {
                    "properties": {"options": refs[(options_models[(kind, name)], "validation")]}
                },
            }
            for name in names
        ]
    root["$defs"] = defs
    root["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    root["title"] = "planaria job configuration"
    return root
