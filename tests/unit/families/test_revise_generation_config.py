"""DiffusionGemma accepts every generation_config transformers' sampler accepts (issue #40 item 14).

transformers 5.23 (`DiffusionGemmaGenerationConfig.validate`) takes t_min >= 0: step s of N runs at
t_min + (t_max - t_min) * s / N for s = N..1, so t_min itself is never the temperature. A folder
whose generation_config.json sets t_min 0.0 was refused at load ("t_min must be > 0"); it now loads
and decodes token for token what transformers' generate() decodes from that same file.
Tiny random checkpoint written by transformers' classes; CPU, float32.
"""

import json
from dataclasses import replace
from itertools import product

import pytest

pytest.importorskip("transformers")
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    DiffusionGemmaGenerationConfig, EntropyBoundSamplerConfig)

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.errors import InvalidRequest  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.families.revise.runner import revise_params  # noqa: E402
from celeris.engine.families.revise.slots import generate  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import (  # noqa: E402
    reference_generate, reference_model, write_checkpoint, write_tokenizer)

SAMPLER = {"max_denoising_steps": 6, "t_min": 0.0, "t_max": 0.5, "stability_threshold": 1,
           "confidence_threshold": 2.5, "sampler_config": {"entropy_bound": 1.0,
                                                           "_cls_name": "EntropyBoundSamplerConfig"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("dg-tmin0"), canvas_length=8, seed=8))
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **SAMPLER}))
    return folder


@pytest.fixture(scope="module")
def llm(folder):
    return LLM.load(folder, EngineConfig(max_batch=2, max_queue=8, max_prompt_tokens=32, max_gen_length=64))


def test_a_folder_with_t_min_0_loads_with_its_settings(llm):
    d = llm.defaults
    assert (d.max_denoising_steps, d.entropy_bound, d.t_min, d.t_max) == (6, 1.0, 0.0, 0.5)


def test_t_min_0_decodes_what_transformers_decodes_from_the_same_file(llm, folder):
    """transformers reads the folder's generation_config.json itself: no sampler arguments given."""
    ref, p = reference_model(folder), revise_params(llm.defaults)
    for prompt, seed in product(([2, 5, 6, 7], [2, 9, 10, 11, 12, 13, 14, 15, 16]), (0, 3)):
        want = reference_generate(ref, prompt, seed, 16, pad_token_id=0)
        assert generate(llm.model, prompt, p, seed, 16, (), 0) == want, (prompt, seed)


def _transformers_accepts(steps: int, t_min: float, t_max: float, stability: int, confidence: float,
                          bound: float) -> bool:
    try:
        DiffusionGemmaGenerationConfig(max_denoising_steps=steps, t_min=t_min, t_max=t_max,
                                       stability_threshold=stability, confidence_threshold=confidence,
                                       sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound))
    except (ValueError, AttributeError):  # 5.23 formats its stability/confidence refusals with a
        return False                       # missing attribute: an AttributeError, a refusal still
    return True


def test_every_setting_transformers_accepts_is_accepted_and_its_refusals_refused(llm):
    """A grid around every bound transformers checks. Celeris refuses what transformers refuses, but
    for three settings it also runs (t_max == t_min > 0: a constant temperature; entropy_bound 0;
    confidence_threshold 0) and its own limit on steps (MAX_DENOISING_STEPS)."""
    accepted = refused = 0
    for steps, t_min, t_max, stability, confidence, bound in product(
            (1, 48), (-0.1, 0.0, 0.4), (-0.1, 0.0, 0.4, 0.8), (-1, 0, 3), (0.0, 0.005), (0.0, 0.1)):
        ours = replace(llm.defaults, max_denoising_steps=steps, t_min=t_min, t_max=t_max,
                       stability_threshold=stability, confidence_threshold=confidence, entropy_bound=bound)
        try:
            ours.validate()
            celeris = True
        except InvalidRequest:
            celeris = False
        theirs = _transformers_accepts(steps, t_min, t_max, stability, confidence, bound)
        # what transformers would accept but for the three settings celeris runs besides
        relaxed = _transformers_accepts(steps, t_min, t_max + 0.1 if t_max == t_min > 0 else t_max, stability,
                                        confidence or 0.005, bound or 0.1)
        assert celeris == (theirs or relaxed), (steps, t_min, t_max, stability, confidence, bound, theirs)
        accepted, refused = accepted + theirs, refused + (not celeris)
    assert accepted and refused  # both sides of every bound were tried


def test_refusals_name_the_field(llm):
    with pytest.raises(InvalidRequest) as e:
        replace(llm.defaults, t_min=0.0, t_max=0.0).validate()
    assert {v.field for v in e.value.violations} == {"t_max"}
    with pytest.raises(InvalidRequest) as e:
        replace(llm.defaults, t_min=-0.1).validate()
    assert {v.field for v in e.value.violations} == {"t_min"}
