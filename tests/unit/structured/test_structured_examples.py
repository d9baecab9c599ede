"""Pattern examples as hints for ending a string (engine/structured/examples.py, issue 42).

The completion search lets one letter of each case and one digit stand for the rest, so a pattern
that needs particular bytes (`\\.png$`, `1.2`, `^(wifi|ethernet)$`) was never ended and its schema
refused ("no document of at most 16384 bytes"). Schemas written for these tests, modelled on
real ones of that kind (an icon file name, a schema version, a link type)."""

from __future__ import annotations

import re
import warnings

import pytest

from celeris.engine.structured.constraint import Structured
from celeris.engine.structured.examples import MAX_EXAMPLE, example, hints
from tests.unit.structured.decoding import decode_beside_free

PATTERNS = [r"\.png$", "1.2", r"^(wifi|ethernet)$", r"^[0-9]{1,20}$", r"^\d{3}-\d{4}$", r"^[^@\s]+@[^@\s]+$",
            r"(ab)\1", r"^(?!foo)[a-z]+$", r"^[A-Z][a-z]*\.[a-z]{2,}$", r"[^a0A_-]", r"^(x|yy)+z?$", r"v\d+(\.\d+)*"]
NEEDY = {"type": "object", "required": ["icon", "schemaVersion", "link"], "properties": {
    "icon": {"type": "string", "pattern": r"\.png$"},
    "schemaVersion": {"type": "string", "pattern": "1.2"},
    "link": {"type": "string", "pattern": r"^(wifi|ethernet)-[0-9]+$", "minLength": 8},
    "note": {"type": "string"}}}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_example_is_matched_by_its_pattern(pattern):
    text = example(pattern)
    assert text is not None and re.search(pattern, text), (pattern, text)
    for least in (1, 5, 12):
        longer = example(pattern, least)
        if longer is not None:
            assert re.search(pattern, longer) and len(longer) >= least, (pattern, least, longer)


def test_lengths_come_from_repeats_then_padding_where_unanchored_and_are_bounded():
    assert example(r"^[a-z]+$", 5) == "aaaaa"  # the repeat takes the length
    assert example("abc", 6) == "abcaaa"  # unanchored: padded after
    assert example("abc$", 6) == "aaaabc"  # anchored at the end: padded before
    assert example("^abc$", 6) is None  # no room anywhere
    assert example("^a{3}$", 0, 2) is None  # longer than maxLength
    assert example(f"^a{{{MAX_EXAMPLE + 1}}}$") is None  # no hint that long
    for broken in ("(", "[z-a]", "a{2,1}"):  # a pattern this reader cannot use is no hint, not an error
        assert example(broken) is None
    with warnings.catch_warnings():  # nor a warning: Python's FutureWarning about '[[' is not the client's
        warnings.simplefilter("error")
        assert example("^[[a-z]_]+$") == "[_]"


def test_hints_are_json_string_contents_shortest_first_each_once():
    schema = {"anyOf": [{"type": "string", "pattern": '^a"b\\\\$'}, {"pattern": "^é+$"},
                        {"items": {"pattern": "^é+$"}}, {"pattern": "^xyz$"}, {"pattern": 7}]}
    assert hints(schema).strings == ("é".encode(), b"xyz", b'a\\"b\\\\')


def test_a_pattern_that_needs_particular_bytes_is_served_and_every_output_validates(llm, compiler):
    """Compiled (no longer refused), its shortest document from the hints, and decoded through the
    engine beside a free request and another schema: every document validates, the free request
    reads as it does alone."""
    layout = compiler.compile(Structured("json_schema", NEEDY, "s"), 512)
    assert layout.path == "document" and 0 < layout.needed < 64
    assert b".png" in layout.slots[0].hints.strings

    other = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    decode_beside_free(llm, [(NEEDY, 64), (NEEDY, 96), (other, 32), (NEEDY, 160)])
