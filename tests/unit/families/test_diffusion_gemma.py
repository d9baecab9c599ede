"""DiffusionGemma token for token against transformers' generate() (issue #30).

Tiny random checkpoints written by transformers' own classes (with a vision tower, which celeris
leaves out), CPU, float32, fixed seeds. The reference runs with eager attention.
"""

from itertools import product

import pytest
import torch

pytest.importorskip("transformers")

from celeris.engine.errors import ModelLoadError  # noqa: E402
from celeris.engine.families.revise.config import gemma_config  # noqa: E402
from celeris.engine.families.revise.weights import load_gemma  # noqa: E402
from celeris.engine.families.revise.slots import SlotState, generate  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import (  # noqa: E402
    reference_generate, reference_model, write_checkpoint)
from tests.unit.gemma_helpers import PARAMS, PROMPTS, gen_kwargs  # noqa: E402


@pytest.fixture(scope="module", params=[(8, 1.0), (5, 40.0)], ids=["canvas8", "canvas5-sharp"])
def pair(request, tmp_path_factory):
    length, gain = request.param
    folder = write_checkpoint(tmp_path_factory.mktemp(f"dg{length}"), canvas_length=length, seed=length,
                              embed_gain=gain)
    return load_gemma(folder), reference_model(folder)


@pytest.mark.slow
@pytest.mark.parametrize("pname", list(PARAMS))
def test_token_identical_to_transformers_generate(pair, pname):
    ours, ref = pair
    p = PARAMS[pname]
    for prompt, seed, new in product(PROMPTS, (0, 3), (16, 10)):
        want = reference_generate(ref, prompt, seed, new, **gen_kwargs(p))
        assert generate(ours, prompt, p, seed, new, (), 0) == want, (prompt, seed, new)


def test_both_stopping_rules_are_exercised(pair):
    ours, _ = pair
    reasons = set()
    for pname, seed in product(("steps", "rule", "confident"), (0, 3)):
        seq = SlotState(ours, PROMPTS[0], PARAMS[pname], seed, 16, (), 0)
        while not seq.finished:
            c, sc = seq.denoise_input()
            seq.advance(ours.denoise(c, seq.cache, sc)[0])
            if seq.stop_reason:
                reasons.add(seq.stop_reason)
    assert reasons == {"rule", "steps"}


def test_end_of_sequence_stops_and_pads_like_the_reference(pair):
    ours, ref = pair
    p = PARAMS["rule"]
    free = generate(ours, PROMPTS[1], p, 1, 24, (), 0)
    eos = free[2]  # a token the first canvas writes: that canvas ends the request
    want = reference_generate(ref, PROMPTS[1], 1, 24, **gen_kwargs(p, eos_token_id=eos))
    got = generate(ours, PROMPTS[1], p, 1, 24, (eos,), 0)
    assert got == want and len(got) == ours.cfg.canvas_length and eos in got


def test_logits_match_the_reference_forward(pair):
    ours, ref = pair
    from transformers import DynamicCache

    prompt, canvas = torch.tensor([PROMPTS[1]]), torch.randint(0, 96, (1, ours.cfg.canvas_length))
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    with torch.no_grad():
        want = ref(input_ids=prompt, past_key_values=cache, decoder_input_ids=canvas).logits
    from celeris.engine.families.revise.model import KVCache

    kv = KVCache(ours.cfg)
    ours.encode(prompt, kv)
    assert torch.equal(ours.denoise(canvas, kv, None), want)


def test_vision_tower_is_left_out_and_said(pair):
    ours, _ = pair
    assert ours.cfg.left_out == ("vision_config",)


def test_unsupported_text_options_are_refused():
    raw = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "text_config": {"hidden_activation": "relu"}}
    with pytest.raises(ModelLoadError, match="hidden_activation"):
        gemma_config(raw)
    with pytest.raises(ModelLoadError, match="text_config"):
        gemma_config({"architectures": ["DiffusionGemmaForBlockDiffusion"]})


def test_batched_rows_decode_what_they_decode_alone(pair):
    """Rows of different prompts, seeds, settings and lengths join at different steps, share every
    forward, and finish at different steps: each decodes exactly its solo text."""
    from celeris.engine.families.revise.slots import step_rows

    ours, _ = pair
    jobs = [(PROMPTS[0], 0, "steps", 16), (PROMPTS[1], 3, "rule", 10), (PROMPTS[2], 5, "confident", 16),
            (PROMPTS[1], 7, "steps", 5)]
    solo = [generate(ours, pr, PARAMS[pn], seed, new, (), 0) for pr, seed, pn, new in jobs]
    seqs, step = [], 0
    while len(seqs) < len(jobs) or not all(s.finished for s in seqs):
        if step % 2 == 0 and len(seqs) < len(jobs):  # a new request joins every other step
            pr, seed, pn, new = jobs[len(seqs)]
            seqs.append(SlotState(ours, pr, PARAMS[pn], seed, new, (), 0))
        step_rows(ours, seqs)
        step += 1
    assert [s.final for s in seqs] == solo
    assert len({s.steps for s in seqs}) > 1  # they finished at different steps
