"""The engine as a library: a loaded model, its family, tokenizer, runner and step loop.

`LLM.load` reads a checkpoint folder (or an embedded model by name) and decides the model's
family once. Requests are built and validated by `requests.Requests` (`LLM.build` and friends
hand over to it); `LLM.generate` runs them offline through the same `StepLoop` the server uses,
and the server builds a `Scheduler` on top of `LLM.loop`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence as Seq, Union

import torch

from celeris.engine.config import PROMPT_ROOM_CAP, EngineConfig, ModelConfig, read_json
from celeris.engine.families import registry
from celeris.engine.families.family import PLAIN, Family
from celeris.engine.sampling.knobs import configured
from celeris.engine.models.fp8 import check_fp8_device, quantize_fp8
from celeris.engine.models.transformer import MaskPredictor, count_parameters
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.requests import CHAT_ROLES, MAX_REQUEST_ID, Prompt, Request, Requests
from celeris.engine.loop.runner_api import StepRunner
from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.loop.step_loop import StepLoop
from celeris.engine.tokenizer import Tokenizer

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


def default_prompt_tokens(model: Optional[Union[str, Path]], max_gen_length: int) -> int:
    """The prompt limit a server takes when none is given: the model folder's own position range
    (config.json's max_sequence_length / max_position_embeddings) less the canvas, at most
    PROMPT_ROOM_CAP, at least 1 (the shipped celeris-tiny: 1,024 - 512 = 512; its tools-phase run, 4,608
    positions, would give 4,096). Reads only the config."""
    from celeris.engine.families.checkpoint import read_config

    own = read_config(model_folder(model)).max_sequence_length
    # Never below the fixed default this replaced (512, or the model's whole range if shorter):
    # a small model's range less a long canvas would leave no prompt at all, and each request's
    # prompt plus canvas is still checked against the range.
    return max(1, min(own - max_gen_length, PROMPT_ROOM_CAP), min(512, own))


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
    error: Optional[Exception] = None  # why this request alone failed (Sequence.fail); the others ran on
    # A choice asked with logprobs: {option: probability} (engine/sampling/choice.py); else None.
    choice_probabilities: Optional[dict[str, float]] = None


def model_defaults(folder: Path, cfg: Optional[ModelConfig] = None) -> SamplingParams:
    """Sampling defaults a checkpoint recommends in `generation_config.json` (the knobs its family
    reads there, `Family.model_knobs`), over its family's base (`Family.base_params`).

    A block-diffusion model decodes in its trained block size, one token per step by default
    (SDAR's and LLaDA2's published step counts equal the block length).
    """
    family = registry.family_of(cfg) if cfg is not None else PLAIN
    raw = read_json(folder, "generation_config.json")
    return replace(family.base_params(), **configured(raw, family.model_knobs)).validate()


class LLM:
    # Built outside inference mode even when the caller is in it: its runner's tensors are
    # written in place by every step, and a server steps on its own thread, outside it (an
    # inference tensor cannot be updated in place there).
    @torch.inference_mode(False)
    def __init__(self, model: MaskPredictor, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(),
                 defaults: SamplingParams = SamplingParams(), name: str = "model"):
        self.model, self.tokenizer, self.config, self.name = model, tokenizer, config, name
        self.family: Family = registry.family_of(model.cfg)  # decided once: every other place asks it
        self.row = registry.row_of(self.family)  # its runner, request state and warm-up
        self.runner: StepRunner = self.row.runner(model, config, self.family)
        self.loop = StepLoop(self.runner, config.max_queue)
        self.requests = Requests(tokenizer, config, defaults, self.family)

    @classmethod
    @torch.inference_mode(False)
    def load(cls, folder: Optional[Union[str, Path]] = None, config: EngineConfig = EngineConfig(),
             defaults: Optional[SamplingParams] = None) -> LLM:
        """Load a checkpoint folder, or an embedded model by name; None means celeris-tiny."""
        folder = model_folder(folder)
        if config.quantization == "fp8":  # refused before any weight is read on a device without FP8 matmuls
            check_fp8_device(config.device)
        model = registry.load(folder, config)  # by the row of the first architecture card that claims it
        if config.quantization == "fp8":  # packed once the weights are in, before any warm-up or graph capture
            total = count_parameters(model)  # what parameter_count reports: the packed weights are buffers
            quantize_fp8(model)
            model.total_parameters = total
        tok = Tokenizer.from_dir(folder, model.cfg)
        return cls(model, tok, config, defaults or model_defaults(folder, model.cfg), name=model.cfg.name)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (a no-op on one process)."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    def on_worker_lost(self, callback: Callable[[Exception], None]) -> None:
        """Call `callback(error)` (from another thread) when a tensor-parallel worker dies."""
        supervisor = getattr(self.model, "supervisor", None)
        if supervisor is not None:
            supervisor.on_lost.append(callback)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def parameter_count(self) -> int:
        """The whole model's, also when this process holds only a tensor-parallel shard."""
        return getattr(self.model, "total_parameters", None) or count_parameters(self.model)

    # ------------------------------------------------------------------ requests (engine/requests.py)

    @property
    def defaults(self) -> SamplingParams:
        """The sampling parameters a request starts from (the checkpoint's recommendations)."""
        return self.requests.defaults

    def build(self, req: Request) -> DecodeSequence:
        return self.requests.build(req)

    async def build_async(self, req: Request, inline: bool = True, client: str = "") -> DecodeSequence:
        return await self.requests.build_async(req, inline, client)

    def request(self, prompt: Prompt = "", params: Optional[SamplingParams] = None,
                messages: Optional[Seq[dict]] = None, request_id: str = "") -> DecodeSequence:
        """`build` for the offline API: text or ids as `prompt`, or chat `messages`."""
        return self.requests.request(prompt, params, messages, request_id)

    def sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> DecodeSequence:
        return self.requests.sequence(prompt_ids, params, request_id)

    def encode_prompt(self, prompt: Prompt = "", messages: Optional[Seq[dict]] = None) -> list[int]:
        return self.requests.encode_prompt(prompt, messages)

    async def encode_prompt_async(self, prompt: Prompt = "", messages: Optional[Seq[dict]] = None) -> list[int]:
        return await self.requests.encode_prompt_async(prompt, messages)

    def tokenize(self, text: str, chat: bool = False) -> tuple[list[int], list[str]]:
        return self.requests.tokenize(text, chat)

    async def tokenize_async(self, text: str, chat: bool = False) -> tuple[list[int], list[str]]:
        return await self.requests.tokenize_async(text, chat)

    def detokenize(self, ids: Seq[int]) -> str:
        return self.requests.detokenize(ids)

    async def detokenize_async(self, ids: Seq[int]) -> str:
        return await self.requests.detokenize_async(ids)

    @property
    def max_prompt_chars(self) -> int:
        return self.requests.max_prompt_chars

    @property
    def max_model_len(self) -> int:
        return self.requests.max_model_len

    @property
    def kv_cache(self) -> str:
        """What the engine caches by default: `exact` for block models, else the approximate mode."""
        return self.family.kv_cache(self.config.kv_cache)

    @property
    def warmup_params(self) -> SamplingParams:
        """The server's warm-up request: one tiny generation of this family."""
        return self.row.warmup_params(self.family)

    def result(self, seq: DecodeSequence) -> Result:
        ids = seq.generated()
        return Result(seq.request_id, self.tokenizer.decode_cut(ids, seq.stop_text), ids, seq.nfe,
                      seq.finish_reason or FinishReason.LENGTH, seq.params.seed or 0, len(seq.prompt),
                      seq.generated_logprobs(len(ids)), seq.error, seq.choice_probabilities())

    # ------------------------------------------------------------------ offline

    def generate(self, prompts: Seq[Prompt], params: Optional[SamplingParams] = None,
                 on_event: Optional[Callable[[StepEvent], None]] = None) -> list[Result]:
        """Run prompts to completion, batched step by step like the server does."""
        params = params or self.defaults
        return self.run([self.request(p, params) for p in prompts], on_event)

    def run(self, seqs: Seq[DecodeSequence], on_event: Optional[Callable[[StepEvent], None]] = None) -> list[Result]:
        """Run built sequences (`build`, e.g. of a `Request` with a structured output) to completion."""
        for s in seqs:
            self.loop.add(s, bounded=False)  # offline: the caller owns the whole list
        with torch.inference_mode():
            self.loop.run_to_completion(on_event)
        return [self.result(s) for s in seqs]

    def generate_one(self, prompt: Prompt, params: Optional[SamplingParams] = None, **overrides) -> Result:
        params = replace(params or self.defaults, **overrides)
        return self.generate([prompt], params)[0]


__all__ = ["LLM", "Request", "Result", "StepEvent", "EMBEDDED_MODEL", "EMBEDDED_MODELS", "model_folder", "CHAT_ROLES", "MAX_REQUEST_ID"]
