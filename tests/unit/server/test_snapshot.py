"""Whole-canvas messages (`convert.snapshot`: full-format streams, and every stream's last
message): each position's token as the canvas holds it, built in place, with fields at their
proto3 defaults left unset; and the tokenizer's per-id text cache they read."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.loop.sim_runner import simulate
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.tokenizer import MASK_MARKER
from celeris.server.grpc import convert


@pytest.fixture(scope="module")
def llm():
    llm = LLM.load(None, EngineConfig(max_batch=2))
    simulate(llm, 0.0)
    return llm


def _events(llm, gen_length=64, block_length=16):
    seq = llm.request("Once upon a time", SamplingParams(gen_length=gen_length, steps=gen_length,
                                                        block_length=block_length, seed=0))
    llm.loop.add(seq)
    events = []
    while not llm.loop.idle:
        events += llm.loop.step()[0]
    return events


def _check(msg, ev, tok, committed):
    assert len(msg.tokens) == len(ev.canvas)
    for i, (t, got) in enumerate(zip(ev.canvas, msg.tokens)):
        masked = t == tok.mask_id
        assert got.id == t and got.masked == masked
        assert got.text == (MASK_MARKER if masked else tok._tok.decode([t], skip_special_tokens=False))
        assert got.committed_this_step == (i in committed)
        assert got.confidence == pytest.approx(committed.get(i, 0.0), rel=1e-6)  # a float field
        assert got.final == ev.is_final(i, tok.mask_id)
        assert not got.HasField("logprob") and not got.top_logprobs


def test_snapshots_carry_every_position_as_the_canvas_holds_it(llm):
    tok = llm.tokenizer
    events = _events(llm)
    middle, last = events[len(events) // 2], events[-1]
    assert not middle.finished and tok.mask_id in middle.canvas and last.finished
    assert middle.committed
    for ev, committed in ((middle, {p: 0.25 + 0.5 * (p % 2) for p in middle.committed}),
                          (last, {len(last.canvas) - 1: 0.875})):
        msg = convert.snapshot(ev, tok, committed)
        _check(msg, ev, tok, committed)
        assert list(msg.committed_positions) == sorted(committed)
        assert msg.done == ev.finished
    # the message round-trips: unset defaults read back as the values the fields mean
    again = type(msg).FromString(msg.SerializeToString())
    assert again == msg


def test_token_text_is_decoded_once_per_id_and_the_cache_stays_within_the_vocabulary(llm):
    tok = llm.tokenizer
    ids = [5, 17, 300, 5, 17]
    texts = [tok.token_text(i) for i in ids]
    assert texts == [tok._tok.decode([i], skip_special_tokens=False) for i in ids]
    assert tok.token_text(tok.mask_id) == MASK_MARKER
    for bad in (-1, tok.vocab_size, tok.vocab_size + 10 ** 6):  # out of range: answered as before, never kept
        try:
            tok.token_text(bad)
        except Exception:  # the tokenizer's own error for an id it does not have
            pass
        assert bad not in tok._texts
    for other in (torch.tensor(17), torch.tensor([300])[0]):  # ids that are not Python ints: never kept
        tok.token_text(other)
    assert all(type(k) is int for k in tok._texts)
    assert set(tok._texts) <= set(range(tok.vocab_size))
