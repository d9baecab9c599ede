"""Training prose for celeris-tiny: Jane Austen's six novels.

The text ships in Debian's `r-cran-janeaustenr` as an R lazy-load database (`data/Rdata.rdx`
index + `data/Rdata.rdb` blobs). We fetch the .deb with apt, unpack it with dpkg, and read the
database with the small reader of R's XDR serialization format below, so no R is needed.

    load_austen(cache_dir)  -> {"Pride and Prejudice": [paragraph, ...], ...}
    corpus_source(cache_dir) -> package, versions and license, for the model card
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import struct
import subprocess
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = "r-cran-janeaustenr"
CORPUS_SOURCE: dict[str, str] = {
    "package": PACKAGE,
    "license": "novels: public domain; R package janeaustenr: MIT",
    "homepage": "https://github.com/juliasilge/janeaustenr",
}
# Object name in the R package -> title; dict order is publication order.
NOVELS: dict[str, str] = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_CACHE_NAME = "austen-v1.json"  # bump when lines_to_paragraphs changes, to rebuild caches
_PKG_DIR = Path("usr/lib/R/site-library/janeaustenr")


class RDataError(ValueError):
    """The bytes are not R serialization this reader understands, or not the data we expect."""


# ----------------------------------------------------------------------------------------------
# R serialization (see R's src/main/serialize.c): a header, then items written depth first.
# Each item starts with an int of flags: SEXP type in the low byte, then bits for
# "is object", "has attributes", "has tag", and the CHARSXP encoding bits ("levels") above 12.

SYMSXP, LISTSXP, CHARSXP, LGLSXP = 1, 2, 9, 10
INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP, RAWSXP = 13, 14, 16, 19, 20, 24
ALTREP_SXP, NILVALUE_SXP, REFSXP = 238, 254, 255
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10
_BYTES_MASK, _LATIN1_MASK = 1 << 1, 1 << 2
NA_INTEGER = -(2**31)


@dataclass(frozen=True)
class RSymbol:
    name: str


@dataclass(frozen=True)
class RVector:
    """Any R vector: `items` are Python values (str/None for strings, None for NA ints)."""

    sexptype: int
    items: list[Any]
    attrs: dict[str, Any] = field(default_factory=dict)

    def named(self) -> dict[str, Any]:
        """Items keyed by the `names` attribute, as R's `x[["name"]]` would see them."""
        names = self.attrs.get("names")
        if names is None:
            raise RDataError("vector has no names attribute")
        return dict(zip(names.items, self.items, strict=True))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0
        self.refs: list[Any] = []  # symbols, in the order written; REFSXP points back into this
        self.encoding = "utf-8"

    def _unpack(self, fmt: str, size: int) -> tuple[Any, ...]:
        if size < 0 or self.pos + size > len(self.data):
            raise RDataError(f"truncated or corrupt at byte {self.pos}")
        out = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return out

    def read_int(self) -> int:
        return self._unpack(">i", 4)[0]

    def length(self) -> int:
        n = self.read_int()
        if n == -1:  # long vector: two more ints, high word first
            hi, lo = self._unpack(">II", 8)
            n = (hi << 32) | lo
        return n

    def header(self) -> None:
        if self.data[:2] != b"X\n":
            raise RDataError(f"not XDR serialization: starts {self.data[:2]!r}")
        self.pos = 2
        version, _writer, _min_reader = self._unpack(">iii", 12)
        if version == 3:  # version 3 adds the writer's native encoding
            name_len = self.read_int()
            self.encoding = self._unpack(f"{name_len}s", name_len)[0].decode("ascii")
        elif version != 2:
            raise RDataError(f"unsupported serialization version {version}")

    def item(self) -> Any:
        flags = self.read_int()
        kind = flags & 0xFF
        if kind == NILVALUE_SXP:
            return None
        if kind == REFSXP:  # small indices live in the flags; 0 means "read the next int"
            index = flags >> 8 or self.read_int()
            if not 1 <= index <= len(self.refs):
                raise RDataError(f"reference {index} to an object not yet read")
            return self.refs[index - 1]
        if kind == SYMSXP:
            symbol = RSymbol(self.item())
            self.refs.append(symbol)
            return symbol
        if kind == CHARSXP:
            return self._string(flags)
        if kind == LISTSXP:
            return self._pairlist(flags)
        if kind == ALTREP_SXP:
            return self._altrep()
        items = self._vector_items(kind)
        attrs = self._attributes() if flags & _HAS_ATTR else {}
        return RVector(kind, items, attrs)

    def _string(self, flags: int) -> str | None:
        n = self.read_int()
        if n == -1:
            return None  # NA_character_
        raw = self._unpack(f"{n}s", n)[0]
        levels = flags >> 12
        # BYTES strings have no encoding; latin-1 keeps every byte and never fails.
        encoding = "latin-1" if levels & (_LATIN1_MASK | _BYTES_MASK) else self.encoding
        return raw.decode(encoding)

    def _vector_items(self, kind: int) -> list[Any]:
        n = self.length()
        if kind in (LGLSXP, INTSXP):
            values = self._unpack(f">{n}i", 4 * n)
            if kind == LGLSXP:
                return [None if v == NA_INTEGER else bool(v) for v in values]
            return [None if v == NA_INTEGER else v for v in values]
        if kind == REALSXP:
            return list(self._unpack(f">{n}d", 8 * n))
        if kind == RAWSXP:
            return list(self._unpack(f"{n}s", n)[0])
        if kind in (STRSXP, VECSXP, EXPRSXP):
            return [self.item() for _ in range(n)]
        raise RDataError(f"unsupported SEXP type {kind} at byte {self.pos - 4}")

    def _pairlist(self, flags: int) -> list[tuple[str | None, Any]]:
        # Read cell by cell instead of recursing on CDR: attribute lists can be long.
        cells: list[tuple[str | None, Any]] = []
        while flags & 0xFF == LISTSXP:
            if flags & _HAS_ATTR:
                self.item()  # attributes on a pairlist cell carry nothing data needs
            tag = self.item().name if flags & _HAS_TAG else None
            cells.append((tag, self.item()))
            flags = self.read_int()
        if flags & 0xFF != NILVALUE_SXP:
            raise RDataError("dotted pairlist (CDR is not NULL)")
        return cells

    def _attributes(self) -> dict[str, Any]:
        attrs = self.item()
        if not isinstance(attrs, list):
            raise RDataError("attributes are not a pairlist")
        return {tag: value for tag, value in attrs}

    def _altrep(self) -> RVector:
        # R >= 3.5 writes compact objects (e.g. 1:n row names) as class info + state.
        info, state, attrs = self.item(), self.item(), self.item()
        cls = info[0][1].name
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = state.items  # stored as doubles even for integer sequences
            values = [start + i * step for i in range(int(n))]
            if cls == "compact_intseq":
                return RVector(INTSXP, [int(v) for v in values], dict(attrs or []))
            return RVector(REALSXP, values, dict(attrs or []))
        if cls.startswith("wrap_"):  # a wrapper around an ordinary vector: state[0]
            inner = state.items[0]
            return RVector(inner.sexptype, inner.items, dict(attrs or []))
        raise RDataError(f"unsupported ALTREP class {cls}")


