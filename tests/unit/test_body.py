"""A request's body read strictly (:mod:`planaria.master.body`): the check for numbers that may
overflow a float, which every request pays, finds exactly what its pattern describes."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from planaria.master.body import may_overflow


@given(st.binary().map(lambda b: bytes(b"0123456789.eE+-a"[x % 16] for x in b)))
def test_the_overflow_check_finds_what_its_pattern_does(raw):
    """A body is walked for numbers out of range exactly when one may be in it."""
    pattern = re.compile(rb"[0-9.][eE][+-]?[0-9]{3}|[0-9]{200}")
    assert may_overflow(raw) == (pattern.search(raw) is not None)
    assert may_overflow(b"1" * 200) and may_overflow(b'{"a": 1.5e308}')
    assert not may_overflow(b'{"name": "e308"}')
