"""celeris-tiny's tools phase: its conversations are in the served template and format (calls that
the hermes parser reads back and that validate against their tools' schemas, plain answers that
never open a call, long rows within their length), and a smoke run from a trained folder writes
a loadable model with the longer position range and the phase's record."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from celeris.engine.agents.parsers import TOOL_PARSERS
from celeris.engine.training import data
from celeris.engine.training.tool_tasks import TOOLS

SHIPPED = Path(__file__).resolve().parents[3] / "engine" / "training" / "celeris-tiny"
NOVELS = {"Emma": ["Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, "
                   "seemed to unite some of the best blessings of existence."] * 60,
          "Persuasion": ["Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own "
                         "amusement, never took up any book but the Baronetage."] * 60}


@pytest.fixture(scope="module")
def batches():
    from tokenizers import Tokenizer

    return data.make_batches(Tokenizer.from_file(str(SHIPPED / "tokenizer.json")), NOVELS, seed=3, tools=True)


def test_calls_read_back_and_validate_and_plain_answers_never_open_a_call(batches):
    tools = batches.tools
    schemas = {t.name: t.spec["function"]["parameters"] for t in TOOLS}
    hermes = TOOL_PARSERS["hermes"]
    seen = {"call": 0, "two": 0, "text": 0}
    for _ in range(60):
        turn = tools.turn()
        content, calls = hermes.extract(turn.answer, {t.name for t in turn.tools})
        if turn.answer.startswith("<tool_call>"):
            assert content == "" and calls, turn.answer  # exactly calls, nothing else
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), schemas[c.name])
                # the arguments are copied from the request (a city, a symbol, a query, ...)
                assert any(str(v) in turn.messages[-1]["content"] for v in json.loads(c.arguments).values())
            seen["two" if len(calls) == 2 else "call"] += 1
        else:
            assert calls == [] and "<tool_call>" not in turn.answer and turn.tools
            seen["text"] += 1
    assert all(seen.values()), seen


def test_examples_are_the_served_prompt_and_an_eos_padded_answer(batches):
    for _ in range(20):
        ex = batches.tools.example(64)
        assert ex.prompt[0] == data.BOS_ID and data.MASK_ID not in ex.prompt + ex.response
        assert len(ex.response) >= 64 and ex.response[-1] == data.EOS_ID
        first = ex.response.index(data.EOS_ID)
        assert set(ex.response[first:]) == {data.EOS_ID}  # the whole call, then only EOS
    x, real, maskable = batches.tool_calls(2048)
    assert x.shape[0] >= 1 and not (maskable & ~real).any()


def test_long_rows_fill_their_length_with_prose_before_the_request(batches):
    for max_len in (600, 1500):
        x, real, maskable = batches.long_tool_call(max_len)
        assert x.shape[0] == 1 and max_len - 200 <= x.shape[1] <= max_len
        assert maskable.sum() < 300  # the response alone is supervised


@pytest.mark.slow  # a few steps of a real phase on the CPU
def test_the_tools_phase_continues_a_trained_folder_with_longer_positions(tmp_path, monkeypatch):
    from celeris.engine.llm import LLM
    from celeris.engine.training import tools_phase

    monkeypatch.setattr(tools_phase, "load_austen", lambda cache: NOVELS)
    monkeypatch.setattr(tools_phase, "MIN_LONG", 300)
    monkeypatch.setattr(tools_phase, "LONG_EVERY", 2)  # long rows among the few steps
    info = tools_phase.tools_phase(SHIPPED, tmp_path / "out", steps=12, threads=1, tokens=1024, max_len=640,
                                   checkpoint_every=6, log=tmp_path / "log")
    assert info["tools_steps"] == 12 and info["max_sequence_length"] == 640 and info["steps"] == 15000
    assert "tools step 12/12" in (tmp_path / "log").read_text()
    llm = LLM.load(tmp_path / "out")
    assert llm.model.cfg.max_sequence_length == 640
    assert llm.generate_one("What is", gen_length=8, steps=8, block_length=8, seed=0).steps >= 1
