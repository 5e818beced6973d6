"""Pure pieces of Kubernetes semantics the emulated cluster needs: label and field selectors,
resource quantities, JSON merge patches, timestamps and names.

Everything here works on plain JSON-like dicts, the shape the API server stores and serves.
"""

from __future__ import annotations

import copy
import datetime
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]


class SelectorError(ValueError):
    """A selector the real API server would reject with 400 Bad Request."""


# ---------------------------------------------------------------------------------------------
# Label selectors: https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_SET_RE = re.compile(rf"^\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)\s*$")
_EQ_RE = re.compile(rf"^\s*(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>[-A-Za-z0-9_.]*)\s*$")
_EXISTS_RE = re.compile(rf"^\s*(?P<neg>!?)\s*(?P<key>{_KEY})\s*$")


@dataclass(frozen=True)
class Requirement:
    """One requirement of a selector: ``key op values``.

    ``op`` is one of ``In``, ``NotIn``, ``Exists``, ``DoesNotExist`` (equality selectors are
    ``In``/``NotIn`` with one value, as the real server treats them), ``Gt``, ``Lt``.
    """

    key: str
    op: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "In":
            return present and value in self.values
        if self.op == "NotIn":
            return not present or value not in self.values
        if self.op == "Exists":
            return present
        if self.op == "DoesNotExist":
            return not present
        if self.op in ("Gt", "Lt") and present and len(self.values) == 1:
            try:
                have, want = int(str(value)), int(self.values[0])
            except ValueError:
                return False
            return have > want if self.op == "Gt" else have < want
        return False


def _split_top_level(text: str) -> list[str]:
    """Split a selector at the commas that are not inside ``( )``."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part for part in parts if part.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse a ``labelSelector`` query parameter (equality- and set-based, comma-joined)."""
    if not text or not text.strip():
        return []
    requirements: list[Requirement] = []
    for part in _split_top_level(text):
        if match := _SET_RE.match(part):
            values = tuple(v.strip() for v in match["values"].split(",") if v.strip())
            op = "In" if match["op"] == "in" else "NotIn"
            requirements.append(Requirement(match["key"], op, values))
        elif match := _EQ_RE.match(part):
            op = "NotIn" if match["op"] == "!=" else "In"
            requirements.append(Requirement(match["key"], op, (match["value"],)))
        elif match := _EXISTS_RE.match(part):
            op = "DoesNotExist" if match["neg"] else "Exists"
            requirements.append(Requirement(match["key"], op))
        else:
            raise SelectorError(f"unable to parse requirement: {part.strip()!r}")
    return requirements


def selector_from_spec(spec: Mapping[str, Any] | None) -> list[Requirement] | None:
    """A ``LabelSelector`` object (``matchLabels`` + ``matchExpressions``) as requirements.

    ``None`` (no selector at all) selects nothing, an empty selector selects everything, as in
    pod affinity terms.
    """
    if spec is None:
        return None
    requirements = [
        Requirement(k, "In", (str(v),)) for k, v in (spec.get("matchLabels") or {}).items()
    ]
    for expr in spec.get("matchExpressions") or []:
        requirements.append(
            Requirement(str(expr["key"]), str(expr["operator"]), tuple(expr.get("values") or ()))
        )
    return requirements


def labels_match(requirements: Sequence[Requirement], labels: Mapping[str, str] | None) -> bool:
    return all(req.matches(labels or {}) for req in requirements)


# ---------------------------------------------------------------------------------------------
# Field selectors

FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "spec.unschedulable": ("spec", "unschedulable"),
    "status.phase": ("status", "phase"),
    "type": ("type",),
    "reason": ("reason",),
    "involvedObject.kind": ("involvedObject", "kind"),
    "involvedObject.name": ("involvedObject", "name"),
    "involvedObject.namespace": ("involvedObject", "namespace"),
    "involvedObject.uid": ("involvedObject", "uid"),
}


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    value: str
    negated: bool

    def matches(self, obj: Mapping[str, Any]) -> bool:
        current: Any = obj
        for part in FIELDS[self.field]:
            current = current.get(part) if isinstance(current, Mapping) else None
        if current is None:
            text = ""
        elif isinstance(current, bool):
            text = "true" if current else "false"
        else:
            text = str(current)
        return (text == self.value) != self.negated


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    """Parse a ``fieldSelector`` (``=``, ``==``, ``!=``; comma-joined) over :data:`FIELDS`."""
    if not text or not text.strip():
        return []
    requirements: list[FieldRequirement] = []
    for part in text.split(","):
        match = re.match(r"^\s*([A-Za-z.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if match is None:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = match.groups()
        if field not in FIELDS:
            raise SelectorError(f"field label not supported: {field}")
        requirements.append(FieldRequirement(field, value, op == "!="))
    return requirements


def fields_match(requirements: Sequence[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all(req.matches(obj) for req in requirements)


# ---------------------------------------------------------------------------------------------
# Quantities: https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/

_SUFFIXES: dict[str, Fraction] = {
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY_RE = re.compile(
    r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)


def parse_quantity(value: str | int | float) -> Fraction:
    """``"500m"`` -> 1/2, ``"1Gi"`` -> 2**30, ``2`` -> 2."""
    match = _QUANTITY_RE.match(str(value).strip())
    if match is None:
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    return Fraction(match[1]) * _SUFFIXES[match[2] or ""]


# ---------------------------------------------------------------------------------------------
# Patches, times, names


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: ``null`` deletes a key, objects merge, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: Obj = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def timestamp(when: datetime.datetime | None = None) -> str:
    """RFC 3339 in UTC with seconds, as the API server writes times (``2024-01-02T03:04:05Z``)."""
    return (when or now()).strftime("%Y-%m-%dT%H:%M:%SZ")


_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def random_suffix(length: int = 5) -> str:
    """The random tail ``generateName`` gets (the same alphabet as the real server's)."""
    return "".join(random.choice(_SUFFIX_ALPHABET) for _ in range(length))


DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1123_SUBDOMAIN_ERROR = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.',"
    " and must start and end with an alphanumeric character (e.g. 'example.com', regex used for"
    r" validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
