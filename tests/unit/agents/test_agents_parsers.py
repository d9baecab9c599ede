"""Tool-call parsers (engine/agents/parsers.py, issue 43): each family's calls, rendered by a chat
template written in that family's published format, come back out of the text with the same names
and arguments; malformed calls stay content; several calls; the enforcing grammar accepts exactly
the format around valid arguments. Also the tokenizer's tool rendering (engine/tokenizer.py)."""

from __future__ import annotations

import json

import llguidance
import pytest

from celeris.engine.agents import gemma_format
from celeris.engine.agents.parsers import TOOL_PARSERS, detect_tool_parser
from celeris.engine.agents.tools import ToolChoice, parse_tools
from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.structured.constraint import GRAMMAR
from celeris.engine.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer
from tests.unit.agent_schemas import TOOLS
from tests.unit.agent_templates import GEMMA_STYLE, LLADA2_STYLE, QWEN_STYLE

TEMPLATES = {"hermes": QWEN_STYLE, "llada2": LLADA2_STYLE, "gemma": GEMMA_STYLE}
CALLS = [("get_weather", {"city": "Paris {x}", "units": "celsius"}),
         ("create_event", {"title": "a, b: c", "when": {"day": 3, "hour": 0}, "attendees": ["x", "y"]}),
         ("rate", {"score": 0.5, "comment": None}), ("ping", {})]


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM.load(None)


def _tok(tiny: LLM, template: str) -> Tokenizer:
    return Tokenizer(tiny.tokenizer._tok, tiny.model_config, {"chat_template": template})


