"""The HTTP gateway's diffusing stream: delta events rebuild the full events step by step."""

from __future__ import annotations

import pytest

from tests.integration.live_server import live_server
from tests.integration.http_helpers import PROMPT, post, sse_events


@pytest.fixture(scope="module")
def live(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s


def replay(events: list) -> list[dict]:
    """Each delta event of each choice as the full event's (text, cells, counters) would be."""
    state: dict[int, dict] = {}
    out = []
    for e in events:
        c, choice = e["celeris"], e["choices"][0]
        k = choice["index"]
        assert c["format"] == "delta"
        if "layout" in c:
            lay = c["layout"]
            blank = {"text": lay["mask_text"], "piece": lay["mask_text"], "masked": True, "final": False}
            state[k] = {"cells": [dict(blank) for _ in range(lay["gen_length"])], "echo": lay["echo"]}
        if c["done"]:  # a whole snapshot
            out.append({"index": k, "text": text_of(choice), "tokens": c["tokens"], "step": c["step"],
                        "masked": c["masked"]})
            continue
        s = state[k]
        for u in c["updates"]:
            s["cells"][u["i"]] = {"text": u["text"], "piece": u.get("piece", u["text"]), "masked": u["masked"],
                                  "final": u["final"]}
        new, vis = set(c["new"]), c["visible"]
        cells = [{"text": x["text"], "new": i in new,
                  "state": "masked" if x["masked"] else "stop" if i >= vis else "token", "final": x["final"]}
                 for i, x in enumerate(s["cells"])]
        assert text_of(choice) == ""  # the usual text field stays empty in delta events
        out.append({"index": k, "text": s["echo"] + "".join(x["piece"] for x in s["cells"][:vis]), "tokens": cells,
                    "step": c["step"], "masked": c["masked"]})
    return out


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["delta"]["content"]


def full_view(events: list) -> list[dict]:
    return [{"index": e["choices"][0]["index"], "text": text_of(e["choices"][0]), "tokens": e["celeris"]["tokens"],
             "step": e["celeris"]["step"], "masked": e["celeris"]["masked"]} for e in events]


def by_index(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["index"], []).append(r)
    return out


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "echo": True}),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [7, 9, 11]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say something."}]}),
])
def test_sse_delta_events_rebuild_the_full_events(live, path, extra):
    base = {"max_tokens": 32, "steps": 16, "block_length": 8, "seed": 6, "temperature": 0.8, "stream": True} | extra
    full = sse_events(post(live, path, base | {"diffusing": "full"}))
    delta = sse_events(post(live, path, base | {"diffusing": True}))
    assert full[-1] == delta[-1] == "[DONE]"
    full, delta = full[:-1], delta[:-1]
    assert len(full) == len(delta) >= 2 and all(e["celeris"]["replace"] for e in full)
    assert by_index(replay(delta)) == by_index(full_view(full))
    assert [e["usage"] for e in delta if "usage" in e] == [e["usage"] for e in full if "usage" in e]
    assert sum(len(str(e)) for e in delta) < 0.5 * sum(len(str(e)) for e in full)


def test_diffusing_delta_is_the_default_and_full_stays_available(live):
    body = {"prompt": PROMPT, "max_tokens": 16, "steps": 8, "seed": 1, "stream": True}
    for value, fmt in ((True, "delta"), ("delta", "delta")):
        first = sse_events(post(live, "/v1/completions", body | {"diffusing": value}))[0]["celeris"]
        assert first["format"] == fmt and first["layout"]["gen_length"] == 16 and "tokens" not in first
    first = sse_events(post(live, "/v1/completions", body | {"diffusing": "full"}))[0]["celeris"]
    assert "format" not in first and len(first["tokens"]) == 16
    resp = post(live, "/v1/completions", body | {"diffusing": "sparse"})
    assert resp.status == 400


def test_provisional_predictions_ride_on_delta_events_and_change_nothing(live, tiny_llm):
    base = {"prompt": PROMPT, "max_tokens": 32, "steps": 16, "block_length": 8, "seed": 6, "temperature": 0.8,
            "stream": True, "diffusing": True}
    plain = sse_events(post(live, "/v1/completions", base))[:-1]
    guessed = sse_events(post(live, "/v1/completions", base | {"provisional": True}))[:-1]
    assert not any("provisional" in e["celeris"] for e in plain)
    rows = replay(guessed)
    assert rows == replay(plain)  # the same stream, predictions aside
    shown, mask = 0, tiny_llm.tokenizer.token_text(tiny_llm.tokenizer.mask_id)
    for e, row in zip(guessed, rows):
        c = e["celeris"]
        if c["done"]:
            assert "provisional" not in c
            continue
        block = range(c["block"] * 8, c["block"] * 8 + 8)
        assert [g["i"] for g in c["provisional"]] == [i for i in block if row["tokens"][i]["state"] == "masked"]
        assert all(0 < g["confidence"] <= 1 and g["text"] != mask for g in c["provisional"])
        shown += len(c["provisional"])
    assert shown > 0


@pytest.mark.parametrize("extra,why", [({"diffusing": "full"}, "needs diffusing"), ({}, "needs diffusing"),
                                       ({"provisional": "yes", "diffusing": True}, "must be a boolean")])
def test_provisional_is_refused_without_delta_events(live, extra, why):
    body = {"prompt": PROMPT, "max_tokens": 16, "stream": True, "provisional": True} | extra
    resp = post(live, "/v1/completions", body)
    assert resp.status == 400
    err = __import__("json").loads(resp.read())["error"]
    assert err["param"] == "provisional" and why in err["message"]
