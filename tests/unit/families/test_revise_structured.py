"""Structured outputs on a revising model (DiffusionGemma): every output parses and validates, the
structure's fixed tokens show on each canvas as it starts, a request decodes the same alone as
batched, and unconstrained rows beside it decode what they decode alone.

A tiny random DiffusionGemma checkpoint written by transformers' classes, with celeris-tiny's
byte-level BPE tokenizer (JSON needs its punctuation), CPU, float32.
"""

import json
import re
from dataclasses import replace

import pytest

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.errors import InvalidRequest  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.requests import Request  # noqa: E402
from celeris.engine.structured.constraint import Structured  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint  # noqa: E402
from tests.unit.schemas import PERSON  # noqa: E402

CANVAS = 16
CHOICES = ["not sure", "a/b", "x-y [z]"]
MAIL = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = write_bpe_checkpoint(tmp_path_factory.mktemp("dg-structured"), canvas_length=CANVAS)
    return LLM.load(folder, EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=64, max_gen_length=192))


def _params(llm, seed: int, gen_length: int = 160):
    return replace(llm.defaults, gen_length=gen_length, block_length=gen_length, steps=1, seed=seed,
                   max_denoising_steps=3)


def _build(llm, spec, prompt: str, params):
    return llm.build(Request(prompt=prompt, params=params, structured=spec))


def test_outputs_validate(llm):
    jobs = [(Structured("json_schema", PERSON), "Person:", _params(llm, s)) for s in range(3)]
    jobs += [(Structured("choice", CHOICES), "Q:", _params(llm, 1, 16)),
             (Structured("regex", MAIL), "Mail:", _params(llm, 2, 32)),
             (Structured("json_object"), "Obj:", _params(llm, 3, 64))]
    out = llm.run([_build(llm, *job) for job in jobs])
    for r in out[:3]:
        jsonschema.validate(json.loads(r.text), PERSON)
        assert r.text.startswith('{"name":"') and r.text.endswith("}")  # exactly the JSON, no filler
    assert out[3].text in CHOICES
    assert re.fullmatch(MAIL, out[4].text)
    assert isinstance(json.loads(out[5].text), dict)
    assert all(r.finish_reason.value == "stop" for r in out)  # the stop id after the structure ends it


def test_fixed_tokens_show_as_each_canvas_starts_and_never_change(llm):
    """Every step shows the structure's fixed tokens on the canvas being denoised (pinned in its
    input and its draft), and the committed canvases keep them."""
    seq = _build(llm, Structured("json_schema", PERSON), "Person:", _params(llm, 5))
    layout = seq.constraint.layout.canvas
    events = []
    llm.run([seq], events.append)
    end = max(p for p, t in enumerate(layout) if t != seq.constraint.layout.tail) + 1  # then the stop id
    fixed = [p for p, t in enumerate(layout[:end]) if t != llm.tokenizer.mask_id]
    shown = 0
    for ev in events:
        # the canvas being denoised starts at the final prefix; a step that commits a canvas shows
        # that one (the next is shown from its first step)
        lo = ev.settled - CANVAS if ev.block_complete else ev.settled
        on_canvas = [p for p in fixed if lo <= p < lo + CANVAS]
        assert [ev.canvas[p] for p in on_canvas] == [layout[p] for p in on_canvas], ev.step
        shown += len(on_canvas)
    assert shown > len(events)  # the skeleton spans canvases
    assert llm.tokenizer.render(events[0].canvas[:8]).startswith('{"name":')  # the value's quote is its slot's


def test_alone_equals_batched_and_free_rows_are_untouched(llm):
    spec = Structured("json_schema", PERSON)
    alone = llm.run([_build(llm, spec, "Person:", _params(llm, 7))])[0]
    free = replace(_params(llm, 8, 32), ignore_eos=True)
    free_alone = llm.run([llm.build(Request(prompt="It was", params=free))])[0]
    mixed = llm.run([llm.build(Request(prompt="It was", params=free)), _build(llm, spec, "Person:", _params(llm, 7)),
                     _build(llm, Structured("choice", ["yes", "no"]), "Q:", _params(llm, 9, 16))])
    assert mixed[1].token_ids == alone.token_ids
    assert mixed[0].token_ids == free_alone.token_ids
    assert mixed[2].text in ("yes", "no")


def test_refusals_name_the_field(llm):
    with pytest.raises(InvalidRequest, match="canvas"):
        _build(llm, Structured("json_schema", PERSON), "x", _params(llm, 0, 16))
    with pytest.raises(InvalidRequest, match="stop"):
        _build(llm, Structured("regex", "a{1,3}"), "x", replace(_params(llm, 0, 16), stop=("}",)))
