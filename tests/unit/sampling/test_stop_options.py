"""Per-request stop options in the engine: stop_token_ids, ignore_eos, min_tokens."""

from __future__ import annotations

import pytest

from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams

ADD = "37+45="  # celeris-tiny answers two digits, then EOS


@pytest.fixture(scope="module")
def tiny():
    return LLM.load()  # the embedded model: it really ends its answers with EOS


def run(llm, prompt=ADD, **kw):
    seq = llm.sequence(llm.encode_prompt(prompt), SamplingParams(gen_length=8, steps=8, block_length=8, seed=0, **kw))
    llm.loop.add(seq)
    llm.loop.run_to_completion()
    return seq


def test_eos_stops_and_ignore_eos_runs_the_whole_canvas(tiny):
    plain = run(tiny)
    assert plain.finish_reason.value == "stop" and tiny.tokenizer.eos_id in plain.canvas
    assert len(plain.generated()) < 8
    ignored = run(tiny, ignore_eos=True)
    assert ignored.finish_reason.value == "length" and ignored.generated() == ignored.canvas  # EOS kept as a token


def test_stop_token_ids_cut_the_output_at_the_first_of_them(tiny):
    base = run(tiny, ignore_eos=True).canvas
    stop = base[1]
    cut = run(tiny, stop_token_ids=(stop,), ignore_eos=True)
    assert cut.generated() == base[:base.index(stop)] and cut.finish_reason.value == "stop"


def test_min_tokens_keeps_stop_tokens_out_of_the_first_positions(tiny):
    plain = run(tiny)
    first_eos = plain.canvas.index(tiny.tokenizer.eos_id)
    later = run(tiny, min_tokens=first_eos + 1)
    assert tiny.tokenizer.eos_id not in later.canvas[:first_eos + 1]
    assert len(later.generated()) >= first_eos + 1


@pytest.mark.parametrize("kw,field", [(dict(stop_token_ids=(-1,)), "stop_token_ids"),
                                      (dict(stop_token_ids=(10**9,)), "stop_token_ids"),
                                      (dict(min_tokens=9), "min_tokens"), (dict(ignore_eos="yes"), "ignore_eos")])
def test_bad_stop_options_are_refused(tiny, kw, field):
    with pytest.raises(InvalidRequest, match=field):
        tiny.sequence([5, 6], SamplingParams(gen_length=8, steps=8, block_length=8, **kw))


PROSE = "It is a truth universally"
LONG_PROSE = "She was"  # celeris-tiny answers it with a full 32-token canvas (PROSE ends early)


def test_stop_strings_cut_the_text_where_they_begin_and_end_the_request_early(tiny):
    params = dict(gen_length=32, steps=32, block_length=8, seed=0)
    full = tiny.generate_one(LONG_PROSE, SamplingParams(**params))
    assert len(full.text) >= 24, full.text  # the test needs text past the stop
    stop = full.text[14:18]  # a string inside the output, likely across token boundaries
    cut = tiny.generate_one(LONG_PROSE, SamplingParams(**params, stop=(stop, "never in the text")))
    assert cut.text == full.text[:full.text.find(stop)]
    assert cut.finish_reason.value == "stop" and cut.steps < full.steps  # the next blocks never ran
    ids = cut.token_ids
    assert stop in tiny.tokenizer.decode(ids) and stop not in tiny.tokenizer.decode(ids[:-1])  # through its last token
    assert ids == full.token_ids[:len(ids)]


def test_a_stop_string_absent_from_the_output_changes_nothing(tiny):
    params = dict(gen_length=16, steps=16, block_length=8, seed=0)
    a = tiny.generate_one(PROSE, SamplingParams(**params, stop=("\x00",)))
    b = tiny.generate_one(PROSE, SamplingParams(**params))
    assert (a.text, a.token_ids, a.steps, a.finish_reason) == (b.text, b.token_ids, b.steps, b.finish_reason)


@pytest.mark.parametrize("stop", [("",), ("x" * 257,), tuple("abcdefghijklmnopq")])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(InvalidRequest, match="stop"):
        SamplingParams(stop=stop).validate()