def unserialize(data: bytes) -> Any:
    """Decode one R object from uncompressed XDR serialization (format versions 2 and 3)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_lazyload_db(rdx_path: Path) -> dict[str, Any]:
    """All objects of an R lazy-load database (`x.rdx` index beside `x.rdb` blobs)."""
    raw = rdx_path.read_bytes()
    # R writes the index with gzip; accept the 4-byte-length + zlib framing of .rdb blobs too.
    index_bytes = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])
    index = unserialize(index_bytes).named()
    compression = index["compressed"].items[0]
    blobs = rdx_path.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, span in index["variables"].named().items():
        offset, size = span.items
        objects[name] = unserialize(_inflate(blobs[offset : offset + size], compression))
    return objects


def _inflate(chunk: bytes, compression: bool | int) -> bytes:
    if not compression:  # makeLazyLoadDB(compress = FALSE) stores bare serializations
        return chunk
    # Each blob: 4-byte big-endian uncompressed length, then the compressed stream.
    expected = struct.unpack_from(">I", chunk)[0]
    if compression == 1:  # TRUE: zlib
        out = zlib.decompress(chunk[4:])
    else:  # compress = 2 (bzip2) / 3 (xz) add one type byte; '0' means stored as is
        kind, body = chunk[4:5], chunk[5:]
        out = {b"2": bz2.decompress, b"Z": lzma.decompress, b"0": bytes}[kind](body)
    if len(out) != expected:
        raise RDataError(f"blob inflated to {len(out)} bytes, index says {expected}")
    return out


# ----------------------------------------------------------------------------------------------
# Lines -> paragraphs. The package keeps the Project Gutenberg layout: wrapped lines, blank lines
# between paragraphs, headings on their own ("CHAPTER I", "Chapter 1", "VOLUME II"), a title page
# before the first chapter and "FINIS" / "THE END" (or an editor's note) after the last.

_HEADING = re.compile(r"(chapter|volume)\s+[ivxlc\d]+\.?", re.IGNORECASE)
_END = re.compile(r"finis|the end|a note on the text", re.IGNORECASE)


def _clean(paragraph: str) -> str:
    # Gutenberg marks italics as _word_; drop the markup, keep the word. Collapse the
    # double spaces some novels put after full stops, so spacing is uniform across books.
    return " ".join(paragraph.replace("_", "").split())


def lines_to_paragraphs(lines: list[str | None]) -> list[str]:
    """Join wrapped lines into paragraphs; keep only the story (chapters, no headings)."""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in [*lines, ""]:  # the trailing "" flushes the last paragraph
        text = (line or "").strip()
        if text:
            current.append(text)
        elif current:
            paragraphs.append(_clean(" ".join(current)))
            current = []
    story: list[str] = []
    started = False  # title page and front matter come before the first chapter heading
    for paragraph in paragraphs:
        if _END.fullmatch(paragraph):
            break
        if _HEADING.fullmatch(paragraph):
            started = True
        # Paragraphs with no letters are scene breaks such as "* * * * *".
        elif started and any(c.isalpha() for c in paragraph):
            story.append(paragraph)
    return story


# ----------------------------------------------------------------------------------------------
# Fetching with the ordinary package tools, and the cache.


def _fetch_package(cache_dir: Path) -> tuple[Path, str]:
    """Download and unpack the .deb once; returns (extracted root, Debian version)."""
    debs = sorted(cache_dir.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        download = ["apt-get", "download", PACKAGE]
        if subprocess.run(download, cwd=cache_dir, capture_output=True).returncode != 0:
            # Usually a stale or empty package list; refresh it once and retry.
            subprocess.run(["apt-get", "update"], capture_output=True, check=True)
            subprocess.run(download, cwd=cache_dir, capture_output=True, check=True)
        debs = sorted(cache_dir.glob(f"{PACKAGE}_*.deb"))
    deb = debs[-1]
    root = cache_dir / deb.stem
    if not (root / _PKG_DIR / "DESCRIPTION").exists():
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    # apt names files <package>_<version>_<arch>.deb, with ':' written as %3a.
    return root, deb.stem.split("_")[1].replace("%3a", ":")


def _description(root: Path) -> dict[str, str]:
    """The fields of R's DESCRIPTION file (Debian-control syntax; continuations indented)."""
    fields: dict[str, str] = {}
    key = ""
    for line in (root / _PKG_DIR / "DESCRIPTION").read_text(encoding="utf-8").splitlines():
        if line[:1].isspace() and key:
            fields[key] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def _build(cache_dir: Path) -> dict[str, Any]:
    root, debian_version = _fetch_package(cache_dir)
    desc = _description(root)
    objects = read_lazyload_db(root / _PKG_DIR / "data" / "Rdata.rdx")
    missing = set(NOVELS) - set(objects)
    if missing:
        raise RDataError(f"{PACKAGE} lacks {sorted(missing)}")
    novels = {title: lines_to_paragraphs(objects[name].items) for name, title in NOVELS.items()}
    source = {
        **CORPUS_SOURCE,
        "version": desc["Version"],
        "debian_version": debian_version,
        "package_license": desc["License"],
    }
    return {"source": source, "novels": novels}


def _cached(cache_dir: Path) -> dict[str, Any]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / _CACHE_NAME
    if not path.exists():
        tmp = path.with_suffix(".tmp")  # write then rename, so a crash never leaves half a file
        tmp.write_text(json.dumps(_build(cache_dir), ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
    return json.loads(path.read_text(encoding="utf-8"))


def load_austen(cache_dir: Path) -> dict[str, list[str]]:
    """Novel title -> paragraphs, in publication order. Downloads only on the first call."""
    return _cached(Path(cache_dir))["novels"]


def corpus_source(cache_dir: Path) -> dict[str, str]:
    """CORPUS_SOURCE plus the versions read from the package, for the model card."""
    return _cached(Path(cache_dir))["source"]


def total_chars(novels: dict[str, list[str]]) -> int:
    """Characters of prose (paragraph separators not counted)."""
    return sum(len(p) for paragraphs in novels.values() for p in paragraphs)
