"""A smoke run of the celeris-tiny recipe: corpus -> tokenizer -> a few steps -> loadable model -> eval."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from celeris.engine.llm import LLM
from celeris.engine.training import data
from celeris.engine.training.evaluate import distinct_ngrams, evaluate, format_report
from celeris.engine.training.objective import block_loss, block_mask, full_loss, stratified_t
from celeris.engine.training.tasks import CANVASES
from celeris.engine.training.train import train
from tests.helpers import random_model, tiny_config

needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg") is None,
                               reason="the corpus comes from Debian's r-cran-janeaustenr")


def test_stratified_t_covers_every_interval():
    t = stratified_t(8, torch.Generator().manual_seed(0)).sort().values
    assert ((t >= torch.arange(8) / 8) & (t < (torch.arange(8) + 1) / 8)).all()


def test_losses_only_score_maskable_positions():
    model = random_model(tiny_config(), seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(5, 300, (4, 12))
    real = torch.ones_like(x, dtype=torch.bool)
    for loss in (full_loss(model, x, real, real, data.MASK_ID, gen),
                 block_loss(model, x, real, real, data.MASK_ID, 4, gen)):
        assert loss.item() > 0 and loss.requires_grad
    nothing = torch.zeros_like(real)  # nothing to predict: every position is context
    assert full_loss(model, x, real, nothing, data.MASK_ID, gen).item() == 0.0
    assert block_loss(model, x, real, nothing, data.MASK_ID, 4, gen).item() == 0.0


def test_block_mask_is_what_the_exact_cache_gives_a_denoised_block():
    pos = torch.tensor([[0, 0, 1, 2, 3, 4, 5]])  # one left pad, then positions 0..5; blocks of 2
    real = torch.tensor([[False, True, True, True, True, True, True]])
    m = block_mask(pos, real, 2)[0]
    L = 7
    noisy, clean = m[:L], m[L:]
    # Noisy position 3 (block 1) sees noisy block 1 and clean block 0, never padding or later blocks.
    assert noisy[4, :L].nonzero().flatten().tolist() == [3, 4]
    assert noisy[4, L:].nonzero().flatten().tolist() == [1, 2]
    # Clean position 5 (block 2) sees clean blocks 0..2: block-causal, like a prefill.
    assert not clean[5, :L].any() and clean[5, L:].nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6]


def test_distinct_ngrams():
    assert distinct_ngrams("a b c d e".split()) == 1.0
    assert distinct_ngrams("a b c d a b c d".split()) == 4 / 5
    assert distinct_ngrams("a b c".split()) is None


@needs_apt
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_training_smoke_run_produces_a_loadable_model(tmp_path, arch):
    cache = tmp_path / "cache"
    info = train(tmp_path / "model", steps=6, size="small", arch=arch, cache_dir=cache, vocab_size=512,
                 checkpoint_every=3, tokens=512, threads=1, long_steps=3)
    assert info["steps"] == 6 and info["long_steps"] == 3 and info["corpus"]["package"] == "r-cran-janeaustenr"
    assert info["minutes"] >= 0 and info["long_minutes"] >= 0
    saved = json.loads((tmp_path / "model" / "training.json").read_text())
    assert saved["parameters"] == info["parameters"] and saved["arch"] == arch
    llm = LLM.load(tmp_path / "model")
    assert llm.tokenizer.mask_id == data.MASK_ID and llm.tokenizer.add_bos
    assert llm.model.cfg.arch == arch and llm.tokenizer.chat_template == data.TOKENIZER_CONFIG["chat_template"]
    res = llm.generate_one("It is a truth", gen_length=8, steps=8, block_length=4, seed=0)
    assert res.steps >= 1
    report = evaluate(llm, cache, decoders={"threshold 0.9": {"threshold": 0.9}}, limit=8, lengths=(4, 16),
                      prose_limit=4)
    assert report["skill_problems"] == 8 and len(report["scores"]) == 1
    assert [r["max_tokens"] for r in report["lengths"]] == [4, 16]
    assert report["heldout_nelbo_per_token"] > 0 and report["prose"]["prompts"] == 4
    assert "| threshold 0.9 |" in format_report(report)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@needs_apt
def test_supervised_examples_end_in_eos_padding_to_their_canvas(tmp_path):
    from celeris.engine.training.corpus import load_austen

    novels = load_austen(tmp_path / "cache")
    tok = data.train_tokenizer([p for ps in novels.values() for p in ps[:200]], 512)
    maker = data.make_batches(tok, novels, seed=0).tasks
    for canvas in CANVASES[:4]:
        for _ in range(20):
            ex = maker.example(canvas)
            assert len(ex.response) == canvas and data.MASK_ID not in ex.prompt + ex.response
            # Whatever the answer, once EOS starts the rest is EOS (what the engine stops at).
            if data.EOS_ID in ex.response:
                first = ex.response.index(data.EOS_ID)
                assert set(ex.response[first:]) == {data.EOS_ID}


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_long_canvas_additions_draw_the_long_canvases_they_are_weighted_to(tmp_path):
    """The long-canvas phase's addition batches follow `tasks.LONG_CANVAS_WEIGHTS`: mostly
    canvas 256, and every canvas still seen."""
    from collections import Counter
    from tokenizers import Tokenizer
    from celeris.engine.training import tasks
    shipped = Path(__file__).resolve().parents[3] / "engine" / "training" / "celeris-tiny"
    tok = Tokenizer.from_file(str(shipped / "tokenizer.json"))
    novels = {"Emma": ["Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years."] * 60}
    b = data.make_batches(tok, novels, seed=7)
    widths = Counter()
    for _ in range(300):
        x, real, maskable = b.additions(2048, canvas_weights=tasks.LONG_CANVAS_WEIGHTS)
        widths[int(maskable[0].sum())] += 1  # the response (the canvas) is what is maskable
    assert set(widths) == set(tasks.CANVASES)
    assert widths[256] == max(widths.values()) and widths[256] > 300 * 0.4
