"""Requests: user input (text, token ids, chat messages) to validated decoding state.

`Requests.build` is the one place both doors' requests are checked, every bad field reported at
once, size limits before any tokenizing (an oversized input costs nothing), parameters checked
once. Tokenizing is CPU work proportional to the input: the `*_async` forms run it on worker
threads, off the server's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import secrets
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Optional, Sequence as Seq, Union

from celeris.engine.agents import history
from celeris.engine.agents.tools import compile_problems
from celeris.engine.config import PROMPT_ROOM_CAP, EngineConfig
from celeris.engine.errors import FieldViolation, InvalidRequest
from celeris.engine.families.family import Family
from celeris.engine.families.registry import row_of
from celeris.engine.sampling.params import MAX_SEED, SamplingParams, fit_lengths
from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.structured.constraint import LARGE_SCHEMA_CHARS, Compiler, Constraint, StructureError, Structured
from celeris.engine.structured.lanes import Lanes
from celeris.engine.structured.verdicts import Verdicts
from celeris.engine.tokenizer import Tokenizer

# What a door's request may say, named here for the doors: the server imports four engine modules,
# this one, serving, events and errors (tests/unit/test_imports.py).
from celeris.engine.agents.history import CHAT_ROLES, MAX_JSON_NESTING  # noqa: F401
from celeris.engine.agents.parsers import TOOL_PARSERS, detect_tool_parser  # noqa: F401
from celeris.engine.agents.reasoning import REASONING_PARSERS, detect_reasoning_parser  # noqa: F401
from celeris.engine.agents.tools import parse_tool_choice, parse_tools  # noqa: F401
from celeris.engine.sampling.knobs import BOOL, CHOICE, FLOAT, IDS, INT, STRINGS, Knob, on  # noqa: F401
from celeris.engine.structured.constraint import (MAX_SCHEMA_CHARS, MAX_SCHEMA_NESTING,  # noqa: F401
                                                  json_text_depth, value_depth)

Prompt = Union[str, Seq[int]]
MAX_REQUEST_ID = 128  # characters
MAX_CACHE_SALT = 256  # characters
# A plain prompt this short (characters, or ids) is built on the caller's event loop: 40-260 us
# of validation and tokenizing (celeris-tiny: ASCII words to random non-Latin text, 2026-12-07)
# against ~220 us for the hop to a worker thread and back on an idle loop, more under a burst of
# calls (the first messages of 32 calls at once came ~8 ms sooner). Longer prompts, chat messages
# and structured outputs go to worker threads: what a client sends never holds the loop longer
# than building a prompt of this size.
INLINE_PROMPT = 256


@dataclass(frozen=True)
class Request:
    """One generation request as a front door hands it over: exactly one of prompt, token_ids,
    messages. `LLM.build` validates it all, once, for both doors."""

    prompt: Optional[str] = None
    token_ids: Optional[Seq[int]] = None
    messages: Optional[Seq[dict]] = None
    params: Optional[SamplingParams] = None  # None: the model's defaults
    request_id: str = ""  # empty: one is made up
    structured: Optional[Structured] = None  # structured output (engine/structured), None: free text
    cache_salt: Optional[str] = None  # the prefix cache's tenant: salts apart never share entries
    tools: Optional[Seq[dict]] = None  # chat only: OpenAI-shaped tools the chat template renders (engine/agents)
    # The client set no length (no max_tokens / gen_length, steps or block_length): a structured
    # output that needs more than the default canvas gets one as long as it needs, up to
    # max_gen_length, instead of a refusal.
    fit_canvas: bool = False

    def samples(self, n: int, first: int = 0, numbered: bool = False) -> list[Request]:
        """n samples of this request for a door's `n`: sample j uses seed + j when seeded (so it
        equals the single request with that seed; unseeded, the engine picks each seed); with
        `numbered`, a client id becomes id-k for k = first + j."""
        seed = None if self.params is None else self.params.seed
        return [replace(self, request_id=f"{self.request_id}-{first + j}" if numbered and self.request_id
                        else self.request_id,
                        params=self.params if seed is None or j == 0 else
                        replace(self.params, seed=(seed + j) % (MAX_SEED + 1)))
                for j in range(n)]


def _short_plain(req: Request) -> bool:
    """A prompt (text or ids) of at most INLINE_PROMPT, with no chat messages, tools or structure."""
    if req.messages is not None or req.tools is not None or req.structured is not None:
        return False
    prompt = req.prompt if req.prompt is not None else req.token_ids
    return prompt is None or (isinstance(prompt, (str, list, tuple)) and len(prompt) <= INLINE_PROMPT)


class Requests:
    """Builds validated `DecodeSequence`s for one loaded model."""

    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, defaults: SamplingParams, family: Family):
        self.tokenizer, self.config, self.defaults, self.family = tokenizer, config, defaults, family
        self.row = row_of(family)  # how its requests' state is built
        # Seeds of requests that give none: the OS's, or a seeded generator (serve --seed) for a reproducible run.
        self.seeds: random.Random = secrets.SystemRandom()
        self._encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="celeris-encode")
        self._compiler: Optional[Compiler] = None  # built on the first structured request
        self._verdicts: dict[str, Verdicts] = {}  # tools' schema verdicts: a child process per lane (thread)
        # Structured requests and requests with tools are built on the compile lanes (engine/structured/lanes.py).
        self.lanes = Lanes()

    @property
    def _large_waiting(self) -> int:
        return self.lanes.large_waiting

    def _verdicts_here(self) -> Verdicts:
        """The verdicts' child of the calling thread's lane: a large lane's compile never holds up
        the small lane's (each lane is one thread; started on its first tools request)."""
        name = threading.current_thread().name
        if name not in self._verdicts:
            self._verdicts[name] = Verdicts()
        return self._verdicts[name]

    @property
    def family_vocab(self) -> int:
        """The model's vocabulary size: the width of every token mask."""
        return self.tokenizer.vocab_size

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this can fit in max_prompt_tokens, so it is refused untokenized."""
        return self.config.max_prompt_tokens * self.tokenizer.max_token_chars

    @property
    def _limit_text(self) -> str:
        """The prompt limit as a refusal states it: the number and the server flag that sets it."""
        return (f"the limit is {self.config.max_prompt_tokens} tokens (a server sets it with --max-prompt-tokens; "
                f"by default the model's own position range less the canvas, at most {PROMPT_ROOM_CAP})")

    def _too_long(self, field: str, what: str, chars: int) -> FieldViolation:
        return FieldViolation(field, f"{what} {chars} characters; the limit is {self.config.max_prompt_tokens} "
                                     f"tokens ({self.max_prompt_chars} characters)")

    def _check_size(self, req: Request) -> list[FieldViolation]:
        """Limits that need no tokenizing, checked first so an oversized input costs nothing."""
        v: list[FieldViolation] = []
        given = [name for name in ("prompt", "token_ids", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            return [FieldViolation("input", "set one of prompt, token_ids or messages (exactly one)")]
        limit, tokens = self.max_prompt_chars, self.config.max_prompt_tokens
        if req.prompt is not None:
            if not isinstance(req.prompt, str):
                v.append(FieldViolation("prompt", "must be a string"))
            elif not req.prompt:
                v.append(FieldViolation("prompt", "must not be empty"))
            elif len(req.prompt) > limit:
                v.append(self._too_long("prompt", "is", len(req.prompt)))
        elif req.token_ids is not None:
            if not req.token_ids:
                v.append(FieldViolation("token_ids", "must not be empty"))
            elif len(req.token_ids) > tokens:
                v.append(FieldViolation("token_ids", f"prompt is {len(req.token_ids)} tokens; {self._limit_text}"))
        else:
            limits = (self.config.max_prompt_tokens, self.max_prompt_chars)
            v += history.check_messages(req.messages, req.tools, limits, self._too_long)
        return v

    def _encode(self, req: Request) -> tuple[list[int], str]:
        """Tokenize a request that passed `_check_size`; (ids, the field they came from)."""
        if req.messages is not None:
            return self.tokenizer.encode_chat(req.messages, tools=req.tools), "messages"
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt), "prompt"
        ids = list(req.token_ids)
        self.tokenizer.check_ids(ids, "token_ids")
        return ids, "token_ids"

    def build(self, req: Request) -> DecodeSequence:
        """Validate and encode a whole request, reporting every bad field at once; the one place
        both doors' requests are checked. Size limits come before any tokenizing."""
        v: list[FieldViolation] = []
        rid = req.request_id
        if not isinstance(rid, str) or len(rid) > MAX_REQUEST_ID:
            v.append(FieldViolation("request_id", f"at most {MAX_REQUEST_ID} characters"))
        params = req.params or self.defaults
        v += self.violations(params)
        ids: list[int] = []
        try:
            ids = self._prompt_ids(req)
        except InvalidRequest as e:
            v += e.violations
        except RecursionError:  # every limit is checked first; a parser's recursion is still the input's fault
            v.append(FieldViolation("input", "nests too deeply to be read"))
        if req.tools and not v:  # after the prompt's length (the tools' rendering counts in it), before compiling
            v += compile_problems(req.tools, self._verdicts_here())
        constraint = None
        if req.structured is not None and req.structured.lazy and not self._serves_lazy(params):
            req = replace(req, structured=None)  # decoded free, its answer parsed after the fact
        if req.structured is not None and not v:
            try:
                params, constraint = self._structure(req, params)
            except InvalidRequest as e:
                v += e.violations
            except RecursionError:
                v.append(FieldViolation(req.structured.field, "nests too deeply to be read"))
        if req.cache_salt is not None and (not isinstance(req.cache_salt, str) or len(req.cache_salt) > MAX_CACHE_SALT):
            v.append(FieldViolation("cache_salt", f"a string of at most {MAX_CACHE_SALT} characters"))
        if v:
            raise InvalidRequest(v)
        seq = self._sequence(ids, params, rid, constraint)
        if constraint is not None and constraint.score_choices:
            self._check_choice_window(seq, req.structured.field)
        seq.cache_salt = req.cache_salt or ""  # block families' prefix cache (engine/models/prefix_cache.py)
        return seq

    def _serves_lazy(self, params: SamplingParams) -> bool:
        """Whether a structure the model may decline (`Structured.lazy`: tool_choice "auto") is
        served: on the whole-document path, where nothing the request sets could cut it."""
        return self.row.lazy_structures and not (params.stop or params.stop_token_ids or params.min_tokens)

    def _structure(self, req: Request, params: SamplingParams) -> tuple[SamplingParams, Constraint]:
        """The request's constraint and the parameters it decodes with: a request that set no
        length (`fit_canvas`) and whose structure needs more than the default canvas gets a canvas
        as long as the structure needs (rounded up to whole blocks, at most max_gen_length), or
        as long as its `room_text` (a lazy tool grammar's two typical calls)."""
        room = req.structured.room_text
        if req.fit_canvas and room:
            need = min(len(self.tokenizer.encode(room)) + 1, self.config.max_gen_length)
            if need > params.gen_length:
                b = params.block_length
                fitted = fit_lengths(params, {"gen_length": min(-(-need // b) * b, self.config.max_gen_length)})
                if not self.violations(fitted):
                    params = fitted
        try:
            return params, self.constraint(req.structured, params)
        except InvalidRequest as too_short:
            longest = self.config.max_gen_length
            if not req.fit_canvas or params.gen_length >= longest:
                raise
            try:
                need = self.constraint(req.structured, replace(params, gen_length=longest)).layout.needed
            except InvalidRequest:
                raise too_short from None
            if not params.gen_length < need <= longest:  # refused for another reason than its length
                raise too_short from None
            b = params.block_length
            fitted = fit_lengths(params, {"gen_length": min(-(-need // b) * b, longest)})
            if self.violations(fitted):
                raise too_short from None
            return fitted, self.constraint(req.structured, fitted)

    def constraint(self, spec: Structured, params: SamplingParams) -> Constraint:
        """A structured output's per-request state (sizes are checked before anything compiles;
        callers run this on a worker thread). Options that could cut or bend the structure
        (stop strings and ids, min_tokens) are refused with it, never applied half-way."""
        if not self.row.structured:
            raise InvalidRequest([FieldViolation(spec.field, "structured outputs are not served on this model's "
                                                             "family yet (its decoding order has no grammar path)")])
        v = [FieldViolation(name, f"cannot be combined with {spec.field}: it could cut the structure")
             for name, bad in (("stop", params.stop), ("stop_token_ids", params.stop_token_ids),
                               ("min_tokens", params.min_tokens)) if bad]
        if v:
            raise InvalidRequest(v)
        if self._compiler is None:
            self._compiler = Compiler(self.tokenizer, self.family_vocab)
        try:
            layout = self._compiler.compile(spec, params.gen_length)
        except StructureError as e:
            raise InvalidRequest([FieldViolation(e.path, e.reason)]) from None
        constraint = Constraint(layout, self._compiler, spec.field)
        if spec.kind == "choice" and params.logprobs is not None:  # typed decisions (engine/sampling/choice.py)
            constraint.score_choices = True
        return constraint

    @staticmethod
    def _check_choice_window(seq: DecodeSequence, field: str) -> None:
        """A choice's options are scored in one forward over the first H output positions
        (engine/sampling/choice.py): they must all lie in the block that decodes position 0."""
        H, reach = seq.constraint.choice_horizon, seq.first_window
        if H > reach:
            raise InvalidRequest([FieldViolation(field, f"with logprobs, every option and its end ({H} tokens) are "
                                                        f"scored in the first block, which holds {reach} output "
                                                        f"positions here: raise block_length or shorten the options")])

    def violations(self, params: SamplingParams) -> list[FieldViolation]:
        """Every reason these parameters cannot run here: their own limits, this engine's
        gen_length limit, the family's options, stop ids outside the vocabulary."""
        try:
            params.validate(self.config.max_gen_length)
        except InvalidRequest as e:
            return e.violations
        v = self.family.violations(params)
        try:
            self.tokenizer.check_ids(list(params.stop_token_ids), "stop_token_ids")
        except InvalidRequest as e:
            v += e.violations
        return v

    def _prompt_ids(self, req: Request) -> list[int]:
        size = self._check_size(req)
        if size:
            raise InvalidRequest(size)
        ids, field = self._encode(req)
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidRequest([FieldViolation(field, f"prompt is {len(ids)} tokens; {self._limit_text}")])
        return ids

    async def build_async(self, req: Request, inline: bool = True, client: str = "") -> DecodeSequence:
        """`build` in a worker thread, so tokenizing never stalls the caller's event loop: one with
        a structured output or tools on the compile lanes (engine/structured/lanes.py; `client`
        caps one client's builds there); with `inline` (a call of one sample: a door's n samples
        each build their own), a short plain prompt on the loop itself (INLINE_PROMPT says why)."""
        if req.structured is None and not req.tools:
            if inline and _short_plain(req):
                return self.build(req)
            return await asyncio.get_running_loop().run_in_executor(self._encoder, self.build, req)
        large = (req.structured is not None and req.structured.large) or \
            history.tools_size(req.tools, []) > LARGE_SCHEMA_CHARS
        return await self.lanes.run(self.build, req, large, client)

    def tokenize(self, text: str, chat: bool = False) -> tuple[list[int], list[str]]:
        """Ids and token strings of user text (in the chat template when `chat`), size-checked first."""
        if len(text) > self.max_prompt_chars:
            raise InvalidRequest([self._too_long("text", "is", len(text))])
        if chat:
            ids = self.tokenizer.encode_chat([{"role": "user", "content": text}])
        else:
            ids = self.tokenizer.encode(text) if text else []
        return ids, self.tokenizer.tokens(ids)

    async def tokenize_async(self, text: str, chat: bool = False) -> tuple[list[int], list[str]]:
        return await asyncio.get_running_loop().run_in_executor(self._encoder, self.tokenize, text, chat)

    def encode_prompt(self, prompt: Prompt = "", messages: Optional[Seq[dict]] = None) -> list[int]:
        """Token ids of a prompt (text or ids) or chat, with the request limits applied."""
        return self._prompt_ids(self._offline_request(prompt, None, messages, ""))

    async def encode_prompt_async(self, prompt: Prompt = "", messages: Optional[Seq[dict]] = None) -> list[int]:
        """`encode_prompt` in a worker thread (the HTTP /tokenize route)."""
        return await asyncio.get_running_loop().run_in_executor(self._encoder, self.encode_prompt, prompt, messages)

    @property
    def max_model_len(self) -> int:
        """Prompt plus canvas: the most tokens one request can hold."""
        return self.config.max_prompt_tokens + self.config.max_gen_length

    def detokenize(self, ids: Seq[int]) -> str:
        """Text of token ids (special tokens skipped), at most `max_model_len` of them."""
        if len(ids) > self.max_model_len:
            raise InvalidRequest([FieldViolation("tokens", f"{len(ids)} tokens; the limit is {self.max_model_len}")])
        bad = [i for i in ids if not 0 <= i < self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequest([FieldViolation("tokens", f"ids must be in [0, {self.tokenizer.vocab_size}); "
                                                           f"bad: {bad[:5]}")])
        return self.tokenizer.decode(ids)

    async def detokenize_async(self, ids: Seq[int]) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._encoder, self.detokenize, ids)

    def request(self, prompt: Prompt = "", params: Optional[SamplingParams] = None,
                messages: Optional[Seq[dict]] = None, request_id: str = "") -> DecodeSequence:
        """`build` for the offline API: text or ids as `prompt`, or chat `messages`."""
        return self.build(self._offline_request(prompt, params, messages, request_id))

    @staticmethod
    def _offline_request(prompt: Prompt, params: Optional[SamplingParams], messages: Optional[Seq[dict]],
                         request_id: str) -> Request:
        if messages is not None:
            return Request(messages=messages, params=params, request_id=request_id)
        if isinstance(prompt, str):
            return Request(prompt=prompt, params=params, request_id=request_id)
        return Request(token_ids=list(prompt), params=params, request_id=request_id)

    def sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> DecodeSequence:
        """A request of token ids (offline callers and tests): parameters checked, seed filled in."""
        v = self.violations(params)
        if v:
            raise InvalidRequest(v)
        return self._sequence(prompt_ids, params, request_id)

    def _sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                  constraint: Optional[Constraint] = None) -> DecodeSequence:
        """The decoding state of a validated request, with a seed when none was given, as its
        family's row builds it (engine/families/registry.py)."""
        if params.seed is None:
            params = params.with_seed(self.seeds.getrandbits(63))
        rid = request_id or uuid.uuid4().hex
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.stop_ids)
        stops = dict(stop_ids=stop_ids, mask_id=self.tokenizer.mask_id,
                     find_stop_text=self.tokenizer.stop_finder(params.stop) if params.stop else None)
        return self.row.new_sequence(self.family, self.config, rid, prompt_ids, params, constraint=constraint, **stops)
