"""Compiling a `Structured` request for one tokenizer and canvas length into a `Layout`.

`Compiler.compile` turns a door's structure into the skeleton's token ids at fixed canvas
positions (committed before the first step), the slots (start, capacity, grammar) and the tail
(stop ids after the structure). A schema inside the skeleton's subset (schema.py) is placed first
and its size checked against the canvas before any slot compiles; one outside it goes to the
whole-document path (document.py), a regex or choice fills the canvas as one slot, and an
engine-written lark grammar (a tool call) is one forced slot. Every grammar's verdict (the
library's refusal, an empty language) is remembered per tokenizer, so a client repeating a
schema does not repeat the work. Slot capacities are at least the most bytes a slot's regex can
match, and a token covers at least one byte, so a slot never runs out of room.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from typing import Optional

import llguidance
import numpy as np

from celeris.engine.structured.completion import COMPILE_FUEL, NO_HINTS, Hints, LibraryStopped, OutOfFuel
from celeris.engine.structured.document import MAX_SHORTEST, Scan, Tokens, document_grammar, grammar_text, locate, \
    shortest
from celeris.engine.structured.examples import hints as schema_hints
from celeris.engine.structured.regexes import RegexError, literal, max_width
from celeris.engine.structured.schema import SchemaError, Text, compile_schema, json_object_slot
from celeris.engine.structured.spec import GRAMMAR, GRAMMAR_CACHE, KINDS, LIMITS, MAX_CHOICE_CHARS, MAX_CHOICES, \
    MAX_GRAMMAR_CHARS, StructureError, Structured, read_schema


@dataclass(frozen=True)
class SlotSpec:
    start: int  # canvas position of its first token
    capacity: int
    grammar: str
    filler: int
    path: str = ""  # the field or schema path it serves, named in its errors
    forced: bool = False  # positions the grammar forces commit in the same step (the document path)
    hints: Hints = NO_HINTS  # what a forced slot's closing may try (examples.hints)


@dataclass(frozen=True)
class Layout:
    canvas: tuple[int, ...]  # skeleton ids, mask at slot positions, the tail's stop id
    slots: tuple[SlotSpec, ...]
    tail: int  # the stop id after the structure (block models decode past gen_length)
    path: str = "skeleton"  # how it decodes, reported per request: skeleton, document or regex
    # A choice's options as its slot would hold them: (text, canonical token ids), in the order
    # given (engine/sampling/choice.py scores them); () for every other kind.
    choices: tuple[tuple[str, tuple[int, ...]], ...] = ()
    needed: int = 0  # canvas tokens the structure needs at the most (0: bounded only by the canvas)


class Compiler:
    """Compiles `Structured` requests for one tokenizer (building llguidance's tokenizer once)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tok = tokenizer
        self.ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=tokenizer.eos_id)
        self.vocab_size = vocab_size
        pad = tokenizer.pad_id
        self.pad = pad if pad in tokenizer.special_ids and pad not in tokenizer.stop_ids and pad != tokenizer.mask_id \
            else None
        space = self._encode(" ")
        self.json_filler = self.pad if self.pad is not None else (space[0] if len(space) == 1 else None)
        self._checked = functools.lru_cache(maxsize=GRAMMAR_CACHE)(self._check)
        self._documents = functools.lru_cache(maxsize=GRAMMAR_CACHE)(self._document_check)
        self._larks = functools.lru_cache(maxsize=GRAMMAR_CACHE)(self._lark_check)
        self._tokens: Optional[Tokens] = None

    @property
    def tokens(self) -> Tokens:
        """Each token's bytes and the completion's byte orders (document.Tokens), built on first use."""
        if self._tokens is None:
            self._tokens = Tokens(self.ll, self.vocab_size, self.tok.eos_id)
        return self._tokens

    def _encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text)
        return ids[1:] if self.tok.add_bos else ids

    def compile(self, spec: Structured, gen_length: int) -> Layout:
        """The layout of `spec` on a canvas of gen_length positions; StructureError if it is
        outside the supported subset or does not fit."""
        f = spec.field
        try:
            if spec.kind == "json_schema":
                schema = read_schema(spec.value, f)
                try:
                    parts = compile_schema(schema, f)
                except (SchemaError, RegexError) as e:  # outside the skeleton's subset
                    if getattr(e, "empty", False):  # unsatisfiable as written: named, on every path
                        raise
                    return self._document(schema, gen_length, f, e)
            elif spec.kind == "json_object":
                parts = [json_object_slot(gen_length)]
            elif spec.kind == "regex":
                return self._whole(self._regex(spec.value, f), gen_length, f)
            elif spec.kind == "choice":
                layout = self._whole(self._choice(spec.value, f), gen_length, f)
                return replace(layout, choices=tuple((c, tuple(self._encode(c))) for c in spec.value))
            elif spec.kind == GRAMMAR:
                return self._lark(spec.value, gen_length, f)
            else:
                raise StructureError(f, f"unknown kind {spec.kind!r}; one of {', '.join(KINDS)}")
        except (SchemaError, RegexError) as e:
            raise StructureError(e.path, e.reason) from None
        return self._json_layout(parts, gen_length, f)

    @staticmethod
    def _regex(value: object, f: str) -> tuple[str, int]:
        """(regex, most bytes a match takes). An ASCII regex is matched within ASCII (`_grammar`),
        one byte a character; otherwise a character may take 4."""
        if not isinstance(value, str) or not value:
            raise StructureError(f, "must be a non-empty regex string")
        width = max_width(value, f)
        return value, width if value.isascii() else 4 * width

    @staticmethod
    def _choice(value: object, f: str) -> tuple[str, int]:
        if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_CHOICES:
            raise StructureError(f, f"must list 1 to {MAX_CHOICES} strings")
        for i, c in enumerate(value):
            if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                raise StructureError(f"{f}[{i}]", f"must be a non-empty string of at most {MAX_CHOICE_CHARS} characters")
        return "(" + "|".join(literal(c) for c in value) + ")", max(len(c.encode()) for c in value)

    def _whole(self, regex_bytes: tuple[str, int], gen_length: int, f: str) -> Layout:
        """A regex or choice: the whole canvas is one slot, ended by a stop id."""
        regex, need = regex_bytes
        if need > gen_length:
            raise StructureError(f, f"its matches can take {need} tokens; the canvas (max_tokens) has {gen_length}")
        grammar = self._grammar(regex, f, r"[\x00-\x7f]*" if regex.isascii() else None)
        return Layout((self.tok.mask_id,) * gen_length, (SlotSpec(0, gen_length, grammar, self.tok.eos_id, f),),
                      self.tok.eos_id, "regex", needed=need)

    def _document(self, schema: object, gen_length: int, f: str, why: ValueError) -> Layout:
        """The whole-document path (document.py): one slot over the canvas, the document's own
        grammar, ended by the stop id; bounded only by the canvas (max_tokens). Refused where
        llguidance refuses it, by the path its error points at (else where the skeleton stopped)."""
        grammar, problem, least, hints = self._documents(grammar_text(schema))
        if problem:
            raise StructureError(locate(schema, problem, f) or getattr(why, "path", f), problem)
        if least < 0:  # none found within MAX_SHORTEST bytes: its end could not be promised, so never served
            raise StructureError(f, f"no document of at most {MAX_SHORTEST} bytes was found for it; the canvas "
                                    f"(max_tokens) has {gen_length} tokens")
        if least + 1 > gen_length:  # never served as a prefix: refused up front (a request with no length is fitted)
            raise StructureError(f, f"its shortest document takes {least} tokens and its stop token one more; the "
                                    f"canvas (max_tokens) has {gen_length}")
        return Layout((self.tok.mask_id,) * gen_length, (SlotSpec(0, gen_length, grammar, self.tok.eos_id, f,
                                                                   forced=True, hints=hints),),
                      self.tok.eos_id, "document", needed=least + 1)  # the stop token after it

    def _lark(self, text: object, gen_length: int, f: str) -> Layout:
        """An engine-written lark grammar (GRAMMAR) on the whole-document path: one forced slot over
        the canvas, ended by the stop id, refused (by `f`) where llguidance refuses it."""
        if not isinstance(text, str) or not text or len(text) > MAX_GRAMMAR_CHARS:
            raise StructureError(f, f"a grammar of 1 to {MAX_GRAMMAR_CHARS} characters")
        grammar, problem = self._larks(text)
        if problem:
            raise StructureError(f, problem)
        return Layout((self.tok.mask_id,) * gen_length,
                      (SlotSpec(0, gen_length, grammar, self.tok.eos_id, f, forced=True),), self.tok.eos_id, "document")

    def _lark_check(self, text: str) -> tuple[str, str]:
        """(grammar, why it cannot be served or "") of a lark grammar's text (remembered). Its
        shortest sentence is searched for here, within COMPILE_FUEL, as a document's is: a grammar
        whose end the decode-time closing could not find (a string pattern of bytes no
        single-byte token spells, `[^\\x00-\\x7f]{1,5}`, took 26-35 s of search over one call) is
        refused now, not discovered step by step."""
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
        problem = self._verdict(grammar, "").split("\n")[0]  # the library's first line; the rest echoes the grammar
        if problem:
            return grammar, problem
        try:
            path = shortest(self.tokens, llguidance.LLMatcher(self.ll, grammar, limits=LIMITS), Scan(), MAX_SHORTEST,
                            np.zeros((self.vocab_size + 31) // 32, np.uint32), fuel=COMPILE_FUEL)
        except OutOfFuel:
            return grammar, f"its shortest text was not found within the search budget ({COMPILE_FUEL:,} grammar steps)"
        except LibraryStopped as e:
            return grammar, f"the constraint library stops on it while decoding (one of its parser limits): {e}"
        if path is None:
            return grammar, f"no text of at most {MAX_SHORTEST} bytes was found for it (its end could not be promised)"
        return grammar, ""

    def _document_check(self, text: str) -> tuple[str, str, int, Hints]:
        """(grammar, why it cannot be served or "", the fewest tokens its shortest document takes
        as the closing writes it, completion.shortest; -1 if none is found; what its closing tries,
        examples.hints) of a schema's JSON text (remembered)."""
        try:
            schema = json.loads(text)
            grammar = document_grammar(schema)
        except ValueError as e:
            return "", f"the constraint library refuses it: {str(e)[:200]}", 0, NO_HINTS
        problem = self._verdict(grammar, "")
        if problem:
            return grammar, problem, 0, NO_HINTS
        m, hints = llguidance.LLMatcher(self.ll, grammar, limits=LIMITS), schema_hints(schema)
        try:
            path = shortest(self.tokens, m, Scan(), MAX_SHORTEST, np.zeros((self.vocab_size + 31) // 32, np.uint32),
                            fuel=COMPILE_FUEL, hints=hints)
        except OutOfFuel:
            return grammar, (f"its shortest document was not found within the search budget ({COMPILE_FUEL:,} "
                             "grammar steps)"), 0, NO_HINTS
        except LibraryStopped as e:  # e.g. 500 optional properties: past the parser's items in a row
            return grammar, f"the constraint library stops on it while decoding (one of its parser limits): {e}", 0, \
                NO_HINTS
        return grammar, "", -1 if path is None else len(path), hints  # -1: none found (refused)

    def _grammar(self, regex: str, f: str, within: Optional[str] = None) -> str:
        """llguidance's grammar of a regex (intersected with `within`, a lexeme-level `&`),
        refused if the library refuses it or its language is empty. Remembered per (regex,
        within): a client repeating a schema does not repeat the work."""
        grammar, problem = self._checked(regex, within)
        if problem:
            raise StructureError(f, problem)
        return grammar

    def _check(self, regex: str, within: Optional[str]) -> tuple[str, str]:
        """(grammar, why it cannot be served or ""): compiled, then one fresh matcher's first
        mask: a matcher that fails at once, or allows no token and does not accept, has an
        empty language (e.g. a character class outside the slot's alphabet), which would
        otherwise fail only at the request's first step."""
        if within is None:
            grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        else:
            esc = lambda r: re.sub(r"(?<!\\)/", r"\/", r)  # noqa: E731  (lark's /.../ delimiters)
            grammar = llguidance.LLMatcher.grammar_from_lark(f"start: S\nS: /{esc(regex)}/ & /{esc(within)}/")
        where = "" if within is None else " within the characters its slot may hold: ASCII, printable in a JSON string"
        return grammar, self._verdict(grammar, where)

    def _verdict(self, grammar: str, where: str) -> str:
        """Why a grammar cannot be served, or "": the library refuses it, or a fresh matcher fails
        at once or allows no token and does not accept (an empty language)."""
        msg = llguidance.LLMatcher.validate_grammar(grammar, self.ll, limits=LIMITS)
        if msg:
            return f"the constraint library refuses it: {msg[:200]}"
        m = llguidance.LLMatcher(self.ll, grammar, limits=LIMITS)
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        words[self.tok.eos_id >> 5] &= ~np.uint32(1 << (self.tok.eos_id & 31))  # ends are the filler's
        if m.is_error() or not (words.any() or m.is_accepting()):
            return f"its language is empty (no text matches it{where}): nothing could be served"
        return ""

    def _json_layout(self, parts, gen_length: int, f: str) -> Layout:
        """The skeleton placed and its size checked against the canvas first (cheap), then each
        slot's grammar compiled: a schema that cannot fit costs no compile."""
        if self.json_filler is None:
            raise StructureError(f, "this model's tokenizer has no filler token (pad or a single-token space)")
        canvas: list[int] = []
        placed = []  # (start, slot part)
        for part in parts:
            if isinstance(part, Text):
                ids = self._encode(part.text)
                if self.tok.decode(ids) != part.text:
                    raise StructureError(f, f"the skeleton {part.text!r} does not decode back through this tokenizer")
                canvas += ids
            else:
                placed.append((len(canvas), part))
                canvas += [self.tok.mask_id] * part.max_bytes
            if len(canvas) > gen_length:
                raise StructureError(f, f"the schema needs more than {gen_length} canvas tokens (max_tokens)")
        slots = tuple(SlotSpec(start, part.max_bytes, self._grammar(part.regex, part.path, part.within),
                               self.json_filler, part.path) for start, part in placed)
        tail = min(self.tok.stop_ids) if self.tok.stop_ids else self.tok.eos_id
        return Layout(tuple(canvas) + (tail,) * (gen_length - len(canvas)), slots, tail, needed=len(canvas))


