"""LLaDA2.2 served from a folder on free ports: what the doors report and refuse, and its edits
shown as revisions in the stream. Tiny random LLaDA2.2 checkpoint (released config keys and
tensor names; its output head favours the edit ids so edits happen)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from celeris_client.client import CelerisClient
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.integration.http_helpers import post
from tests.integration.live_server import live_server
from tests.unit.block_references.llada22 import write_llada22_checkpoint

KNOBS = dict(gen_length=32, seed=3, max_post_steps=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = write_llada22_checkpoint(tmp_path_factory.mktemp("llada22"), seed=3, edit_scale=2.0, num_hidden_layers=2)
    return LLM.load(folder, EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=64, max_gen_length=64))


@pytest.fixture(scope="module")
def live(llm):
    with live_server(llm, warmup=True) as s:  # the real start-up path, warm-up included
        yield s


def test_the_doors_name_the_family_and_its_mode(live, llm):
    with CelerisClient(live.grpc_target) as c:
        info = c.model_info()
    assert (info.architecture, info.family, info.token_editing) == ("llada2.2", "block", True)
    with urllib.request.urlopen(live.http_url + "/v1/models/" + llm.name, timeout=60) as r:
        card = json.loads(r.read())
    assert card["celeris"] == {"architecture": "llada2.2", "family": "block", "token_editing": True, "decoding_modes": []}


@pytest.mark.slow  # a 32-token decode with edits, streamed: seconds under load
@pytest.mark.parametrize("fmt", ["full", "delta"])
def test_edits_stream_as_revisions(live, fmt):
    with CelerisClient(live.grpc_target) as c:
        snaps = list(c.stream([17, 301, 45], stream_format=fmt, **KNOBS))
    assert all(s.revising for s in snaps)
    shown: dict[int, int] = {}
    changed = 0
    for s in snaps:
        for i, t in enumerate(s.tokens):
            if not t.masked:
                changed += i in shown and shown[i] != t.id
                shown[i] = t.id
    assert changed > 0  # a shown token was replaced by a later message
    assert snaps[-1].done and all(t.final for t in snaps[-1].tokens)


def test_a_block_length_of_part_of_a_routing_block_is_refused_by_field(live):
    resp = post(live, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 32, "block_length": 16, "steps": 32})
    body = json.loads(resp.read())
    assert resp.status == 400 and body["error"]["param"] == "block_length"
