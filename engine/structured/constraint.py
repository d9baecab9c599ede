"""A request's structured-output constraint: canvas layout and per-slot token masks.

`Structured` is what a door asks for (a JSON schema, `json_object`, a regex, or a choice list).
`Compiler.compile` turns it, for one tokenizer and canvas length, into a `Layout`: the
skeleton's token ids at fixed canvas positions (committed before the first step), the slots
(start, capacity, regex) and the tail (stop ids after the structure). `Constraint` is the
per-request state the engine carries in the `Sequence`.

The out-of-order part, ours: slots fill left to right inside each slot and in parallel across
slots, so at each step only each unfinished slot's leftmost masked position (its *front*) is a
candidate, and its allowed tokens are those the slot's matcher (llguidance) accepts next. A
slot shorter than its capacity ends with its *filler*: the filler is allowed only where the
slot's text is a complete match, and once chosen every later position of the slot must be the
filler. The filler is the tokenizer's pad id where that is a special id decode drops and not a
stop id (the final text is exactly the JSON); else a space token between JSON values (still
exactly valid JSON), or, for a regex/choice filling the whole canvas, a stop id (the output
ends there). Capacities are at least the most bytes a slot's regex can match, and a token
covers at least one byte, so a slot never runs out of room before its match is complete.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from typing import Optional

import llguidance
import numpy as np
import torch

from celeris.engine.errors import FieldViolation, InvalidRequest
from celeris.engine.structured.completion import COMPILE_FUEL, NO_HINTS, Hints, OutOfFuel
from celeris.engine.structured.document import MAX_SHORTEST, Closer, Scan, Tokens, document_grammar, grammar_text, \
    locate, shortest
from celeris.engine.structured.examples import hints as schema_hints
from celeris.engine.structured.masks import unpack
from celeris.engine.structured.regexes import RegexError, literal, max_width
from celeris.engine.structured.schema import SchemaError, Text, compile_schema, json_object_slot

MAX_SCHEMA_CHARS = 393_216  # a schema's JSON text, checked before parsing (JSONSchemaBench's largest served: 236 KB)
# A schema over this many characters compiles on a lane of its own (engine/requests.py), one at a
# time and at most LARGE_SCHEMAS_WAITING waiting: its compile can take seconds (one 99 KB schema
# in JSON Schema Store takes 18 s, a cost llguidance's fuel limits do not bound), and it must not
# delay the small schemas most requests send.
LARGE_SCHEMA_CHARS = 32_768
LARGE_SCHEMAS_WAITING = 4
MAX_SCHEMA_NESTING = 32  # arrays/objects nested in a schema's JSON, checked before parsing (no recursion)
GRAMMAR_CACHE = 256  # slot grammars remembered with their verdicts, per tokenizer
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 256
KINDS = ("json_schema", "json_object", "regex", "choice")
# The engine's own kind, never a door's: an llguidance lark grammar the engine wrote (engine/agents
# writes a tool call's syntax around `%json {schema}` arguments), served on the whole-document path.
GRAMMAR = "grammar"
MAX_GRAMMAR_CHARS = 524_288
# llguidance's own work bounds (lexer states, parser items, mask-computation fuel), checked as it
# compiles a grammar and per token: a hostile regex fails instead of stalling a thread.
LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, step_lexer_fuel=2_000_000)


class StructureError(ValueError):
    """A structure that cannot be served: `path` names the field (or schema path)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class Structured:
    """What a door asks for: kind in KINDS; value the schema (a dict or its JSON text), the
    regex, or the list of choices; field is the value's path in the door's own spelling, the
    root of every path an error names (e.g. response_format.json_schema.schema)."""

    kind: str
    value: object = None
    field: str = "structured_output"

    @property
    def large(self) -> bool:
        """A schema over LARGE_SCHEMA_CHARS of JSON (the parsed value measured by re-encoding it)."""
        if self.kind not in ("json_schema", "grammar") or self.value is None:
            return False
        n = len(self.value) if isinstance(self.value, str) else len(json.dumps(self.value))
        return n > LARGE_SCHEMA_CHARS


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
                schema = self._schema(spec.value, f)
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
    def _schema(value: object, f: str) -> object:
        """The schema as Python values, its size and nesting checked first: JSON text by a scan
        of its brackets, parsed values by an explicit walk (neither recurses), so a schema nested
        thousands deep is refused by name, not by a RecursionError."""
        if isinstance(value, str):
            if len(value) > MAX_SCHEMA_CHARS:
                raise StructureError(f, f"at most {MAX_SCHEMA_CHARS} characters of JSON")
            if json_text_depth(value) > MAX_SCHEMA_NESTING:
                raise StructureError(f, f"nests arrays and objects more than {MAX_SCHEMA_NESTING} deep")
            try:
                return json.loads(value)
            except ValueError as e:
                raise StructureError(f, f"not valid JSON: {e}") from None
        if value_depth(value, MAX_SCHEMA_NESTING) > MAX_SCHEMA_NESTING:
            raise StructureError(f, f"nests arrays and objects more than {MAX_SCHEMA_NESTING} deep")
        if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
            raise StructureError(f, f"at most {MAX_SCHEMA_CHARS} characters of JSON")
        return value

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
        """(grammar, why it cannot be served or "") of a lark grammar's text (remembered)."""
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
        problem = self._verdict(grammar, "")
        return grammar, problem.split("\n")[0]  # the library's first line; the rest echoes the grammar

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


