"""celeris.engine.families.registry: each checkpoint folder is claimed by its family's row, the row
names the runner and request state, and the revising knobs come from one table (SamplingParams)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.families.block.runner import BlockRunner
from celeris.engine.families.block.sequence import BlockSequence
from celeris.engine.families.canvas.runner import Runner
from celeris.engine.families.canvas.sequence import CanvasSequence
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.family import BLOCK, CAUSAL, FULL, REVISE, REVISE_KNOBS
from celeris.engine.families.nemotron.runner import NemotronRunner
from celeris.engine.families.nemotron.sequence import NemotronSequence
from celeris.engine.families.registry import ROWS, claim, family_of, row_of
from celeris.engine.families.revise.runner import ReviseRunner
from celeris.engine.families.revise.sampler import ReviseParams
from celeris.engine.families.revise.sequence import RevisingSequence
from celeris.engine.llm import EMBEDDED_MODELS, LLM, model_defaults
from celeris.engine.sampling.knobs import KNOBS, configured
from celeris.engine.sampling.params import MASK, SamplingParams


def _gemma_family():
    return family_of(type("GemmaCfg", (), {"arch": "diffusion-gemma", "canvas_length": 16})())


def test_every_kind_has_one_row():
    assert sorted(r.kind for r in ROWS) == sorted((FULL, BLOCK, REVISE, CAUSAL))
    assert {r.kind: (r.runner, r.sequence) for r in ROWS} == {
        FULL: (Runner, CanvasSequence), BLOCK: (BlockRunner, BlockSequence), REVISE: (ReviseRunner, RevisingSequence),
        CAUSAL: (NemotronRunner, NemotronSequence)}


def test_rows_claim_their_folders(tmp_path):
    assert claim(EMBEDDED_MODELS["celeris-tiny"]).kind == FULL
    assert claim(EMBEDDED_MODELS["celeris-tiny-block"]).kind == BLOCK
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DiffusionGemmaForBlockDiffusion"]}))
    assert claim(tmp_path).kind == REVISE
    with pytest.raises(ModelLoadError, match="does not exist"):
        claim(tmp_path / "missing")


def test_the_llm_asks_its_row(tiny_llm):
    assert tiny_llm.row is row_of(tiny_llm.family) and tiny_llm.row.kind == FULL
    assert isinstance(tiny_llm.runner, Runner)
    seq = tiny_llm.sequence([5, 6], SamplingParams(gen_length=8, steps=8, block_length=8, seed=0))
    assert type(seq) is CanvasSequence and seq.params.kv_cache == tiny_llm.config.kv_cache
    assert tiny_llm.warmup_params == SamplingParams(gen_length=1, steps=1, block_length=1, seed=0)


def test_block_requests_are_block_sequences():
    llm = LLM.load("celeris-tiny-block", EngineConfig(max_batch=2))
    seq = llm.sequence([5, 6], llm.defaults)
    assert type(seq) is BlockSequence and llm.kv_cache == "exact"


def test_revise_row_warms_up_one_step_and_shapes_whole_canvases():
    family = _gemma_family()
    row = row_of(family)
    assert row.warmup_params().max_denoising_steps == 1
    params, extra = row.shape(SamplingParams(gen_length=20, seed=0), family, EngineConfig())
    assert (params.gen_length, params.block_length, params.steps, params.kv_cache) == (32, 16, 2, "exact")


def test_revise_params_are_the_tables_revise_knobs():
    assert tuple(f.name for f in fields(ReviseParams)) == REVISE_KNOBS
    base = SamplingParams()
    assert ReviseParams() == ReviseParams.of(base)
    assert all(getattr(ReviseParams(), name) == getattr(base, name) for name in REVISE_KNOBS)
    refused = {k.name for k in KNOBS if k.only == MASK}
    assert "temperature" in refused and not refused & set(REVISE_KNOBS)


def test_generation_config_reads_each_knob_at_its_key():
    revise = _gemma_family().model_knobs
    raw = {"max_denoising_steps": 6, "t_min": 0, "t_max": None, "temperature": 0.7,
           "sampler_config": {"entropy_bound": 1}}
    assert configured(raw, revise) == {"max_denoising_steps": 6, "t_min": 0.0, "entropy_bound": 1.0}


def test_mask_models_read_no_revise_knob(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"steps": 32, "t_max": 0.9}))
    d = model_defaults(tmp_path)
    assert d.steps == 32 and d.t_max == SamplingParams().t_max


@pytest.mark.parametrize("name", REVISE_KNOBS)
def test_revise_knobs_are_refused_by_mask_models(tiny_llm, name):
    bad = tiny_llm.family.violations(SamplingParams(**{name: getattr(ReviseParams(), name) * 2 + 1}))
    assert [v.field for v in bad] == [name]
