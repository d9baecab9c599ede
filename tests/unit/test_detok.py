"""The incremental detokenizer: pieces of a canvas, commit by commit, always join to `render`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from celeris.engine.detok import IncrementalDetokenizer
from celeris.engine.tokenizer import stop_cut
from celeris.engine.tokenizer import MASK_MARKER, Tokenizer
from celeris.engine.training import data
from tests.helpers import tiny_config

TINY = Path(__file__).resolve().parents[2] / "engine" / "training" / "celeris-tiny"
MULTIBYTE = ["日本語のテキストです。", "Grüße aus Köln, café crème", "emoji 🙂🚀 and ∑∫ maths", "naïve façade",
             "中文字符和标点，还有更多。"] * 3 + ["plain english words for merges"] * 3


def embedded() -> Tokenizer:
    cfg = json.loads((TINY / "config.json").read_text())
    conf = tiny_config(vocab_size=cfg["vocab_size"], embedding_size=cfg["vocab_size"], mask_token_id=cfg["mask_token_id"], eos_token_id=cfg["eos_token_id"])
    return Tokenizer.from_dir(TINY, conf)


def multibyte() -> Tokenizer:
    """Byte-level BPE with a small vocabulary: most non-ASCII characters stay split over byte tokens."""
    hf = data.train_tokenizer(MULTIBYTE, vocab_size=280)
    return Tokenizer(hf, tiny_config(vocab_size=hf.get_vocab_size(), embedding_size=hf.get_vocab_size()),
                     {"eos_token": "<|eos|>", "pad_token": "<|pad|>", "bos_token": "<|bos|>"})


def wordpiece() -> Tokenizer:
    """A WordPiece decoder ("##" joins, spaces between words): left context changes pieces too."""
    vocab = {t: i for i, t in enumerate(["<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>", "[UNK]", "hel", "##lo", "world",
                                         "##s", ",", "a", "##b"])}
    hf = HFTokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in list(vocab.items())[:4]],
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}}))
    return Tokenizer(hf, tiny_config(vocab_size=len(vocab), embedding_size=len(vocab)), {})


def replay(tok: Tokenizer, target: list[int], rng: random.Random, max_per_step: int = 3) -> None:
    """Commit `target` in a random order, a few positions per step, checking every step."""
    n = len(target)
    canvas = [tok.mask_id] * n
    detok = IncrementalDetokenizer(tok, n)
    order = list(range(n))
    rng.shuffle(order)
    while order:
        step, order = order[:rng.randint(1, max_per_step)], order
        order = order[len(step):]
        for p in step:
            canvas[p] = target[p]
        visible = stop_cut(canvas, tok.stop_ids)
        before = list(detok.pieces)
        changed = detok.update(canvas, step, visible)
        assert detok.text() == tok.render(canvas[:visible])
        assert detok.ids == canvas
        assert set(changed) == {i for i in range(n) if before[i] != detok.pieces[i]} | set(step)
        assert changed == sorted(changed)
        fresh = IncrementalDetokenizer(tok, n)
        fresh.update(canvas, range(n), visible)
        assert fresh.pieces == detok.pieces  # incremental == from scratch
        assert detok.masked == canvas.count(tok.mask_id)


@pytest.mark.parametrize("make", [embedded, multibyte, wordpiece])
def test_pieces_join_to_render_commit_by_commit(make):
    tok = make()
    rng = random.Random(0)
    texts = MULTIBYTE + ["It is a truth universally acknowledged", "12+34=46 don't stop"]
    for k in range(30):
        ids = tok.encode(rng.choice(texts) + " " + rng.choice(texts))
        ids = [i for i in ids if i != tok.mask_id][:rng.randint(4, 40)]
        if k % 5 == 0 and len(ids) > 3:  # a stop token inside: the text ends before it
            ids[rng.randrange(len(ids))] = tok.eos_id
        replay(tok, ids, rng)


@pytest.mark.parametrize("make", [embedded, multibyte])
def test_random_byte_tokens_invalid_utf8_included(make):
    """What a random model writes: any ids in any order, runs of invalid and unfinished bytes."""
    tok = make()
    rng = random.Random(1)
    ids = [i for i in range(tok.vocab_size) if i != tok.mask_id]
    for _ in range(20):
        replay(tok, [rng.choice(ids) for _ in range(rng.randint(8, 64))], rng, max_per_step=2)
    # Long runs of lone bytes (each decodes to U+FFFD alone) and of special tokens between them.
    loose = [i for i in ids if tok.token_text(i) == "\ufffd"]
    quiet = sorted(tok.special_ids - tok.stop_ids - {tok.mask_id})
    assert loose and quiet
    for _ in range(20):
        replay(tok, [rng.choice(loose if rng.random() < 0.6 else quiet) for _ in range(rng.randint(16, 64))], rng)


def test_multibyte_tokenizer_really_splits_characters():
    tok = multibyte()
    ids = tok.encode("日本語")
    assert len(ids) > 3 and any(tok.token_text(i) == "\ufffd" for i in ids)
    detok = IncrementalDetokenizer(tok, len(ids))
    detok.update(ids, range(len(ids)), len(ids))
    assert "".join(detok.pieces) == "日本語" and "\ufffd" not in "".join(detok.pieces)


def test_a_commit_that_changes_a_neighbours_left_context_reports_it():
    tok = multibyte()
    ids = tok.encode("é")  # two byte tokens: the first piece alone is an unfinished character
    assert len(ids) == 2
    detok = IncrementalDetokenizer(tok, 3)
    assert detok.update([ids[0], tok.mask_id, tok.mask_id], [0], 3) == [0]
    assert detok.pieces[0] == "\ufffd"  # the end of its run: shown as render shows it
    assert detok.update([ids[0], ids[1], tok.mask_id], [1], 3) == [0, 1]  # 0 now holds its byte back
    assert detok.pieces[:2] == ["", "é"] and detok.text() == "é" + MASK_MARKER


def test_wordpiece_continuations_join_their_left_neighbour():
    tok = wordpiece()
    hel, lo, world = (tok._tok.token_to_id(t) for t in ("hel", "##lo", "world"))
    detok = IncrementalDetokenizer(tok, 3)
    detok.update([tok.mask_id, lo, world], [1, 2], 3)
    assert detok.pieces == [MASK_MARKER, "##lo", " world"]  # as render shows a run starting with "##lo"
    assert detok.text() == tok.render([tok.mask_id, lo, world])
    assert detok.update([hel, lo, world], [0], 3) == [0, 1]
    assert detok.text() == "hello world" == tok.render([hel, lo, world])


def _event(canvas: list[int], committed: tuple[int, ...], settled: int, revising: bool, finished: bool = False):
    from celeris.engine.events import StepEvent

    return StepEvent(request_id="r", step=0, total_steps=4, block=0, num_blocks=2, canvas=tuple(canvas),
                     committed=committed, confidences=(0.5,) * len(committed), generated=(), visible=len(canvas),
                     settled=settled, steps=1, forward_passes=1, seed=0, prompt_tokens=1, finished=finished,
                     revising=revising)


@pytest.mark.parametrize("revising", [False, True])
def test_canvas_delta_reports_cells_made_final_once_in_every_family(revising):
    """A cell goes out when its id or piece changes, or when it becomes final unchanged: a revising
    model's settled cells (final only below `settled`), never a mask model's (final once committed)."""
    from celeris.engine.detok import CanvasDeltas

    tok = embedded()
    ids = tok.encode("hello world")[-4:]
    deltas, mask = CanvasDeltas(tok, 4), tok.mask_id
    first = deltas.delta(_event([ids[0], ids[1], mask, mask], (0, 1), 0, revising), {0: 0.5, 1: 0.25})
    assert [c.position for c in first.cells] == [0, 1] and first.committed == (0, 1)
    assert first.confidences == (0.5, 0.25) and first.masked == 2
    assert [c.final for c in first.cells] == [not revising] * 2
    # Block 0 settles with no id changed; block 1 gets its first commit.
    second = deltas.delta(_event([ids[0], ids[1], ids[2], mask], (2,), 2, revising), {2: 0.5})
    assert [c.position for c in second.cells] == ([0, 1, 2] if revising else [2])
    assert all(c.final for c in second.cells if c.position < 2) and second.settled == 2
    assert deltas.delta(_event(ids, (3,), 4, revising, finished=True), {3: 0.5}) is None  # sent whole
