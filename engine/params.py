"""Validated sampling parameters.

Every knob of the reverse process lives here, with its default and limit, so the CLI, the gRPC
servicer and the HTTP gateway reject the same inputs with the same messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from engine.errors import FieldViolation, InvalidRequest, clip

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

KV_CACHE_MODES = ("none", "prefix", "dual")
"""Fast-dLLM's approximate block caches: none, prefix (the block and all after it recomputed),
dual (only the block recomputed)."""

MAX_SEED = 2**63 - 1
MAX_STOP_IDS = 64
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # OpenAI's range for frequency_penalty / presence_penalty: [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    gen_length: int = 64
    steps: int = 64  # total forward passes budget of the fixed schedule, split evenly over blocks
    block_length: int = 32
    temperature: float = 0.0
    remasking: str = "low_confidence"
    threshold: Optional[float] = None  # confidence-threshold parallel decoding when set
    factor: Optional[float] = None  # Fast-dLLM factor rule when set
    factor_rule: str = "fast_dllm"  # see FACTOR_RULES
    schedule: str = "llada"  # see SCHEDULES
    eps: float = 1e-3  # Dream's final timestep (schedule="dream")
    kv_cache: Optional[str] = None  # see KV_CACHE_MODES; None: the engine's default
    top_k: int = 0  # draw only among the k most likely tokens (ties at the k-th kept, as Dream); 0: all
    top_p: float = 1.0  # nucleus: draw among the most likely tokens up to this mass; 1: all
    stop: tuple[str, ...] = ()  # strings that end the output: its text is cut where the first begins
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the output like EOS
    ignore_eos: bool = False  # EOS / end-of-turn do not stop (stop_token_ids still do)
    min_tokens: int = 0  # no stop token is drawn in the first min_tokens positions
    # OpenAI's penalties, subtracted from the logits at every masked position: frequency_penalty
    # times how often each token already stands in the response, presence_penalty once if it does
    # at all. Counted over committed response tokens, never the prompt or the stop tokens (the EOS
    # padding a diffusion canvas ends with). See `sampler.penalize`.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: Optional[int] = None  # report each committed token's log-probability (+ this many alternatives)
    # Report, every step, the token the sampler ranks first at each candidate position it left
    # masked in the current block, with its confidence (StepEvent.provisional).
    provisional: bool = False
    cfg_scale: float = 0.0
    seed: Optional[int] = None  # None: the engine picks one and reports it
    stop_at_eos: bool = True

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
        v: list[FieldViolation] = []

        def bad(name: str, msg: str) -> None:
            v.append(FieldViolation(name, msg))

        for name in ("gen_length", "steps", "block_length"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int):
                bad(name, f"must be an integer, got {val!r}")
        if v:
            raise InvalidRequest(v)
        if not 1 <= self.gen_length <= max_gen_length:
            bad("gen_length", f"must be in [1, {max_gen_length}], got {self.gen_length}")
        if not 1 <= self.block_length <= max(self.gen_length, 1):
            bad("block_length", f"must be in [1, gen_length={self.gen_length}], got {self.block_length}")
        elif self.gen_length % self.block_length:
            bad("block_length", f"gen_length={self.gen_length} must be a multiple of block_length={self.block_length}")
        if not 1 <= self.steps <= max(self.gen_length, 1):
            bad("steps", f"must be in [1, gen_length={self.gen_length}], got {self.steps}")
        elif self.gen_length >= 1 and self.block_length >= 1 and self.gen_length % self.block_length == 0:
            blocks = self.gen_length // self.block_length
            if self.steps % blocks:
                bad("steps", f"must be a multiple of the number of blocks ({blocks}), got {self.steps}")
        if not _finite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.remasking not in REMASKING:
            bad("remasking", f"must be one of {', '.join(REMASKING)}, got {self.remasking!r}")
        if self.threshold is not None and (not _finite(self.threshold) or not 0 < self.threshold <= 1):
            bad("threshold", f"must be in (0, 1], got {self.threshold}")
        if self.factor is not None and (not _finite(self.factor) or self.factor <= 0):
            bad("factor", f"must be a finite number > 0, got {self.factor}")
        if self.threshold is not None and self.factor is not None:
            bad("factor", "set either threshold or factor, not both")
        if self.factor_rule not in FACTOR_RULES:
            bad("factor_rule", f"must be one of {', '.join(FACTOR_RULES)}, got {self.factor_rule!r}")
        if self.schedule not in SCHEDULES:
            bad("schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not _finite(self.eps) or not 0 < self.eps < 1:
            bad("eps", f"must be in (0, 1), got {self.eps}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 keeps every token), got {self.top_k!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOPS or any(
                not isinstance(x, str) or not 1 <= len(x) <= MAX_STOP_CHARS for x in self.stop):
            bad("stop", f"must be at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or len(ids) > MAX_STOP_IDS or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            bad("stop_token_ids", f"must be at most {MAX_STOP_IDS} token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= max(self.gen_length, 0):
            bad("min_tokens", f"must be an integer in [0, gen_length={self.gen_length}], got {self.min_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), got {self.logprobs!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            val = getattr(self, name)
            if isinstance(val, bool) or not _finite(val) or not -MAX_PENALTY <= val <= MAX_PENALTY:
                bad(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {clip(val)}")
        if not isinstance(self.provisional, bool):
            bad("provisional", f"must be a boolean, got {self.provisional!r}")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_MODES:
            bad("kv_cache", f"must be one of {', '.join(KV_CACHE_MODES)}, got {self.kv_cache!r}")
        if not _finite(self.cfg_scale) or self.cfg_scale < 0:
            bad("cfg_scale", f"must be a finite number >= 0, got {self.cfg_scale}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            bad("seed", f"must be an integer in [0, 2^63-1], got {self.seed!r}")
        if v:
            raise InvalidRequest(v)
        return self


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