class Constraint:
    """One request's slots as it decodes: a matcher and a front per slot."""

    def __init__(self, layout: Layout, compiler: Compiler, field: str = "structured_output"):
        self.layout, self.field = layout, field  # field: the client's name for it, in its errors
        self.V = compiler.vocab_size
        self.words = (self.V + 31) // 32
        self._matchers = [llguidance.LLMatcher(compiler.ll, s.grammar, limits=LIMITS) for s in layout.slots]
        self._ended = [False] * len(layout.slots)
        self._eos = compiler.tok.eos_id
        self._mask = compiler.tok.mask_id
        self._by_front = {s.start: i for i, s in enumerate(layout.slots)}
        self._force: dict[int, int] = {}  # position -> the token the grammar forces there (forced slots)
        self._early: dict[int, int] = {}  # position -> token a step's chain committed before the sequence did
        # The forced slots' closing (document.Closer): a document ends before the canvas does.
        self._closers = {i: Closer(compiler.tokens, self.words, s.hints) for i, s in enumerate(layout.slots) if s.forced}
        # Typed decisions (engine/sampling/choice.py): whether this request asked for its options'
        # probabilities (a choice with logprobs; engine/requests.py sets it), and whether they are taken.
        self.score_choices = False
        self._scored = False

    @property
    def choice_horizon(self) -> int:
        """H: the output positions a choice's options are scored over, one past the longest
        option (its end), at most the canvas (engine/sampling/choice.py)."""
        longest = max(len(ids) for _, ids in self.layout.choices)
        return min(longest + 1, len(self.layout.canvas))

    def choice_columns(self, cols: list[int]) -> Optional[list[int]]:
        """The window columns of output positions [0, H) when this step is the one the options are
        scored at: asked for, not scored yet, the slot's front still at its first position (every
        slot position masked: the forward that commits its first token), and all H positions in
        this window. Else None. Marks them scored: called once per step, by `runner_api.select_step`."""
        if not self.score_choices or self._scored or self.layout.slots[0].start not in self._by_front:
            return None
        col_of = {p: j for j, p in enumerate(cols) if p >= 0}
        if 0 not in col_of:
            return None
        H = self.choice_horizon
        if not all(i in col_of for i in range(H)):  # requests.py refuses such a request up front
            raise self.failure(f"the first window holds fewer than the {H} positions its options are scored over")
        self._scored = True
        return [col_of[i] for i in range(H)]

    def choice_ids(self) -> torch.Tensor:
        """(K, H) long: each option's tokens from the slot's first position, the filler past its end."""
        H, filler = self.choice_horizon, self.layout.slots[0].filler
        return torch.tensor([list(ids[:H]) + [filler] * (H - len(ids)) for _, ids in self.layout.choices],
                            dtype=torch.long)

    def fixed(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(position, token) of the structure's fixed tokens in [lo, hi): the skeleton, and the stop
        id after the structure (also past the layout, for canvases rounded up beyond it)."""
        canvas = self.layout.canvas
        return [(p, canvas[p] if p < len(canvas) else self.layout.tail) for p in range(lo, hi)
                if p >= len(canvas) or canvas[p] != self._mask]

    def fronts(self, lo: int, hi: int) -> list[int]:
        """Canvas positions in [lo, hi) that may commit this step (each live slot's front)."""
        return sorted(p for p in self._by_front if lo <= p < hi)

    def window(self, cols: list[int]) -> tuple[list[int], np.ndarray]:
        """This row's fronts in a step's window, cols[j] the canvas position of column j (-1:
        none): (their columns, their allowed tokens as packed rows (N, ceil(V / 32)) uint32).
        InvalidRequest naming this request's own field if its matcher raises or allows nothing
        at a front (its language ended: nothing could be served)."""
        col_of = {p: j for j, p in enumerate(cols) if p >= 0}
        try:  # llguidance runs in both: its errors are this request's alone
            if col_of:
                self._fast_forward(min(col_of), max(col_of) + 1)
            fronts = self.fronts(min(col_of), max(col_of) + 1) if col_of else []
            words = np.zeros((len(fronts), self.words), dtype=np.uint32)
            for k, p in enumerate(fronts):
                self.fill(p, words[k])
                if not words[k].any():
                    raise self.failure(f"no token can continue it at output position {p}", self._by_front[p])
        except InvalidRequest:
            raise
        except Exception as e:  # llguidance's own error text quotes the state: the type names it
            raise self.failure(f"the constraint library failed ({type(e).__name__})") from None
        return [col_of[p] for p in fronts], words

    def _fast_forward(self, lo: int, hi: int) -> None:
        """A forced slot whose front is in [lo, hi): the tokens its grammar forces next (llguidance's
        fast-forward tokens) go to the matcher now and their positions become fronts that allow
        only them, the position after them the slot's front: they all commit this step. What is
        forced is certain whatever the model picks, so the matcher may run ahead of the canvas."""
        for p, i in list(self._by_front.items()):
            s = self.layout.slots[i]
            if not s.forced or self._ended[i] or p in self._force or not lo <= p < hi:
                continue
            ff = self._matchers[i].compute_ff_tokens()
            if ff:  # the completion's spelling (what fits counts it), so the completion is found
                # first (a document's opening is forced before any front asked for it), and chosen
                # over all the forced bytes before the window cuts them: cut first, a forced key's
                # first piece in llguidance's spelling would not be the completion's first token.
                self._closers[i].completion(self._matchers[i], self._room(s, p))
                ff = self._closers[i].spelled(ff)
            ff = ff[:max(0, min(hi, s.start + s.capacity - 1) - p)]
            ff = ff[:self._matchers[i].try_consume_tokens(ff)] if ff else ff
            if not ff:
                continue
            self._closers[i].consumed(ff)
            for k, t in enumerate(ff):
                self._force[p + k] = t
                self._by_front[p + k] = i
            self._by_front[p + len(ff)] = i

    def failure(self, reason: str, slot: Optional[int] = None) -> InvalidRequest:
        """This request's error when its structure cannot go on: names its own field (the slot's
        schema path where known) and nothing else."""
        path = self.layout.slots[slot].path if slot is not None else ""
        return InvalidRequest([FieldViolation(path or self.field, f"the structure cannot be served: {reason}")])

    def fill(self, pos: int, words: np.ndarray) -> None:
        """Write the tokens the slot whose front is `pos` may commit there into `words`, a
        contiguous (ceil(V / 32),) uint32 row, as bits (token t: bit t % 32 of word t // 32).
        llguidance writes its mask straight into the row (no Python per token)."""
        i = self._by_front[pos]
        s = self.layout.slots[i]
        filler = s.filler
        if pos in self._force:  # a token the grammar forces, already consumed
            words[:] = 0
            filler = self._force[pos]
        elif self._ended[i]:
            words[:] = 0
        elif s.forced and (close := self._closers[i].closing(self._matchers[i], self._room(s, pos))) is not None:
            words[:] = 0  # the canvas runs short: only the completion's next token, to the document's end
            filler = close[0] if close else filler
        else:
            m = self._matchers[i]
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            words[self._eos >> 5] &= ~np.uint32(1 << (self._eos & 31))  # ends are the filler's job
            if s.forced:  # near the end: no token after which the document could not end in time
                self._closers[i].check(m, self._room(s, pos), words)
            if not m.is_accepting():
                return
        words[filler >> 5] |= np.uint32(1 << (filler & 31))

    @staticmethod
    def _room(s: SlotSpec, pos: int) -> int:
        """Positions a whole-document slot's front at `pos` may still fill, this one included: one
        is kept for the stop id after the document, so a document never fills the canvas to its
        last position and ends as `length` (a tool call then reads as cut)."""
        return s.start + s.capacity - pos - 1

    def allowed(self, pos: int) -> torch.Tensor:
        """(V,) bool: the tokens the slot whose front is `pos` may commit there."""
        words = np.zeros((1, self.words), dtype=np.uint32)
        self.fill(pos, words[0])
        return unpack(words, self.V, torch.device("cpu"))[0]

    def commit(self, pos: int, token: int) -> None:
        """The slot whose front is `pos` committed `token` there: move its front right. A slot
        that ends makes all its remaining positions fronts at once (each allows the filler only).
        A position `commit_early` already took is not taken twice."""
        early = self._early.pop(pos, None)
        if early is not None:
            if early != token:  # the sequence applies the step's own picks: never happens
                raise self.failure(f"output position {pos} took token {token} after {early}")
            return
        self._advance(pos, token)

    def commit_early(self, pos: int, token: int) -> None:
        """`commit` during the step that picked `token` (runner_api's chain): the slot's front
        moves now, so the same step can pick at the next position under its mask; the sequence's
        own `commit` of it afterwards is a no-op."""
        self._advance(pos, token)
        self._early[pos] = token

    def _advance(self, pos: int, token: int) -> None:
        i = self._by_front.pop(pos)
        s = self.layout.slots[i]
        if pos in self._force:
            if self._force.pop(pos) != token:  # the mask allowed only the forced token
                raise self.failure(f"a forced position took token {token} at output position {pos}", i)
            return
        if self._ended[i]:
            return
        end = s.start + s.capacity
        if token == s.filler and self._matchers[i].is_accepting():
            self._ended[i] = True
            self._by_front.update((p, i) for p in range(pos + 1, end))
            return
        if not self._matchers[i].consume_token(token):  # the mask allowed it: its matcher broke
            raise self.failure(f"its matcher refused token {token} at output position {pos}", i)
        if i in self._closers:
            self._closers[i].consumed([token])
        if pos + 1 < end:
            self._by_front[pos + 1] = i


def json_text_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text (brackets inside strings not counted): one
    linear scan, before any parser recurses into it."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped whole), or a bracket


def value_depth(value: object, limit: int) -> int:
    """How deep lists and dicts nest in `value`, walked without recursion and stopping past
    `limit` (returns limit + 1 there)."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            if d > limit:
                return d
            deepest = max(deepest, d)
            stack += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest
