"""Which unquoted YAML values are numbers, booleans or null: YAML 1.2's few, not YAML 1.1's many.

PyYAML follows YAML 1.1, where ``4:8`` is the base-60 number 248, ``1:30`` is 90, ``on``, ``off``,
``yes`` and ``no`` are booleans, ``010`` is the octal 8 and ``2024-06-01`` is a date. A config
file means none of these: ``nodes: 4:8`` is a range, ``partition: on`` a name. Here only what
YAML 1.2 also reads as a number, boolean or null is one; everything else stays the text written,
for the field's own model to read (a boolean field still takes ``yes`` and ``off``, an integer
field ``010``).

Every value read as a non-string here is read as the same value by YAML 1.1, so what a YAML 1.1
writer (``yaml.safe_dump``) leaves unquoted reads back unchanged. For that reason ``1e3``
(a string in YAML 1.1) stays a string: a float field reads it all the same.
"""

from __future__ import annotations

import re

import yaml

_TAG = "tag:yaml.org,2002:"
_EXPONENT = r"(?:[eE][-+][0-9]+)?"
IMPLICIT: tuple[tuple[str, str, str], ...] = (
    # (tag, what the whole value must match, the characters such a value may start with)
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+", "-+0123456789"),
    (
        "float",
        rf"[-+]?[0-9][0-9_]*\.[0-9_]*{_EXPONENT}|\.[0-9][0-9_]*{_EXPONENT}"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        "-+0123456789.",
    ),
    ("null", r"~|null|Null|NULL|", "~nN"),
    ("merge", r"<<", "<"),  # ``<<: *base``, which config files use to share sections
)


class Yaml12Resolver(yaml.resolver.BaseResolver):
    """Put before a PyYAML loader's own resolver (``class L(Yaml12Resolver, SafeLoader)``)."""


for _name, _pattern, _first in IMPLICIT:
    # "" stands for the empty value (``key:``), which is null.
    _starts = [*_first, ""] if _name == "null" else list(_first)
    Yaml12Resolver.add_implicit_resolver(_TAG + _name, re.compile(rf"^(?:{_pattern})$"), _starts)
