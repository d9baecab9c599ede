"""The engine as a library: a loaded model, its tokenizer, and request construction.

`LLM` turns user input (text, token ids, chat messages) into validated `Sequence`s and runs them
offline through the same `StepLoop` the server uses. The server builds a `Scheduler` on top of
`LLM.loop`.
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Optional, Sequence as Seq, Union

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import FieldViolation, InvalidRequest, ModelLoadError
from engine.model import MaskPredictor, count_parameters
from engine.params import SamplingParams
from engine.block_runner import BlockRunner
from engine.block_sequence import BlockSequence
from engine.runner import Runner
from engine.scheduler import StepLoop
from engine.sequence import FinishReason, Sequence, StepEvent
from engine.tokenizer import Tokenizer
from engine.weights import load_model

EMBEDDED_MODEL = Path(__file__).parent / "training" / "celeris-tiny"

Prompt = Union[str, Seq[int]]


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]  # generated part, cut at the first stop token
    steps: int  # forward passes used
    finish_reason: FinishReason
    seed: int
    prompt_tokens: int


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
    known = {f.name for f in fields(SamplingParams)} - {"seed"}
    return replace(base, **{k: v for k, v in raw.items() if k in known}).validate()


class LLM:
    def __init__(self, model: MaskPredictor, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(),
                 defaults: SamplingParams = SamplingParams(), name: str = "model"):
        self.model, self.tokenizer, self.config, self.defaults, self.name = model, tokenizer, config, defaults, name
        self.runner = BlockRunner(model, config) if model.cfg.family == "block" else Runner(model, config)
        self.loop = StepLoop(self.runner, config.max_queue)

    @classmethod
    def load(cls, folder: Optional[Union[str, Path]] = None, config: EngineConfig = EngineConfig(),
             defaults: Optional[SamplingParams] = None) -> LLM:
        """Load a checkpoint folder; None means the embedded celeris-tiny."""
        folder = Path(folder) if folder is not None else EMBEDDED_MODEL
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

    def encode_prompt(self, prompt: Prompt = "", messages: Optional[Seq[dict]] = None) -> list[int]:
        if messages is not None:
            if not messages:
                raise InvalidRequest([FieldViolation("messages", "must not be empty")])
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
            field = "messages"
        elif isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest([FieldViolation("prompt", "must not be empty")])
            ids, field = self.tokenizer.encode(prompt), "prompt"
        else:
            ids, field = list(prompt), "token_ids"
            if not ids:
                raise InvalidRequest([FieldViolation(field, "must not be empty")])
            self.tokenizer.check_ids(ids, field)
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidRequest([FieldViolation(
                field, f"prompt is {len(ids)} tokens; the limit is {self.config.max_prompt_tokens}")])
        return ids

    def request(self, prompt: Prompt = "", params: Optional[SamplingParams] = None,
                messages: Optional[Seq[dict]] = None, request_id: str = "") -> Sequence:
        """Encode and validate a whole request, reporting every bad field at once."""
        violations: list[FieldViolation] = []
        params = params or self.defaults
        ids: list[int] = []
        try:
            ids = self.encode_prompt(prompt, messages)
        except InvalidRequest as e:
            violations += e.violations
        try:
            params.validate(self.config.max_gen_length)
        except InvalidRequest as e:
            violations += e.violations
        if violations:
            raise InvalidRequest(violations)
        return self.sequence(ids, params, request_id)

    def sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> Sequence:
        """Validate params against this engine's limits and fill in a seed if none was given."""
        params = params.validate(self.config.max_gen_length)
        if params.seed is None:
            params = params.with_seed(secrets.randbits(63))
        rid = request_id or uuid.uuid4().hex
        if self.model.cfg.family == "block":
            self._check_block_params(params)
            return BlockSequence(rid, prompt_ids, params, mask_id=self.tokenizer.mask_id,
                                 stop_ids=self.tokenizer.stop_ids, prefill_chunk=self.config.prefill_chunk)
        if params.kv_cache is None:  # the engine's default, recorded so every surface can report it
            params = replace(params, kv_cache=self.config.kv_cache)
        return Sequence(rid, prompt_ids, params, mask_id=self.tokenizer.mask_id, stop_ids=self.tokenizer.stop_ids)

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
        return Result(seq.request_id, self.tokenizer.decode(ids), ids, seq.nfe,
                      seq.finish_reason or FinishReason.LENGTH, seq.params.seed or 0, len(seq.prompt))

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


__all__ = ["LLM", "Result", "StepEvent", "EMBEDDED_MODEL"]
