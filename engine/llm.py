"""The engine as a library: a loaded model, its tokenizer, and request construction.

`LLM` turns user input (text, token ids, chat messages) into validated `Sequence`s and runs them
offline through the same `StepLoop` the server uses. The server builds a `Scheduler` on top of
`LLM.loop`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import uuid
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Optional, Sequence as Seq, Union

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import FieldViolation, InvalidRequest, ModelLoadError, clip
from engine.model import MaskPredictor, count_parameters
from engine.params import MAX_SEED, SamplingParams
from engine.block_runner import BlockRunner
from engine.block_sequence import BlockSequence
from engine.runner import Runner
from engine.step_loop import StepLoop
from engine.sequence import FinishReason, Sequence, StepEvent
from engine.tokenizer import Tokenizer
from engine.weights import load_model

EMBEDDED_MODEL = Path(__file__).parent / "training" / "celeris-tiny"
# The models shipped inside the package, loadable by name (`--model celeris-tiny-block`).
EMBEDDED_MODELS = {name: EMBEDDED_MODEL.parent / name for name in ("celeris-tiny", "celeris-tiny-block")}


def model_folder(model: Optional[Union[str, Path]]) -> Path:
    """A checkpoint folder, or the embedded model of that name (a folder of the name wins)."""
    if model is None:
        return EMBEDDED_MODEL
    if str(model) in EMBEDDED_MODELS and not Path(model).exists():
        return EMBEDDED_MODELS[str(model)]
    return Path(model)

Prompt = Union[str, Seq[int]]
MAX_REQUEST_ID = 128  # characters
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Request:
    """One generation request as a front door hands it over: exactly one of prompt, token_ids,
    messages. `LLM.build` validates it all, once, for both doors."""

    prompt: Optional[str] = None
    token_ids: Optional[Seq[int]] = None
    messages: Optional[Seq[dict]] = None
    params: Optional[SamplingParams] = None  # None: the model's defaults
    request_id: str = ""  # empty: one is made up

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


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]  # generated part, cut at the first stop token
    steps: int  # forward passes used
    finish_reason: FinishReason
    seed: int
    prompt_tokens: int
    logprobs: tuple = ()  # with params.logprobs: (logprob, ((id, logprob), ...)) per generated token


def model_defaults(folder: Path, cfg: Optional[ModelConfig] = None) -> SamplingParams:
    """Sampling defaults a checkpoint recommends in `generation_config.json` (celeris keys).

    A block-diffusion model decodes in its trained block size, one token per step by default
    (SDAR's and LLaDA2's published step counts equal the block length).
    """
    base = SamplingParams()
    if cfg is not None and cfg.family == "block":
        base = replace(base, block_length=cfg.block_length, steps=base.gen_length)
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return base.validate()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    known = {f.name for f in fields(SamplingParams)} - {"seed", "provisional"}  # per request, never a default
    return replace(base, **{k: v for k, v in raw.items() if k in known}).validate()


class LLM:
    def __init__(self, model: MaskPredictor, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(),
                 defaults: SamplingParams = SamplingParams(), name: str = "model"):
        self.model, self.tokenizer, self.config, self.defaults, self.name = model, tokenizer, config, defaults, name
        self.runner = BlockRunner(model, config) if model.cfg.family == "block" else Runner(model, config)
        self.loop = StepLoop(self.runner, config.max_queue)
        # Tokenizing is CPU work proportional to the input: keep it off the server's event loop.
        self._encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="celeris-encode")

    @classmethod
    def load(cls, folder: Optional[Union[str, Path]] = None, config: EngineConfig = EngineConfig(),
             defaults: Optional[SamplingParams] = None) -> LLM:
        """Load a checkpoint folder, or an embedded model by name; None means celeris-tiny."""
        folder = model_folder(folder)
        model = load_model(folder, dtype=config.dtype, device=config.device)
        tok = Tokenizer.from_dir(folder, model.cfg)
        return cls(model, tok, config, defaults or model_defaults(folder, model.cfg), name=model.cfg.name)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def parameter_count(self) -> int:
        return count_parameters(self.model)

    # ------------------------------------------------------------------ requests

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this can fit in max_prompt_tokens, so it is refused untokenized."""
        return self.config.max_prompt_tokens * self.tokenizer.max_token_chars

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
                v.append(FieldViolation(
                    "token_ids", f"prompt is {len(req.token_ids)} tokens; the limit is {tokens}"))
        else:
            v += self._check_messages(req.messages)
        return v

    def _check_messages(self, messages: Seq[dict]) -> list[FieldViolation]:
        if not messages:
            return [FieldViolation("messages", "must not be empty")]
        if len(messages) > self.config.max_prompt_tokens:  # every turn costs at least one token
            return [FieldViolation("messages", f"{len(messages)} messages; the limit is {self.config.max_prompt_tokens}")]
        v, total = [], 0
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            content = m.get("content") if isinstance(m, dict) else None
            if role not in CHAT_ROLES:
                v.append(FieldViolation(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {clip(role)}"))
            if not isinstance(content, str):
                v.append(FieldViolation(f"messages[{i}].content", f"must be a string, got {clip(content)}"))
            else:
                total += len(content)
        if total > self.max_prompt_chars:
            v.append(self._too_long("messages", "content is", total))
        return v

    def _encode(self, req: Request) -> tuple[list[int], str]:
        """Tokenize a request that passed `_check_size`; (ids, the field they came from)."""
        if req.messages is not None:
            return self.tokenizer.encode_chat(req.messages), "messages"
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt), "prompt"
        ids = list(req.token_ids)
        self.tokenizer.check_ids(ids, "token_ids")
        return ids, "token_ids"

    def build(self, req: Request) -> Sequence:
        """Validate and encode a whole request, reporting every bad field at once; the one place
        both doors' requests are checked. Size limits come before any tokenizing."""
        v: list[FieldViolation] = []
        rid = req.request_id
        if not isinstance(rid, str) or len(rid) > MAX_REQUEST_ID:
            v.append(FieldViolation("request_id", f"at most {MAX_REQUEST_ID} characters"))
        params = req.params or self.defaults
        try:
            params.validate(self.config.max_gen_length)
        except InvalidRequest as e:
            v += e.violations
        ids: list[int] = []
        try:
            ids = self._prompt_ids(req)
        except InvalidRequest as e:
            v += e.violations
        if v:
            raise InvalidRequest(v)
        return self.sequence(ids, params, rid)

    def _prompt_ids(self, req: Request) -> list[int]:
        size = self._check_size(req)
        if size:
            raise InvalidRequest(size)
        ids, field = self._encode(req)
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidRequest([FieldViolation(
                field, f"prompt is {len(ids)} tokens; the limit is {self.config.max_prompt_tokens}")])
        return ids

    async def build_async(self, req: Request) -> Sequence:
        """`build` in a worker thread, so tokenizing never stalls the caller's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._encoder, self.build, req)

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
                messages: Optional[Seq[dict]] = None, request_id: str = "") -> Sequence:
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

    def sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> Sequence:
        """Validate params against this engine's limits and fill in a seed if none was given."""
        params = params.validate(self.config.max_gen_length)
        if params.seed is None:
            params = params.with_seed(secrets.randbits(63))
        rid = request_id or uuid.uuid4().hex
        stops = dict(stop_ids=self._stop_ids(params), mask_id=self.tokenizer.mask_id,
                     find_stop_text=self.tokenizer.stop_finder(params.stop) if params.stop else None)
        if self.model.cfg.family == "block":
            self._check_block_params(params)
            return BlockSequence(rid, prompt_ids, params, prefill_chunk=self.config.prefill_chunk, **stops)
        if params.kv_cache is None:  # the engine's default, recorded so every surface can report it
            params = replace(params, kv_cache=self.config.kv_cache)
        return Sequence(rid, prompt_ids, params, **stops)

    def _stop_ids(self, p: SamplingParams) -> frozenset[int]:
        """The request's stop set: EOS and end-of-turn (unless ignore_eos), plus its own ids."""
        self.tokenizer.check_ids(list(p.stop_token_ids), "stop_token_ids")
        return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.tokenizer.stop_ids)

    @property
    def kv_cache(self) -> str:
        """What the engine caches by default: `exact` for block models, else the approximate mode."""
        return "exact" if self.model.cfg.family == "block" else self.config.kv_cache

    def _check_block_params(self, p: SamplingParams) -> None:
        bad = []
        if p.kv_cache not in (None, "none"):
            bad.append(FieldViolation("kv_cache", "block-diffusion models always decode over their exact block "
                                                  "cache; prefix/dual are full-canvas approximations"))
        if p.schedule != "llada":
            bad.append(FieldViolation("schedule", "block-diffusion models use their published per-block schedule"))
        if p.cfg_scale > 0:
            bad.append(FieldViolation("cfg_scale", "classifier-free guidance is not supported for block-diffusion "
                                                   "models"))
        if bad:
            raise InvalidRequest(bad)

    def result(self, seq: Sequence) -> Result:
        ids = seq.generated()
        return Result(seq.request_id, self.tokenizer.decode_cut(ids, seq.stop_text), ids, seq.nfe,
                      seq.finish_reason or FinishReason.LENGTH, seq.params.seed or 0, len(seq.prompt),
                      seq.generated_logprobs(len(ids)))

    # ------------------------------------------------------------------ offline

    def generate(self, prompts: Seq[Prompt], params: Optional[SamplingParams] = None,
                 on_event: Optional[Callable[[StepEvent], None]] = None) -> list[Result]:
        """Run prompts to completion, batched step by step like the server does."""
        params = params or self.defaults
        seqs = [self.request(p, params) for p in prompts]
        for s in seqs:
            self.loop.add(s, bounded=False)  # offline: the caller owns the whole list
        with torch.inference_mode():
            self.loop.run_to_completion(on_event)
        return [self.result(s) for s in seqs]

    def generate_one(self, prompt: Prompt, params: Optional[SamplingParams] = None, **overrides) -> Result:
        params = replace(params or self.defaults, **overrides)
        return self.generate([prompt], params)[0]


__all__ = ["LLM", "Request", "Result", "StepEvent", "EMBEDDED_MODEL", "EMBEDDED_MODELS", "model_folder", "CHAT_ROLES", "MAX_REQUEST_ID"]
