"""Nemotron-Labs-Diffusion on a tiny random checkpoint (released config keys and tensor names, a
random draft adapter): token for token as a plain-torch transcription of the published
`ar_generate`, `generate` and `linear_spec_generate` at temperature 0 (tests/unit/families/
nemotron_reference.py), self-speculation equal to autoregressive decoding alone and in a batch of 8,
seeds that reproduce in any batch, and its refusals by field."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.unit.families.nemotron_helpers import write_tiny_nemotron
from tests.unit.families.nemotron_reference import Reference

ENGINE = EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64)
G = 32  # output positions cross 32, where YaRN's original length ends and the query scale starts


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(rng.randrange(5, 20))] for _ in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_nemotron(tmp_path_factory.mktemp("nemotron"))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM.load(folder, ENGINE)


@pytest.fixture(scope="module")
def ref(folder):
    return Reference(folder)


def _run(llm: LLM, prompts: list[list[int]], **knobs) -> list:
    seqs = [llm.sequence(p, replace(llm.defaults, **knobs).with_seed(7)) for p in prompts]
    llm.run(seqs)
    return seqs


def _tokens(seq) -> list[int]:
    """Celeris's output with the stop token put back (the reference keeps it)."""
    out = seq.generated()
    return out + [2] if seq.finish_reason is not None and seq.finish_reason.value == "stop" else out


def test_the_folder_loads_with_its_modes(llm):
    assert llm.family.kind == "causal" and llm.family.modes == ("diffusion", "ar", "linear_spec")
    assert llm.defaults.block_length == 8 and llm.model.cfg.draft_adapter


@pytest.mark.slow  # about 50 decodes, each beside the reference's
@pytest.mark.parametrize("mode", ["ar", "diffusion", "linear_spec"])
def test_token_for_token_as_the_reference(llm, ref, mode):
    """Several prompts, block lengths and thresholds; every decode identical (counted in the notes)."""
    settings = {"ar": [(8, None)], "diffusion": [(4, None), (8, None), (8, 0.5), (16, 0.9)],
                "linear_spec": [(4, None), (8, None), (4, 0.6), (16, None)]}[mode]
    prompts, same, total = _prompts(4, seed=len(mode)), 0, 0
    for b, th in settings:
        seqs = _run(llm, prompts, decoding=mode, block_length=b, threshold=th, gen_length=G, steps=G)
        for p, s in zip(prompts, seqs):
            if mode == "ar":
                want = ref.ar_generate(p, G)
            elif mode == "diffusion":
                want = ref.generate(p, G, b, th)
            else:
                want = ref.linear_spec_generate(p, G, b, th or 0.0)[0][:G]
            total += 1
            same += _tokens(s) == want[:G]
    print(f"{mode}: {same}/{total} identical")
    assert same == total


def test_self_speculation_is_autoregressive_alone_and_in_a_batch_of_8(llm):
    prompts = _prompts(8, seed=11)
    ar = [_tokens(s) for s in _run(llm, prompts, decoding="ar", gen_length=G, steps=G)]
    alone = [_tokens(_run(llm, [p], decoding="linear_spec", gen_length=G, steps=G)[0]) for p in prompts[:2]]
    batch = _run(llm, prompts, decoding="linear_spec", gen_length=G, steps=G, block_length=8)
    assert alone == ar[:2]
    assert [_tokens(s) for s in batch] == ar
    for s in batch:  # each row accepted its own prefixes: at least one token a pass
        assert s.verify_passes and s.accepted_tokens >= s.verify_passes
    ev = batch[0].event()
    assert ev.verify_passes == batch[0].verify_passes and ev.accepted_tokens == batch[0].accepted_tokens


def test_modes_in_one_batch_decode_as_alone(llm):
    """A batch mixing every mode (and prefills beside decodes) gives each request its own tokens."""
    prompts = _prompts(6, seed=5)
    modes = ["ar", "diffusion", "linear_spec"] * 2
    alone = [_tokens(_run(llm, [p], decoding=m, gen_length=32, steps=32)[0]) for p, m in zip(prompts, modes)]
    seqs = [llm.sequence(p, replace(llm.defaults, decoding=m, gen_length=32, steps=32).with_seed(7))
            for p, m in zip(prompts, modes)]
    llm.run(seqs)
    assert [_tokens(s) for s in seqs] == alone


@pytest.mark.parametrize("mode", ["ar", "diffusion", "linear_spec"])
def test_seeds_reproduce_alone_and_in_a_batch(llm, mode):
    prompts = _prompts(4, seed=21)
    knobs = dict(decoding=mode, gen_length=32, steps=32, temperature=0.9)
    alone = [_tokens(_run(llm, [p], **knobs)[0]) for p in prompts]
    together = [_tokens(s) for s in _run(llm, prompts, **knobs)]
    assert together == alone
    greedy = [_tokens(s) for s in _run(llm, prompts, **(knobs | {"temperature": 0.0}))]
    assert together != greedy  # the temperature did draw


def test_self_speculation_without_its_adapter_is_refused_by_field(tmp_path):
    llm = LLM.load(write_tiny_nemotron(tmp_path / "bare", adapter=False), ENGINE)
    assert llm.family.modes == ("diffusion", "ar")
    with pytest.raises(InvalidRequest) as e:
        llm.request([5, 6, 7], SamplingParams(decoding="linear_spec", block_length=8, gen_length=16, steps=16))
    assert [v.field for v in e.value.violations] == ["decoding"]
    assert "adapter" in e.value.violations[0].description


def test_knobs_its_loops_do_not_read_are_refused(llm):
    with pytest.raises(InvalidRequest) as e:
        llm.request([5, 6, 7], SamplingParams(block_length=8, gen_length=16, steps=16, top_k=5, remasking="margin"))
    assert {v.field for v in e.value.violations} == {"top_k", "remasking"}


def test_other_families_refuse_decoding_modes():
    from celeris.engine.families.registry import family_of
    from tests.helpers import tiny_config

    for arch in ("llada", "sdar"):
        bad = family_of(tiny_config(arch=arch)).violations(SamplingParams(decoding="ar"))
        assert [v.field for v in bad] == ["decoding"], arch


def test_structured_outputs_are_refused_by_field(llm):
    from celeris.engine.requests import Request
    from celeris.engine.structured.spec import Structured

    with pytest.raises(InvalidRequest) as e:
        llm.build(Request(prompt="Hi", params=replace(llm.defaults, gen_length=16, steps=16),
                          structured=Structured("regex", "[ab]+", "regex")))
    assert "structured outputs are not served" in e.value.violations[0].description
