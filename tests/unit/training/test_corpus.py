"""The R-serialization reader on hand-built bytes (offline), and the real corpus when apt exists."""

import gzip
import shutil
import struct
import zlib

import pytest

from celeris.engine.training.corpus import (
    INTSXP,
    LGLSXP,
    REALSXP,
    STRSXP,
    VECSXP,
    RDataError,
    corpus_source,
    lines_to_paragraphs,
    load_austen,
    read_lazyload_db,
    total_chars,
    unserialize,
)

# ---- a tiny writer for R's XDR format, just enough to build test inputs ----------------------
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6  # CHARSXP encoding "levels", stored at bit 12


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int = 3) -> bytes:
    extra = i32(5) + b"UTF-8" if version == 3 else b""
    return b"X\n" + i32(version, 0x040201, 0x030500) + extra


def charsxp(text: str | None, levels: int = ASCII, codec: str = "utf-8") -> bytes:
    if text is None:
        return i32(9, -1)
    raw = text.encode(codec)
    return i32(9 | levels << 12, len(raw)) + raw


def symbol(name: str) -> bytes:
    return i32(1) + charsxp(name)


def ref(index: int) -> bytes:  # back-reference to the index-th symbol written (1-based)
    return i32(255 | index << 8)


def pairlist(cells: list[tuple[bytes, bytes]]) -> bytes:
    """cells: (serialized tag symbol or ref, serialized value); ends with NULL."""
    return b"".join(i32(2 | HAS_TAG) + tag + value for tag, value in cells) + i32(254)


def vector(kind: int, body: bytes, n: int, attrs: bytes = b"") -> bytes:
    return i32(kind | (HAS_ATTR if attrs else 0), n) + body + attrs


def strsxp(strings: list[str | None], attrs: bytes = b"") -> bytes:
    return vector(STRSXP, b"".join(charsxp(s) for s in strings), len(strings), attrs)


def named_list(items: dict[str, bytes], names_tag: bytes) -> bytes:
    attrs = pairlist([(names_tag, strsxp(list(items)))])
    return vector(VECSXP, b"".join(items.values()), len(items), attrs)


# ---- the reader ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 3])
def test_character_vector_with_na_and_encodings(version):
    body = charsxp("It is a truth") + i32(9, -1)
    body += charsxp("Café", levels=UTF8) + charsxp("naïve", levels=LATIN1, codec="latin-1")
    obj = unserialize(header(version) + vector(STRSXP, body, 4))
    assert obj.sexptype == STRSXP
    assert obj.items == ["It is a truth", None, "Café", "naïve"]
    assert obj.attrs == {}


def test_named_list_of_ints_and_logicals_with_symbol_back_reference():
    ints = vector(INTSXP, i32(0, 42, -(2**31)), 3)
    lgls = vector(LGLSXP, i32(1, 0), 2)
    # Attributes follow the items, so the inner list defines the "names" symbol and the
    # outer list's tag is a back-reference to it, as R writes it.
    inner = named_list({"flag": lgls}, names_tag=symbol("names"))
    data = header() + named_list({"span": ints, "inner": inner}, names_tag=ref(1))
    obj = unserialize(data).named()
    assert obj["span"].items == [0, 42, None]
    assert obj["inner"].named()["flag"].items == [True, False]


def test_altrep_compact_integer_sequence():
    # R >= 3.5 writes 1:n (e.g. data.frame row names) as ALTREP: class info, state, attributes.
    info = i32(2) + symbol("compact_intseq") + i32(2) + symbol("base") + i32(2)
    info += vector(INTSXP, i32(INTSXP), 1) + i32(254)
    state = vector(REALSXP, struct.pack(">3d", 4, 7, 1), 3)
    obj = unserialize(header() + i32(238) + info + state + i32(254))
    assert (obj.sexptype, obj.items) == (INTSXP, [7, 8, 9, 10])


def test_bad_input_raises_rdata_error():
    with pytest.raises(RDataError):
        unserialize(b"A\n" + i32(2, 0, 0))  # ASCII format, not XDR
    with pytest.raises(RDataError):
        unserialize(header() + strsxp(["truncated"])[:-3])
    with pytest.raises(RDataError):
        unserialize(header() + vector(99, b"", 0))  # a SEXP type we do not read
    with pytest.raises(RDataError):
        unserialize(header() + ref(1))  # no symbol has been written yet
    with pytest.raises(RDataError):
        unserialize(header() + i32(STRSXP, 1, 9, -5))  # negative string length


def test_lazyload_db_round_trip(tmp_path):
    # One object "novel" in the .rdb: 4-byte length then zlib, as R's makeLazyLoadDB writes.
    payload = header() + strsxp(["Chapter 1", "", "Hello,", "world."])
    blob = struct.pack(">I", len(payload)) + zlib.compress(payload)
    (tmp_path / "Rdata.rdb").write_bytes(b"junk" + blob)  # offsets need not start at 0
    span = vector(INTSXP, i32(4, len(blob)), 2)
    index = named_list(
        {
            "variables": named_list({"novel": span}, names_tag=symbol("names")),
            "references": vector(VECSXP, b"", 0),
            "compressed": vector(LGLSXP, i32(1), 1),
        },
        names_tag=ref(1),
    )
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(header() + index))
    objects = read_lazyload_db(tmp_path / "Rdata.rdx")
    assert lines_to_paragraphs(objects["novel"].items) == ["Hello, world."]


def test_lines_to_paragraphs_keeps_only_the_story():
    lines = ["EMMA", "", "By Jane Austen", "", "CHAPTER I", "", "Emma  was _very_", "clever.", ""]
    lines += ["* * * * *", "", "Chapter 2.", "", "  The end came.", "", "FINIS", "", "Editor."]
    assert lines_to_paragraphs(lines) == ["Emma was very clever.", "The end came."]


# ---- the real corpus (downloads ~1.6 MB with apt-get) -----------------------------------------


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.skipif(
    shutil.which("apt-get") is None or shutil.which("dpkg") is None,
    reason="needs Debian's apt-get and dpkg",
)
def test_real_austen_corpus(tmp_path):
    novels = load_austen(tmp_path)
    assert len(novels) == 6
    assert novels["Pride and Prejudice"][0].startswith(
        "It is a truth universally acknowledged, that a single man in possession"
    )
    assert novels["Emma"][0].startswith("Emma Woodhouse, handsome, clever, and rich")
    assert total_chars(novels) > 3_000_000
    assert load_austen(tmp_path) == novels  # second call comes from the cache file
    source = corpus_source(tmp_path)
    assert source["package"] == "r-cran-janeaustenr"
    assert source["version"] and "MIT" in source["package_license"]
