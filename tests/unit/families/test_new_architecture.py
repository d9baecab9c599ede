"""A new architecture is one card (engine/families/card.py): this test invents one, "Toy", with its
own config.json keys, its own tensor names and its own published defaults, lists its card in the
canvas row, and loads and decodes a checkpoint written here with real safetensors. No engine file
knows of it; without its card the same folder is refused by name."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from celeris.engine.config import EngineConfig, ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.families import registry
from celeris.engine.families.card import ArchCard, names_any, published, renamer
from celeris.engine.families.checkpoint import save_model
from celeris.engine.families.family import FULL
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.sampling.batch import SelectionRule
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.training import data
from tests.helpers import random_model, tiny_config

# The model's parameter names -> Toy's (how its checkpoints call them), and back.
PARTS = (("wte", "embed"), ("ff_out", "head"), ("ln_f", "final_norm"))
LAYER_PARTS = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("attn_out", "out"), ("attn_norm", "norm1"),
               ("ff_norm", "norm2"), ("ff_proj", "gate"), ("up_proj", "up"), ("ff_out", "down"))
TOY_PUBLISHED = tuple((rf"^transformer\.{ours}\.", f"toy.{theirs}.") for ours, theirs in PARTS) + tuple(
    (rf"^transformer\.blocks\.(\d+)\.{ours}\.", rf"toy.layer\1.{theirs}.") for ours, theirs in LAYER_PARTS)
TOY_NAMES = tuple((rf"^toy\.{theirs}\.", f"transformer.{ours}.") for ours, theirs in PARTS) + tuple(
    (rf"^toy\.layer(\d+)\.{theirs}\.", rf"transformer.blocks.\1.{ours}.") for ours, theirs in LAYER_PARTS)
TOY_THRESHOLD = 0.7  # what Toy's published loop decodes with


def _toy_config(raw: dict, name: str) -> ModelConfig:
    return TOY.config(d_model=raw["width"], n_heads=raw["heads"], n_kv_heads=raw["kv_heads"], n_layers=raw["depth"],
                      mlp_hidden_size=raw["ffn"], vocab_size=raw["vocab"], embedding_size=raw["vocab_rows"],
                      mask_token_id=raw["mask_id"], eos_token_id=raw["eos_id"], name=name)


def _toy_json(c: ModelConfig) -> dict:
    return {"architectures": ["ToyDiffusionLM"], "width": c.d_model, "heads": c.n_heads, "kv_heads": c.n_kv_heads,
            "depth": c.n_layers, "ffn": c.mlp_hidden_size, "vocab": c.vocab_size, "vocab_rows": c.embedding_size,
            "mask_id": c.mask_token_id, "eos_id": c.eos_token_id}


TOY = ArchCard(
    name="toy", architectures=("ToyDiffusionLM",), claims=lambda raw, folder: names_any(raw, "ToyDiffusionLM"),
    parse=_toy_config, tensor_name=renamer(TOY_NAMES),
    rule=functools.partial(SelectionRule, conf_dtype=torch.float64),  # LLaDA's, so the two decodes can be compared
    defaults=(("threshold", TOY_THRESHOLD),), traits=(("rope_fp32", True),),
    writes=_toy_json, published_name=functools.partial(published, TOY_PUBLISHED, "Toy"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """The same random weights twice: in Toy's format (config.json and tensor names written here,
    from its card's tables), and in celeris's LLaDA format."""
    tiny = EMBEDDED_MODELS["celeris-tiny"]
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    model = random_model(tiny_config(vocab_size=vocab, embedding_size=vocab + 16), seed=7)
    toy, llada = tmp_path_factory.mktemp("toy"), tmp_path_factory.mktemp("llada")
    (toy / "config.json").write_text(json.dumps(_toy_json(model.cfg)))
    names = functools.partial(published, TOY_PUBLISHED, "Toy")
    save_file({names(k): v.contiguous() for k, v in model.state_dict().items()}, str(toy / "model.safetensors"))
    assert all(k.startswith("toy.") for k in safe_open(toy / "model.safetensors", "pt").keys())
    save_model(model, llada)
    for folder in (toy, llada):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tiny / name, folder / name)
    return toy, llada


@pytest.fixture
def with_toy(monkeypatch):
    """Toy's card listed by the canvas row: what adding it to engine/families/canvas/ would do."""
    rows = tuple(dataclasses.replace(r, cards=r.cards + (TOY,)) if r.kind == FULL else r for r in registry.ROWS)
    monkeypatch.setattr(registry, "ROWS", rows)


def test_without_its_card_the_folder_is_refused_by_name(folders):
    with pytest.raises(ModelLoadError, match="ToyDiffusionLM"):
        LLM.load(folders[0])


def test_one_card_loads_and_decodes_a_new_architecture(folders, with_toy, tmp_path):
    toy = LLM.load(folders[0], EngineConfig(max_batch=4))
    assert (toy.family.arch, toy.family.kind, toy.model_config.arch) == ("toy", FULL, "toy")
    assert toy.family.rule == SelectionRule(data.MASK_ID, torch.float64)
    assert toy.defaults.threshold == TOY_THRESHOLD  # its published defaults, from its card
    assert "ToyDiffusionLM" in registry.known_architectures()
    out = tmp_path / "written"
    save_model(toy.model, out)  # and celeris writes it back in Toy's format, through the card
    assert json.loads((out / "config.json").read_text()) == json.loads((folders[0] / "config.json").read_text())
    llada = LLM.load(folders[1], EngineConfig(max_batch=4))
    for name, p in llada.model.state_dict().items():  # every tensor under Toy's name reached its place
        assert torch.equal(toy.model.state_dict()[name], p), name
    prompts = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome,"]
    params = SamplingParams(gen_length=16, steps=8, block_length=8, seed=3, threshold=TOY_THRESHOLD)
    decoded = toy.generate(prompts, params)
    assert [r.token_ids for r in decoded] == [r.token_ids for r in llada.generate(prompts, params)]
    assert all(r.steps > 0 and r.token_ids for r in decoded)
