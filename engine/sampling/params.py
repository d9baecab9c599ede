"""Validated sampling parameters.

Every knob of the reverse process lives here, with its default and limit, so the CLI, the gRPC
servicer and the HTTP gateway reject the same inputs with the same messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from celeris.engine.errors import FieldViolation, InvalidRequest, clip

REMASKING = ("low_confidence", "random", "margin", "entropy")
"""How a position's confidence is measured: the sampled token's probability (LLaDA), a uniform
random number (LLaDA's `random`), top-1 minus top-2 probability, or negative entropy (Dream)."""

FACTOR_RULES = ("fast_dllm", "paper")
"""The factor rule as Fast-dLLM's published code applies it (the default: its accuracy figures
come from it), or the paper's strict formula. See `sampler._factor_count`."""

SCHEDULES = ("llada", "dream")
"""How many tokens the fixed schedule commits per step: LLaDA's even split of each block's
masks over its steps, or Dream's timesteps linspace(1, eps, steps + 1) applied to the masks
still left (`sampler.dream_transfer_count`)."""

DECODING_MODES = ("ar", "diffusion", "linear_spec")
"""Nemotron-Labs-Diffusion's three ways to decode one checkpoint: autoregressive (`ar_generate`),
block diffusion (`generate`) and linear self-speculation (`linear_spec_generate`)."""

KV_CACHE_MODES = ("none", "prefix", "dual")
"""Fast-dLLM's approximate block caches: none, prefix (the block and all after it recomputed),
dual (only the block recomputed)."""

MAX_SEED = 2**63 - 1
MAX_STOP_IDS = 64
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20
MAX_DENOISING_STEPS = 1024  # per canvas, revising models
MAX_POST_STEPS = 256
MAX_PENALTY = 2.0  # OpenAI's range for frequency_penalty / presence_penalty: [-2, 2]


MASK, REVISE = "mask", "revise"
"""The two decoders a knob may belong to alone: a mask model's (LLaDA, Dream and the block families
fill masks) and a revising model's (DiffusionGemma re-samples whole canvases). A family refuses the
other decoder's knobs set away from their defaults (engine/families/family.py)."""


def knob(default: Any, help: str, *, http: Optional[str] = "", cli: Optional[str] = "", proto: Optional[str] = "",
         per_request: bool = False, only: Optional[str] = None, config: str = "") -> Any:
    """A `SamplingParams` field with its entry in the knob table (engine/sampling/knobs.py): its help, and
    its name on each surface ("" = the field's own name, None = not on that surface). A
    per-request knob is never a model default (generation_config.json); `config` is its key
    there when that is not the field's name ("a.b": key b of object a). `only`: the one decoder
    (MASK or REVISE) that reads it; None: every decoder."""
    return field(default=default, metadata={"help": help, "http": http, "cli": cli, "proto": proto,
                                            "per_request": per_request, "only": only, "config": config})


@dataclass(frozen=True)
class SamplingParams:
    """Every knob of the reverse process; the knob table (engine/sampling/knobs.py) is derived from these
    fields, and the surfaces (HTTP, CLI, gRPC, client, page) from the table."""

    gen_length: int = knob(64, "tokens to generate (the canvas)", http="max_tokens")
    steps: int = knob(64, "denoising steps over the whole canvas, split evenly over blocks")
    block_length: int = knob(32, "semi-autoregressive block length; must divide gen_length")
    temperature: float = knob(0.0, "0 = greedy", only=MASK)
    remasking: str = knob("low_confidence", "how a position's confidence is measured", only=MASK)
    threshold: Optional[float] = knob(None, "confidence-threshold parallel decoding (Fast-dLLM), in (0, 1]", only=MASK)
    factor: Optional[float] = knob(None, "Fast-dLLM factor rule (> 0)", only=MASK)
    editing_threshold: Optional[float] = knob(
        None, "token editing (LLaDA2.1, LLaDA2.2): a written token of the current block is replaced when the "
              "model's pick there differs and its probability is > this, in [0, 1]; LLaDA2.2's pick may delete or "
              "split the position; 1: off (default: LLaDA2.1's 0.9, LLaDA2.2's 0.0)",
        only=MASK)
    max_post_steps: int = knob(16, "token editing: at most this many extra steps per block after its last mask is "
                                   "filled, while edits go on (LLaDA2.2: after its last original mask; the count "
                                   "restarts while an edit leaves one)", only=MASK)
    factor_rule: str = knob("fast_dllm", "fast_dllm: as Fast-dLLM's published code; paper: the paper's formula",
                            only=MASK)
    schedule: str = knob("llada", "tokens per step of the fixed schedule: llada (even split per block) or dream "
                                  "(Dream's timesteps linspace(1, eps, steps + 1))", only=MASK)
    eps: float = knob(1e-3, "Dream schedule's final timestep, in (0, 1)", only=MASK)
    kv_cache: Optional[str] = knob(None, "Fast-dLLM approximate cache of full-canvas models (unset: the server's "
                                         "default)", cli=None)
    top_k: int = knob(0, "draw only among the k most likely tokens (ties at the k-th kept, as Dream); 0: all",
                      only=MASK)
    top_p: float = knob(1.0, "nucleus: draw among the most likely tokens up to this mass, in (0, 1]", only=MASK)
    min_p: float = knob(0.0, "vLLM's: draw only among tokens at least this fraction as likely as the most likely "
                             "one (at the temperature), in [0, 1]; 0: all", only=MASK)
    stop: tuple[str, ...] = knob((), "strings that end the output: its text is cut where the first begins")
    stop_token_ids: tuple[int, ...] = knob((), "extra token ids that end the output like EOS")
    ignore_eos: bool = knob(False, "EOS and end-of-turn do not stop (stop_token_ids still do)")
    min_tokens: int = knob(0, "no stop token is drawn in the first min_tokens positions")
    # OpenAI's penalties, subtracted from the logits at every masked position, counted over committed
    # response tokens, never the prompt or the stop tokens (the EOS padding a diffusion canvas ends
    # with). See `sampler.penalize`.
    frequency_penalty: float = knob(0.0, "OpenAI's: lower a token's logit by this per use in the response so far, "
                                         "in [-2, 2]", only=MASK)
    presence_penalty: float = knob(0.0, "OpenAI's: lower a token's logit by this once it is in the response, "
                                        "in [-2, 2]", only=MASK)
    logprobs: Optional[int] = knob(None, "report each committed token's log-probability and this many "
                                         "alternatives", http=None)
    provisional: bool = knob(False, "delta streams: each step, the sampler's pick at each position of the current "
                                    "block it left masked", cli=None, proto=None, per_request=True)
    cfg_scale: float = knob(0.0, "classifier-free guidance scale (0: off)", only=MASK)
    # Revising models (DiffusionGemma) only: its generation_config.json's names and transformers'
    # defaults, the one table of them (families/revise/sampler.py's ReviseParams is derived from
    # these fields); mask models refuse them set away from these (engine/families/family.py).
    max_denoising_steps: int = knob(48, "revising models: most denoising steps per canvas", only=REVISE)
    entropy_bound: float = knob(0.1, "revising models: accept the lowest-entropy positions while their entropies, "
                                     "less the largest, sum to at most this", only=REVISE,
                              config="sampler_config.entropy_bound")
    t_min: float = knob(0.4, "revising models: a canvas's temperature falls from t_max towards this; "
                             "its last step runs above it (>= 0)", only=REVISE)
    t_max: float = knob(0.8, "revising models: temperature at a canvas's first step (> 0, >= t_min)", only=REVISE)
    stability_threshold: int = knob(1, "revising models: a canvas stops once its argmax held this many steps "
                                       "(and is confident)", only=REVISE)
    confidence_threshold: float = knob(0.005, "revising models: ...and its mean entropy is below this", only=REVISE)
    decoding: Optional[str] = knob(None, "Nemotron-Labs-Diffusion only: ar, diffusion (block diffusion; block_length, "
                                         "threshold) or linear_spec (self-speculation with its draft adapter; "
                                         "block_length, threshold); unset: diffusion", only=MASK)
    seed: Optional[int] = knob(None, "random seed (unset: the engine picks one and reports it)", per_request=True)
    stop_at_eos: bool = knob(True, "finish once a finished block holds a stop token", http=None, cli=None, proto=None)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def adaptive(self) -> bool:
        """Threshold and factor rules decide per step how many tokens to commit."""
        return self.threshold is not None or self.factor is not None

    def with_seed(self, seed: int) -> SamplingParams:
        return replace(self, seed=seed)

    def validate(self, max_gen_length: int = 4096) -> SamplingParams:
        """Raise InvalidRequest naming every bad field and its limit; return self when valid."""
        v = self._length_violations(max_gen_length)
        if all(_integer(getattr(self, name)) for name in ("gen_length", "steps", "block_length")):
            v += self._decoding_violations() + self._output_violations()
        if v:
            raise InvalidRequest(v)
        return self

    def _length_violations(self, max_gen_length: int) -> list[FieldViolation]:
        v = [FieldViolation(name, f"must be an integer, got {clip(getattr(self, name))}")
             for name in ("gen_length", "steps", "block_length") if not _integer(getattr(self, name))]
        if v:
            return v
        G, b = self.gen_length, self.block_length
        if not 1 <= G <= max_gen_length:
            v.append(FieldViolation("gen_length", f"must be in [1, {max_gen_length}], got {G}"))
        if not 1 <= b <= max(G, 1):
            v.append(FieldViolation("block_length", f"must be in [1, gen_length={G}], got {b}"))
        elif G % b:
            v.append(FieldViolation("block_length", f"gen_length={G} must be a multiple of block_length={b}"))
        if not 1 <= self.steps <= max(G, 1):
            v.append(FieldViolation("steps", f"must be in [1, gen_length={G}], got {self.steps}"))
        elif G >= 1 and b >= 1 and G % b == 0 and self.steps % (G // b):
            v.append(FieldViolation("steps", f"must be a multiple of the number of blocks ({G // b}), got {self.steps}"))
        return v

    def _decoding_violations(self) -> list[FieldViolation]:
        v: list[FieldViolation] = []
        bad = lambda name, msg: v.append(FieldViolation(name, msg))  # noqa: E731
        if not _finite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {clip(self.temperature)}")
        for name, choices in (("remasking", REMASKING), ("factor_rule", FACTOR_RULES), ("schedule", SCHEDULES)):
            if getattr(self, name) not in choices:
                bad(name, f"must be one of {', '.join(choices)}, got {clip(getattr(self, name))}")
        if self.decoding is not None and self.decoding not in DECODING_MODES:
            bad("decoding", f"must be one of {', '.join(DECODING_MODES)}, got {clip(self.decoding)}")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_MODES:
            bad("kv_cache", f"must be one of {', '.join(KV_CACHE_MODES)}, got {clip(self.kv_cache)}")
        if self.threshold is not None and (not _finite(self.threshold) or not 0 < self.threshold <= 1):
            bad("threshold", f"must be in (0, 1], got {clip(self.threshold)}")
        if self.editing_threshold is not None and (not _finite(self.editing_threshold)
                                                   or not 0 <= self.editing_threshold <= 1):
            bad("editing_threshold", f"must be in [0, 1], got {clip(self.editing_threshold)}")
        if not _integer(self.max_post_steps) or not 0 <= self.max_post_steps <= MAX_POST_STEPS:
            bad("max_post_steps", f"must be an integer in [0, {MAX_POST_STEPS}], got {clip(self.max_post_steps)}")
        if self.factor is not None and (not _finite(self.factor) or self.factor <= 0):
            bad("factor", f"must be a finite number > 0, got {clip(self.factor)}")
        if self.threshold is not None and self.factor is not None:
            bad("factor", "set either threshold or factor, not both")
        if not _finite(self.eps) or not 0 < self.eps < 1:
            bad("eps", f"must be in (0, 1), got {clip(self.eps)}")
        if not _integer(self.top_k) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 keeps every token), got {clip(self.top_k)}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {clip(self.top_p)}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {clip(self.min_p)}")
        for name in ("frequency_penalty", "presence_penalty"):
            val = getattr(self, name)
            if not _finite(val) or not -MAX_PENALTY <= val <= MAX_PENALTY:
                bad(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {clip(val)}")
        if not _finite(self.cfg_scale) or self.cfg_scale < 0:
            bad("cfg_scale", f"must be a finite number >= 0, got {clip(self.cfg_scale)}")
        v += self._revise_violations()
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            bad("seed", f"must be an integer in [0, 2^63-1], got {clip(self.seed)}")
        return v

    def _revise_violations(self) -> list[FieldViolation]:
        v: list[FieldViolation] = []
        bad = lambda name, msg: v.append(FieldViolation(name, msg))  # noqa: E731
        for name in ("max_denoising_steps", "stability_threshold"):
            val, low = getattr(self, name), 1 if name == "max_denoising_steps" else 0
            if not _integer(val) or not low <= val <= MAX_DENOISING_STEPS:
                bad(name, f"must be an integer in [{low}, {MAX_DENOISING_STEPS}], got {clip(val)}")
        if not _finite(self.entropy_bound) or self.entropy_bound < 0:
            bad("entropy_bound", f"must be a finite number >= 0, got {clip(self.entropy_bound)}")
        # As transformers' DiffusionGemmaGenerationConfig.validate: t_min >= 0 (step s of N runs at
        # t_min + (t_max - t_min) * s / N for s = N..1, never at t_min itself). It refuses t_max ==
        # t_min; a constant t_max > 0 is accepted here, so no temperature is ever 0.
        if not _finite(self.t_min) or self.t_min < 0:
            bad("t_min", f"must be a finite number >= 0, got {clip(self.t_min)}")
        if not _finite(self.t_max) or self.t_max <= 0 or (_finite(self.t_min) and self.t_max < self.t_min):
            bad("t_max", f"must be a finite number > 0 and >= t_min, got {clip(self.t_max)}")
        if not _finite(self.confidence_threshold) or self.confidence_threshold < 0:
            bad("confidence_threshold", f"must be a finite number >= 0, got {clip(self.confidence_threshold)}")
        return v

    def _output_violations(self) -> list[FieldViolation]:
        v: list[FieldViolation] = []
        bad = lambda name, msg: v.append(FieldViolation(name, msg))  # noqa: E731
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOPS or any(
                not isinstance(x, str) or not 1 <= len(x) <= MAX_STOP_CHARS for x in self.stop):
            bad("stop", f"must be at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or len(ids) > MAX_STOP_IDS or any(not _integer(i) or i < 0 for i in ids):
            bad("stop_token_ids", f"must be at most {MAX_STOP_IDS} token ids >= 0")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= max(self.gen_length, 0):
            bad("min_tokens", f"must be an integer in [0, gen_length={self.gen_length}], got {clip(self.min_tokens)}")
        if self.logprobs is not None and (not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), "
                            f"got {clip(self.logprobs)}")
        for name in ("ignore_eos", "provisional", "stop_at_eos"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a boolean, got {clip(getattr(self, name))}")
        return v


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fit_lengths(defaults: SamplingParams, given: dict) -> SamplingParams:
    """`given` (the fields a caller set) over `defaults`, with steps and block_length fitted to a
    gen_length given without them.

    The block is the default block if it divides gen_length, else a divisor not far below it
    (down to a quarter), else one block; steps keep the defaults' steps-per-token ratio, a whole
    number of steps per block, at most one step per token. Explicit values are never changed (a
    bad combination is still refused by validate()). Every surface (CLI, gRPC, HTTP) calls this,
    so `--gen-length 16` alone works wherever the defaults were made for 64.
    """
    p = replace(defaults, **given)
    G = p.gen_length
    if "gen_length" not in given or isinstance(G, bool) or not isinstance(G, int) or G < 1:
        return p
    if "block_length" not in given:
        d = defaults.block_length
        b = G if G <= d else next((b for b in range(d, max(1, d // 4) - 1, -1) if G % b == 0), G)
        p = replace(p, block_length=b)
    b = p.block_length
    if "steps" not in given and isinstance(b, int) and 1 <= b <= G and G % b == 0:
        blocks = G // b
        ratio = defaults.steps / defaults.gen_length
        per_block = min(b, max(1, round(G * ratio / blocks)))
        p = replace(p, steps=per_block * blocks)
    return p
