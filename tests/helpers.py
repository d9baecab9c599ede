"""Builders for test models: real safetensors folders written from random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from celeris.engine.config import ModelConfig
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.training import data
from celeris.engine.families.checkpoint import save_model
from celeris.engine.families.registry import card_named

TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "must be in want of a wife. However little known the feelings or views of such a man may be",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition,",
    "12+34=46 56+78=134 90+11=101",
] * 4


def tiny_config(**kw) -> ModelConfig:
    base = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=96, vocab_size=300,
                embedding_size=320, mask_token_id=data.MASK_ID, eos_token_id=data.EOS_ID, rope_theta=10000.0)
    arch = kw.pop("arch", "llada")  # an architecture's config: its card's traits (Dream's logit shift, ...)
    return card_named(arch).config(**(base | kw))


def random_model(cfg: ModelConfig, seed: int = 0, std: float = 0.3) -> MaskPredictor:
    """Random weights with a large std: peaked, well-separated logits like a trained model's."""
    torch.manual_seed(seed)
    model = MaskPredictor(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model.eval()


def make_model_dir(folder: Path, seed: int = 0, **cfg_overrides) -> Path:
    tok = data.train_tokenizer(TEXTS, vocab_size=300)
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), **cfg_overrides)
    save_model(random_model(cfg, seed), folder)
    data.save_tokenizer(tok, folder)
    return folder


def simulated_llm(model_dir: Path, step_s: float, max_batch: int = 4):
    """An LLM over `model_dir` whose runner is engine/loop/sim_runner.py's, each step `step_s` long
    (the tokenizer and request validation stay real)."""
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from celeris.engine.loop.sim_runner import simulate

    llm = LLM.load(model_dir, EngineConfig(max_batch=max_batch, max_queue=2 * max_batch, max_prompt_tokens=64,
                                           max_gen_length=64))
    simulate(llm, step_s)
    return llm


def stream_beside(llm, seqs: list, timeout_s: float = 300) -> list:
    """Run `seqs` together through a real asyncio Scheduler on `llm.loop`. Per request, in order:
    its final generated ids, or the EngineError its stream raised (row-isolation tests check that
    one request's error stays its own while the others finish as they would alone)."""
    import asyncio

    from celeris.engine.errors import EngineError
    from celeris.engine.loop.scheduler import Scheduler

    async def main():
        sched = Scheduler(llm.loop)
        sched.start()
        streams = [sched.submit(s) for s in seqs]

        async def drain(stream):
            try:
                return list([ev async for ev in stream][-1].generated)
            except EngineError as e:
                return e
        try:
            return await asyncio.gather(*(drain(s) for s in streams))
        finally:
            await sched.stop()

    return asyncio.run(asyncio.wait_for(main(), timeout_s))
