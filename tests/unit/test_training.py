"""A smoke run of the celeris-tiny recipe: corpus -> tokenizer -> a few steps -> loadable model -> eval."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.llm import LLM
from engine.training import data
from engine.training.evaluate import evaluate, format_report
from engine.training.train import pretrain_loss, sft_loss, stratified_t, train
from tests.helpers import random_model, tiny_config

needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg") is None,
                               reason="the corpus comes from Debian's r-cran-janeaustenr")


def test_stratified_t_covers_every_interval():
    t = stratified_t(8, torch.Generator().manual_seed(0)).flatten().sort().values
    assert ((t >= torch.arange(8) / 8) & (t < (torch.arange(8) + 1) / 8)).all()


def test_losses_only_score_masked_positions():
    model = random_model(tiny_config(), seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(5, 300, (4, 12))
    loss = pretrain_loss(model, x, gen)
    assert loss.item() > 0 and loss.requires_grad
    plen = torch.full((4,), 12)  # nothing to predict: the answer region is empty
    assert sft_loss(model, x, plen, gen).item() == 0.0


@needs_apt
def test_training_smoke_run_produces_a_loadable_model(tmp_path):
    cache = tmp_path / "cache"
    info = train(tmp_path / "model", steps=8, small=True, cache_dir=cache, vocab_size=512, checkpoint_every=4)
    assert info["steps"] == 8 and info["corpus"]["package"] == "r-cran-janeaustenr"
    saved = json.loads((tmp_path / "model" / "training.json").read_text())
    assert saved["parameters"] == info["parameters"]
    llm = LLM.load(tmp_path / "model")
    assert llm.tokenizer.mask_id == data.MASK_ID and llm.tokenizer.add_bos
    res = llm.generate_one("It is a truth", gen_length=8, steps=8, block_length=8, seed=0)
    assert res.steps <= 8
    report = evaluate(llm, cache, decoders={"reference (steps=gen_length)": {"steps": 4}, "threshold 0.9": {"threshold": 0.9}},
                      limit=16)
    assert report["skill_problems"] == 16 and len(report["scores"]) == 2
    assert report["heldout_masked_token_loss"] > 0
    assert "| threshold 0.9 |" in format_report(report)