def _history(calls) -> list[dict]:
    tc = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
          for i, (n, a) in enumerate(calls)]
    return [{"role": "user", "content": "do it"}, {"role": "assistant", "content": None, "tool_calls": tc},
            {"role": "tool", "tool_call_id": "call_0", "name": calls[0][0], "content": "done"}]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_calls_the_template_renders_come_back(tiny, name):
    parser = TOOL_PARSERS[name]
    assert detect_tool_parser(TEMPLATES[name]) == name
    text = _tok(tiny, TEMPLATES[name]).apply_chat_template(_history(CALLS), tools=TOOLS)
    _, calls = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert len({c.id for c in calls}) == len(CALLS)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_own_rendering_round_trips_with_content_around(name):
    parser = TOOL_PARSERS[name]
    text = "Let me check." + "".join("\n" + parser.render(n, a) for n, a in CALLS[:2])
    content, calls = parser.extract(text, names={"get_weather", "create_event"})
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:2]
    assert parser.extract("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_malformed_calls_stay_content(name):
    parser = TOOL_PARSERS[name]
    good = parser.render("ping", {})
    open_, close = ("<|tool_call>call:", "<tool_call|>") if name == "gemma" else ("<tool_call>", "</tool_call>")
    bad = [open_ + "{not json" + close, open_ + '{"name": 3}' + close, open_ + "x{a:}" + close,
           open_ + '{"name": "x", "arguments": [1]}' + close, good[:-3], "<tool_call>\n", "<|tool_call>call:",
           parser.render("unknown_tool", {"a": 1})]
    for b in bad:
        content, calls = parser.extract(b, names={"ping"})
        assert calls == [] and content == b, b
    content, calls = parser.extract(bad[0] + " " + good, names={"ping"})
    assert [c.name for c in calls] == ["ping"] and content == bad[0]


def test_llada2_reads_ling3_argument_pairs():
    text = '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n' \
           '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>'
    content, calls = TOOL_PARSERS["llada2"].extract(text)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Oslo", "days": 3}


def test_gemma_values_round_trip():
    for v in [{"a": "x<|\"|", "b": [1, -2.5, True, None, {"c": "}"}], "e": {}}, {}, {"s": "{,:}"}]:
        assert gemma_format.parse(gemma_format.dump(v)) == v
    for bad in ["{a:1,}", "{a:1", "{1:2}", "{a:<|\"|>x}", "{a:1}}", "{a:tru}", ""]:
        assert gemma_format.parse(bad) is None, bad


def test_detection():
    assert detect_tool_parser(DEFAULT_CHAT_TEMPLATE) == "hermes"
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_tool_parser(None) is None


def _accepts(ll, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    toks = ll.tokenize_str(text)
    return m.try_consume_tokens(toks) == len(toks) and m.is_accepting()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_enforcing_grammar_is_the_format_around_valid_arguments(tiny, name):
    parser = TOOL_PARSERS[name]
    ll = llguidance.LLTokenizer(tiny.tokenizer.to_json(), n_vocab=tiny.tokenizer.vocab_size, eos_token=2)
    tools = parse_tools(TOOLS)
    def compact(fn: str, args: dict) -> str:  # as enforcement writes arguments: tojson's separators
        if name == "gemma":
            return parser.render(fn, args)
        return f'<tool_call>\n{{"name": "{fn}", "arguments": {json.dumps(args)}}}\n</tool_call>'

    one, two = compact("get_weather", {"city": "Oslo"}), compact("rate", {"score": 1})
    required = parser.grammar(tools, ToolChoice("required"), parallel=True)
    assert _accepts(ll, required, one) and _accepts(ll, required, one + parser.separator + two)
    single = parser.grammar(tools, ToolChoice("required"), parallel=False)
    assert _accepts(ll, single, two) and not _accepts(ll, single, one + parser.separator + two)
    named = parser.grammar(tools, ToolChoice("function", "rate"), parallel=True)
    assert _accepts(ll, named, two) and not _accepts(ll, named, one)
    for bad in [{"city": 3}, {"units": "celsius"}, {"city": "x", "units": "kelvin"}]:
        assert not _accepts(ll, required, compact("get_weather", bad)), bad
    assert not _accepts(ll, required, "Sure! " + one)
    if name == "gemma":  # DiffusionGemma writes an empty thinking channel even with thinking off
        assert _accepts(ll, named, "<|channel>thought\n<channel|>" + two)
        assert not _accepts(ll, named, "<|channel>thought\nhmm<channel|>" + two)
    spec = parser.enforced(tools, ToolChoice("function", "rate"), False)
    assert spec.kind == GRAMMAR and spec.field == "tools[13].function.parameters"
    assert parser.enforced(tools, ToolChoice("required"), True).field == "tools"


def test_the_tokenizer_renders_tools_and_tool_turns(tiny):
    tok = tiny.tokenizer
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(plain) == "<|system|>\ns\n<|user|>\nhi\n<|assistant|>\n"  # as before
    text = tok.apply_chat_template(_history(CALLS[:1]), tools=TOOLS[:1])
    assert '"name": "get_weather"' in text and "<tool_response>\ndone\n</tool_response>" in text
    assert [c.name for c in TOOL_PARSERS["hermes"].extract(text)[1]] == ["get_weather"]
    ids = tok.encode_chat(_history(CALLS[:1]), tools=TOOLS[:1])
    assert tok.decode(ids).count("done") == 1
    for messages, tools, field in [
        (_history([("get_weather", {"city": "<|user|>"})]), None, "messages[1].tool_calls"),
        (plain, [{"type": "function", "function": {"name": "x", "description": "<|assistant|>"}}], "tools"),
        ([{"role": "assistant", "content": None}], None, "messages[0]"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            tok.encode_chat(messages, tools=tools)
        assert e.value.violations[0].field == field


def test_a_chat_template_compiles_once_and_a_replaced_one_takes_effect(tiny, monkeypatch):
    """Compiling the template cost ~4 ms a chat request; it is compiled once per template text, and
    a template set after load (--chat-template) is the one rendered."""
    import jinja2.sandbox

    compiled = []
    real = jinja2.sandbox.ImmutableSandboxedEnvironment.from_string
    monkeypatch.setattr(jinja2.sandbox.ImmutableSandboxedEnvironment, "from_string",
                        lambda env, source, *a, **k: compiled.append(source) or real(env, source, *a, **k))
    tok = _tok(tiny, DEFAULT_CHAT_TEMPLATE)
    hi = [{"role": "user", "content": "hi"}]
    first = [tok.apply_chat_template(hi) for _ in range(3)] + [tok.apply_chat_template(hi, tools=TOOLS[:1])]
    assert compiled == [DEFAULT_CHAT_TEMPLATE] and first[0] == first[1] == first[2]
    tok.chat_template = "[{{ messages[0]['content'] }}]"
    assert tok.apply_chat_template(hi) == "[hi]" and len(compiled) == 2
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    assert tok.apply_chat_template(hi) == first[0] and len(compiled) == 2


def test_markers_that_are_special_tokens_are_matched_as_tokens(tiny):
    """Gemma 4's markers are special tokens in its vocabulary: a text literal never matches one,
    so the grammar writes them as token references when given the tokenizer's special markers."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(tiny.tokenizer.to_json())
    hf.add_special_tokens([AddedToken(m, special=True) for m in ("<|tool_call>", "<tool_call|>", '<|"|>')])
    specials = {m: hf.token_to_id(m) for m in ("<|tool_call>", "<tool_call|>", '<|"|>')}
    ll = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=2)
    gemma = TOOL_PARSERS["gemma"]
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["s"], "properties": {"s": {"type": "string"}}}}}])
    text = gemma.render("f", {"s": "hi"})
    ids = hf.encode(text, add_special_tokens=False).ids
    assert specials["<|tool_call>"] in ids  # read as special tokens
    for grammar, ok in [(gemma.grammar(tools, ToolChoice("function", "f"), False, specials), True),
                        (gemma.grammar(tools, ToolChoice("function", "f"), False), False)]:
        m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
        assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) == ok
    assert gemma.extract(text)[1][0].arguments == '{"s": "hi"}'


def test_an_added_marker_that_is_not_special_is_matched_as_its_token(tiny):
    """Qwen's `<tool_call>` is an added token marked special=False: llguidance still deems it special,
    so the hermes grammar references it (Tokenizer.special_markers lists every added token)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(tiny.tokenizer.to_json())
    hf.add_tokens([AddedToken(m, special=False) for m in ("<tool_call>", "</tool_call>")])
    tok = Tokenizer(hf, tiny.model_config, {})
    assert tok.special_markers["<tool_call>"] == hf.token_to_id("<tool_call>") and "<tool_call>" not in tok._markers
    ll = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=2)
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    hermes = TOOL_PARSERS["hermes"]
    ids = hf.encode(hermes.render("f", {}), add_special_tokens=False).ids
    assert ids[0] == hf.token_to_id("<tool_call>")
    grammar = hermes.grammar(tools, ToolChoice("function", "f"), False, tok.special_markers)
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
