"""The whole-document path on DiffusionGemma (issue 62): schemas outside the skeleton's subset
($ref, optional keys, arrays of objects, anyOf, type lists) decode valid on a revising model, whose
canvases are denoised free and committed by one constrained pass left to right (revise/slots.py,
docs/structured-outputs.md "Revising models"); a document row decodes the same alone as beside free
rows and other structured rows, which decode as without it; a document row whose structure fails
ends alone.

A tiny random DiffusionGemma checkpoint written by transformers' classes with celeris-tiny's
byte-level BPE tokenizer, CPU, float32, one thread.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.errors import InvalidRequest  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.events import FinishReason  # noqa: E402
from celeris.engine.requests import Request  # noqa: E402
from celeris.engine.structured.constraint import Structured  # noqa: E402
from tests.unit.document_schemas import DOCUMENT_SCHEMAS  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint  # noqa: E402
from tests.unit.structured.test_structured_document import DOCUMENTS, SKELETON  # noqa: E402

CANVAS = 16


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = write_bpe_checkpoint(tmp_path_factory.mktemp("dg-documents"), canvas_length=CANVAS)
    yield LLM.load(folder, EngineConfig(max_batch=8, max_queue=64, max_prompt_tokens=64, max_gen_length=128))
    torch.set_num_threads(threads)


def _params(llm: LLM, seed: int, n: int = 64):
    return replace(llm.defaults, gen_length=n, block_length=n, steps=1, seed=seed, max_denoising_steps=3)


def _doc(llm: LLM, schema: object, seed: int, n: int = 64, field: str = "rf.schema"):
    return llm.build(Request(prompt="JSON:", params=_params(llm, seed, n), structured=Structured("json_schema", schema,
                                                                                                field)))


def _free(llm: LLM, seed: int):
    return llm.build(Request(prompt="It was", params=replace(_params(llm, seed, 2 * CANVAS), ignore_eos=True)))


def _valid(text: str, schema: object) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_document_schemas_decode_valid_in_one_batch(llm):
    seqs = [_doc(llm, schema, seed) for schema in DOCUMENTS.values() for seed in (0, 1)]
    assert all(s.constraint.layout.path == "document" for s in seqs)
    outs = llm.run(seqs)
    bad = [(name, o.text) for name, o in zip([n for n in DOCUMENTS for _ in (0, 1)], outs)
           if not _valid(o.text, DOCUMENTS[name])]
    assert bad == []
    assert all(o.finish_reason == FinishReason.STOP for o in outs)


@pytest.mark.slow  # 40 documents of up to 96 tokens: about a minute on 2 loaded cores
def test_twenty_schemas_two_seeds_validate(llm):
    names = [n for n in DOCUMENT_SCHEMAS for _ in (0, 1)]
    seqs = [_doc(llm, DOCUMENT_SCHEMAS[n], k % 2, 96) for k, n in enumerate(names)]
    assert all(s.constraint.layout.path == "document" for s in seqs)
    outs = llm.run(seqs)
    assert [(n, o.text) for n, o in zip(names, outs) if not _valid(o.text, DOCUMENT_SCHEMAS[n])] == []


def test_a_document_row_decodes_alone_as_beside_free_and_skeleton_rows(llm):
    schema = DOCUMENT_SCHEMAS["rows_of_pets"]
    alone = llm.run([_doc(llm, schema, 5)])[0]
    free = llm.run([_free(llm, 6)])[0]
    skeleton = llm.run([_doc(llm, SKELETON, 7, 32)])[0]
    mixed = llm.run([_free(llm, 6), _doc(llm, schema, 5), _doc(llm, SKELETON, 7, 32)])
    assert mixed[1].token_ids == alone.token_ids and _valid(alone.text, schema)
    assert mixed[0].token_ids == free.token_ids
    assert mixed[2].token_ids == skeleton.token_ids


def test_a_failing_document_row_ends_alone(llm):
    """Its matcher raises when its canvas commits: it ends with its own field's error, the free and
    document rows beside it decode as without it."""
    alone = llm.run([_free(llm, 3), _doc(llm, DOCUMENT_SCHEMAS["ref_pet"], 4)])
    bad = _doc(llm, DOCUMENT_SCHEMAS["optional_one"], 9, field="bad.schema")

    def fill(pos, words):
        raise RuntimeError("secret")
    bad.constraint.fill = fill
    mixed = llm.run([_free(llm, 3), bad, _doc(llm, DOCUMENT_SCHEMAS["ref_pet"], 4)])
    failed = mixed.pop(1)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
    assert isinstance(failed.error, InvalidRequest) and failed.error.violations[0].field == "bad.schema"
    assert "secret" not in str(failed.error)
    assert llm.runner.rows == {}


def test_a_document_longer_than_a_canvas_spans_canvases(llm):
    """The closing holds across canvases: a 16-token canvas, documents that need several, each ended
    in time by the stop id (never cut by max_tokens)."""
    schema = {"type": "object", "required": ["name", "tags"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "minLength": 20, "maxLength": 30},
        "tags": {"type": "array", "minItems": 2, "items": {"type": "string", "minLength": 3}}}}
    outs = llm.run([_doc(llm, schema, seed, 64) for seed in range(3)])
    assert all(_valid(o.text, schema) and o.finish_reason == FinishReason.STOP for o in outs)
    assert all(len(o.token_ids) > CANVAS for o in outs)
