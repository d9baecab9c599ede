"""Terminal view, progress bar and batch input parsing, without a server."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from celeris_client.batch import done_ids, parse_line, read_items
from celeris_client.progress import Progress, percentile
from celeris_client.types import Snapshot, Token, Usage
from celeris_client.view import GUESS, HIGHLIGHT, MASK, LiveView, render_canvas, rows, sanitize


def snapshot(cells, done=False, step=1, usage=None) -> Snapshot:
    """cells: (text, masked, new) per position."""
    tokens = tuple(Token(i + 10, t, m, n, 0.5 if n else 0.0) for i, (t, m, n) in enumerate(cells))
    text = "".join(MASK if m else t for t, m, _ in cells)
    return Snapshot("r", step, 4, 0, 2, text, tokens, tuple(i for i, c in enumerate(cells) if c[2]), (), done,
                    "stop" if done else None, usage, 7 if done else None, 0.1 if done else None)


def test_render_canvas_masks_highlights_and_stops_at_eos():
    s = snapshot([("He", False, False), ("llo", False, True), ("", True, False), ("<|eos|>", False, True),
                  ("zz", False, False)])
    styled, plain = render_canvas(s)
    assert plain == "Hello" + MASK  # cut at the end-of-turn token
    assert f"{HIGHLIGHT}llo" in styled and "\x1b[2;37m" + MASK in styled
    _, plain = render_canvas(snapshot([("a", False, False), ("b", False, False)]), stop_ids=frozenset({11}))
    assert plain == "a"


def test_render_canvas_shows_provisional_predictions_in_place_of_masks():
    s = snapshot([("He", False, False), ("", True, False), ("", True, False)])
    s = dataclasses.replace(s, provisional=((1, Token(42, "llo\x1b", False, False, 0.3)),))
    styled, plain = render_canvas(s)
    assert plain == "Hello\ufffd" + MASK  # the guess is sanitized; an unpredicted mask stays a mask
    assert f"{GUESS}llo\ufffd" in styled and "\x1b[2;37m" + MASK in styled
    assert render_canvas(s, color=False)[0] == plain


def test_sanitize_blocks_terminal_escapes():
    assert sanitize("ok\x1b[2Jx\ny\t") == "ok\ufffd[2Jx\ny\t"


def test_rows_counts_wrapping_and_wide_characters():
    assert rows("abc", 10) == 1
    assert rows("a" * 25, 10) == 3
    assert rows("x\n\ny", 10) == 3
    assert rows("界" * 6, 10) == 2  # wide characters take two columns


def test_live_view_redraws_in_place():
    out = io.StringIO()
    view = LiveView(out, columns=200)
    view.draw(snapshot([("a", False, True), ("", True, False)], step=1))
    view.draw(snapshot([("a", False, False), ("b", False, True)], step=2))
    view.draw(snapshot([("a", False, False), ("b", False, False)], done=True, step=2, usage=Usage(3, 2, 2)))
    view.close()
    text = out.getvalue()
    assert "step 1/4 · block 1/2" in text and "step 2/4" in text
    assert text.count("\r\x1b[1A\x1b[J") == 2  # two redraws, each over a two-row frame
    assert "stop · 2 tokens · 2 steps" in text and text.endswith("\x1b[?25h")
    narrow = LiveView(io.StringIO(), columns=20)
    narrow.draw(snapshot([("a", False, True)], step=1))
    assert narrow._rows >= 3  # the canvas row plus a status line wrapped over 20 columns


def test_percentile_and_progress_line():
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    now = [0.0]
    p = Progress(4, out=io.StringIO(), clock=lambda: now[0])
    now[0] = 2.0
    p.update(True)
    p.update(False)
    line = p.line()
    assert "2/4" in line and "1.00/s" in line and "ETA 2.00 s" in line and "1 failed" in line


def test_parse_line_accepts_inputs_and_knobs():
    item = parse_line(json.dumps({"id": 3, "prompt": "hi", "steps": 4, "metadata": {"k": 1}}), {"steps": 8, "seed": 1})
    assert item.id == "3" and item.prompt == "hi" and item.knobs == {"steps": 4, "seed": 1}
    assert item.metadata == {"k": 1}
    assert parse_line('{"messages": [{"role": "user", "content": "x"}]}', {}).prompt[0]["role"] == "user"
    assert parse_line('{"token_ids": [1, 2]}', {}).prompt == [1, 2]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = parse_line(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                  "tool_choice": "required", "parallel_tool_calls": False}), {})
    assert chat.knobs == {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    with pytest.raises(ValueError, match="need \"messages\""):
        parse_line(json.dumps({"prompt": "x", "tools": tools}), {})
    with pytest.raises(ValueError, match="tool_choice"):  # checked as the client would build it
        parse_line(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": 3}), {})


@pytest.mark.parametrize("line, why", [
    ("{oops", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"id": 1}', "exactly one of"),
    ('{"prompt": "a", "messages": []}', "exactly one of"),
    ('{"prompt": "a", "stepz": 2}', "unknown field"),
    ('{"prompt": "a", "remasking": "best"}', "remasking"),
    ('{"prompt": "a", "steps": -1}', "-1"),
    ('{"prompt": "a", "id": [1]}', "id must be"),
])
def test_parse_line_rejects_bad_lines(line, why):
    with pytest.raises(ValueError, match=why):
        parse_line(line, {})


def test_read_items_reports_bad_and_duplicate_lines(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n\n{bad\n{"id": "a", "prompt": "y"}\n{"prompt": "z"}\n')
    err = io.StringIO()
    items, bad = read_items(src, {}, err)
    assert [i.id for i in items] == ["a", "line-5"] and bad == 2
    assert "in.jsonl:3: skipped: not valid JSON" in err.getvalue() and "duplicate id 'a'" in err.getvalue()


def test_done_ids_ignores_failures_and_torn_lines(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "status": "ok"}\n{"id": "b", "status": "error"}\n{"id": "c", "sta')
    assert done_ids(out) == {"a"}
    assert done_ids(tmp_path / "missing.jsonl") == set()


def test_render_canvas_marks_a_revising_models_cells():
    """Unmasked cells that may still change are underlined, a cell this snapshot replaced is in
    reverse video, final cells are plain; a mask model's snapshot has none of these marks."""
    from celeris_client.view import MAYCHANGE, REVISED, status_line

    tokens = (Token(10, "a", False, False, 0.0, final=True), Token(11, "b", False, True, 0.9),
              Token(12, "c", False, True, 0.9), Token(13, MASK, True, False, 0.0))
    s = Snapshot("r", 2, 8, 0, 2, "abc" + MASK, tokens, (1, 2), (0.9, 0.9), False, final_positions=1,
                 revised=(2,), revising=True)
    styled, plain = render_canvas(s)
    assert plain == "abc" + MASK
    assert styled.startswith("a") and f"{MAYCHANGE}b" in styled and f"{REVISED}c" in styled
    assert "2 may change · 1 revised" in status_line(s, 1.0)
    mask_model = dataclasses.replace(s, revising=False, revised=())
    styled, _ = render_canvas(mask_model)
    assert MAYCHANGE not in styled and REVISED not in styled and "may change" not in status_line(mask_model, 1.0)
