"""DiffusionGemma over HTTP with the official openai SDK (issue 62): whole-document schemas
($ref, optional keys, arrays of objects) validate for 20 schemas x 2 seeds, tool_choice "required"
and named return calls (Gemma's format, the `gemma` parsers) whose arguments validate, and a
`choice` with logprobs returns probabilities that sum to 1, each beside other running requests (a
free one that decodes its solo text, a refused one that fails alone).

A tiny random DiffusionGemma checkpoint with celeris-tiny's tokenizer and a Gemma-style chat
template (the tool-call and reasoning parsers are detected from it), CPU.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from tests.integration.live_server import live_server  # noqa: E402
from tests.unit import agent_templates  # noqa: E402
from tests.unit.agent_schemas import FUNCTIONS  # noqa: E402
from tests.unit.document_schemas import DOCUMENT_SCHEMAS  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint  # noqa: E402

KNOBS = {"max_denoising_steps": 3}
# Gemma's call format enforces keys, requiredness, types, enums, anyOf and $ref, not bounds or
# lengths (docs/tools.md): these schemas have none, so an enforced call validates.
GEMMA_TOOLS = {"add": FUNCTIONS["add"], "move": FUNCTIONS["move"], "ping": FUNCTIONS["ping"],
               "pick": {"type": "object", "required": ["c"], "properties": {"c": {"enum": ["red", "blue"]},
                                                                           "n": {"type": ["integer", "null"]}}}}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": p}}
         for n, p in GEMMA_TOOLS.items()]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = write_bpe_checkpoint(tmp_path_factory.mktemp("dg-http"), canvas_length=16)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": agent_templates.GEMMA_STYLE}))
    llm = LLM.load(folder, EngineConfig(max_batch=8, max_queue=64, max_prompt_tokens=768, max_gen_length=128))
    with live_server(llm) as s:
        yield s


def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def _free(c: openai.OpenAI, model: str) -> str:
    return c.completions.create(model=model, prompt="It was", max_tokens=32, seed=4, extra_body=KNOBS
                                | {"ignore_eos": True}).choices[0].text


def _refused(c: openai.OpenAI, model: str) -> str:
    """A schema neither path serves: its request alone gets a 400 naming its path."""
    bad = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    try:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=32,
                                  response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    except openai.BadRequestError as e:
        return e.body["param"]
    return "served"


def _beside(c: openai.OpenAI, model: str, jobs: list) -> tuple[list, str, str]:
    """Run `jobs` (callables) concurrently with a free request and a refused one: (their results,
    the free text, the refused one's param)."""
    with ThreadPoolExecutor(8) as pool:
        free, bad = pool.submit(_free, c, model), pool.submit(_refused, c, model)
        results = [f.result() for f in [pool.submit(job) for job in jobs]]
        return results, free.result(), bad.result()


def _document(c: openai.OpenAI, model: str, name: str, seed: int):
    def job():
        rf = {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": DOCUMENT_SCHEMAS[name]}}
        raw = c.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "JSON please."}], max_tokens=96, seed=seed,
            response_format=rf, extra_body=KNOBS)
        r = raw.parse()
        return raw.headers["x-celeris-structure-path"], r.choices[0].message.content, r.choices[0].finish_reason
    return job


@pytest.mark.slow  # 40 documents beside other requests: a minute or more on 2 loaded cores
def test_twenty_document_schemas_two_seeds_validate_beside_other_requests(live):
    c = sdk(live)
    model = _model(c)
    solo = _free(c, model)
    jobs = [(n, seed) for n in DOCUMENT_SCHEMAS for seed in (0, 1)]
    results, free, bad = _beside(c, model, [_document(c, model, n, seed) for n, seed in jobs])
    invalid = []
    for (name, seed), (path, text, finish) in zip(jobs, results):
        assert path == "document" and finish == "stop", (name, text)
        try:
            jsonschema.validate(json.loads(text), DOCUMENT_SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError):
            invalid.append((name, seed, text))
    assert invalid == [] and len(results) == 40
    assert free == solo and bad == "response_format.json_schema.schema.properties.n.not"


def _call(c: openai.OpenAI, model: str, choice, seed: int):
    def job():
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Use a tool."}],
                                      tools=TOOLS, tool_choice=choice, max_tokens=96, seed=seed, extra_body=KNOBS)
        return r.choices[0].finish_reason, [(t.function.name, t.function.arguments)
                                            for t in r.choices[0].message.tool_calls or []]
    return job


def test_required_and_named_tool_calls_validate_beside_other_requests(live):
    c = sdk(live)
    model = _model(c)
    solo = _free(c, model)
    asks = [({"type": "function", "function": {"name": n}}, n) for n in GEMMA_TOOLS] + [("required", None)] * 2
    results, free, bad = _beside(c, model, [_call(c, model, choice, seed) for seed, (choice, _) in enumerate(asks)])
    for (choice, name), (finish, calls) in zip(asks, results):
        assert finish == "tool_calls" and calls, (choice, calls)
        for called, arguments in calls:
            assert name is None or called == name
            jsonschema.validate(json.loads(arguments), GEMMA_TOOLS[called])
    assert free == solo and bad.endswith(".not")


def test_a_choice_with_logprobs_returns_probabilities_that_sum_to_one(live):
    c = sdk(live)
    model = _model(c)
    options = ["yes", "no", "maybe"]

    def job(seed):
        return lambda: c.completions.create(model=model, prompt="Well?", max_tokens=16, seed=seed, logprobs=0,
                                            extra_body=KNOBS | {"structured_outputs": {"choice": options}})
    solo = _free(c, model)
    results, free, bad = _beside(c, model, [job(s) for s in range(3)])
    for r in results:
        probs = r.choices[0].model_extra["choice_probabilities"]
        assert list(probs) == options and abs(sum(probs.values()) - 1) < 1e-9
        assert r.choices[0].text in options
    assert free == solo and bad.endswith(".not")
