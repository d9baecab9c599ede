"""The web page at `/`, in a real headless Chromium: the canvas must visibly refine.

Chromium comes from Debian (scripts/setup.sh installs `chromium chromium-driver` when missing).
The browser test skips only where Chromium cannot be had; under CI it fails instead, so a
missing install can never pass silently.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.integration.live_server import live_server
from tests.integration.browser import browser, fill, live  # noqa: F401  (fixtures)

# Installed before clicking: records the canvas after every DOM change the page makes.
OBSERVE = """
window.seen = [];
const canvas = document.getElementById('canvas');
new MutationObserver(() => window.seen.push({
  masked: canvas.querySelectorAll('.tok.masked').length,
  fresh: canvas.querySelectorAll('.tok.new').length,
  text: canvas.textContent,
})).observe(canvas, {childList: true});
"""


def test_page_is_served_without_a_token(tiny_llm):
    with live_server(tiny_llm, api_token="s3cret") as s:
        resp = urllib.request.urlopen(s.http_url + "/")
        page = resp.read().decode()
    assert resp.headers["Content-Type"].startswith("text/html")
    assert 'id="canvas"' in page and "/v1/completions" in page and "diffusing: true" in page


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_browser_shows_the_canvas_refining(live, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(live.http_url + "/")
    WebDriverWait(browser, 30).until(lambda d: "model" in d.find_element("id", "model").text)
    browser.find_element("xpath", "//input[@value='completion']/..").click()  # the segmented control's label
    fill(browser, "prompt", "It is a truth universally")
    for field, value in (("max_tokens", "32"), ("steps", "16"), ("block_length", "16"), ("seed", "7")):
        fill(browser, field, value)
    browser.execute_script(OBSERVE)
    browser.find_element("id", "go").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                     in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    seen = browser.execute_script("return window.seen")
    frames = browser.execute_script("return window.celerisFrames")

    # Intermediate snapshots with masked positions were on screen before the final text.
    assert len(seen) == len(frames) >= 3
    assert seen[0]["masked"] > 0 and seen[0]["fresh"] > 0
    assert [f["masked"] for f in seen] == sorted((f["masked"] for f in seen), reverse=True)
    assert seen[-1]["masked"] == 0 and "\u2592" in seen[0]["text"] and "\u2592" not in seen[-1]["text"]
    assert [f["step"] for f in frames] == list(range(1, len(frames) + 1)) and frames[-1]["done"]
    assert {f["format"] for f in frames} == {"delta"}  # rebuilt from delta events, the gateway's default

    body = {"prompt": "It is a truth universally", "max_tokens": 32, "steps": 16, "block_length": 16, "seed": 7}
    req = urllib.request.Request(live.http_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    final = json.loads(urllib.request.urlopen(req).read())
    assert seen[-1]["text"] == final["choices"][0]["text"]  # the page ends on the final text
    tokens = final["usage"]["completion_tokens"]
    stats = browser.find_element("id", "final").text
    assert f"{tokens} tokens" in stats and "finished:" in stats and "seed 7" in stats
    assert browser.find_element("id", "step").text == f"{frames[-1]['step']}/16"


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_browser_shows_the_models_guesses_in_masked_cells(live, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(live.http_url + "/")
    WebDriverWait(browser, 30).until(lambda d: "model" in d.find_element("id", "model").text)
    browser.find_element("xpath", "//input[@value='completion']/..").click()
    fill(browser, "prompt", "It is a truth universally")
    for field, value in (("max_tokens", "32"), ("steps", "16"), ("block_length", "16"), ("seed", "7")):
        fill(browser, field, value)
    browser.find_element("id", "provisional").click()
    browser.find_element("id", "go").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                     in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    frames = browser.execute_script("return window.celerisFrames")
    # While a block decodes, every mask left in it shows a guess (later blocks stay blocks).
    assert frames[0]["guesses"] > 0 and frames[0]["masked"] > frames[0]["guesses"]
    assert all(f["guesses"] <= f["masked"] for f in frames) and frames[-1]["guesses"] == 0
    body = {"prompt": "It is a truth universally", "max_tokens": 32, "steps": 16, "block_length": 16, "seed": 7}
    req = urllib.request.Request(live.http_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    assert frames[-1]["text"] == json.loads(urllib.request.urlopen(req).read())["choices"][0]["text"]


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_browser_reproduces_a_seed_past_2_53(live, browser):
    """A seed JavaScript cannot hold as a number: the page sends and shows it as a string, and the
    run matches the server's for that exact seed."""
    from selenium.webdriver.support.ui import WebDriverWait

    seed = "9007199254740993"  # 2^53 + 1: as a JavaScript number it would become ...992
    browser.get(live.http_url + "/")
    WebDriverWait(browser, 30).until(lambda d: "model" in d.find_element("id", "model").text)
    browser.find_element("xpath", "//input[@value='completion']/..").click()
    fill(browser, "prompt", "It is a truth universally")
    for field, value in (("max_tokens", "16"), ("steps", "8"), ("block_length", "8"), ("temperature", "1"),
                         ("frequency_penalty", "0.5"), ("seed", seed)):
        fill(browser, field, value)
    browser.find_element("id", "go").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                     in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    assert f"seed {seed}" in browser.find_element("id", "final").text
    assert browser.execute_script("return window.celerisLastSeed") == seed
    page_text = browser.execute_script("return window.celerisFrames[window.celerisFrames.length - 1].text")

    def run(s) -> dict:
        body = {"prompt": "It is a truth universally", "max_tokens": 16, "steps": 8, "block_length": 8,
                "temperature": 1, "frequency_penalty": 0.5, "seed": s}
        req = urllib.request.Request(live.http_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())

    exact = run(seed)
    assert exact["celeris"]["seed"] == seed and exact["choices"][0]["text"] == page_text
    assert run(int(seed))["choices"][0]["text"] == page_text  # a number in the request is the same seed


def run_page(browser, timeout: float = 60) -> str:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element("id", "go").click()
    WebDriverWait(browser, timeout).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                          in ("done", "error"))
    return browser.find_element("tag name", "body").get_attribute("data-state")


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_generate_clears_at_once_errors_on_a_blank_canvas_and_fields_by_their_labels(live, browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(live.http_url + "/")
    WebDriverWait(browser, 30).until(lambda d: "model" in d.find_element("id", "model").text)
    browser.find_element("xpath", "//input[@value='completion']/..").click()
    fill(browser, "prompt", "It is a truth universally")
    for field, value in (("max_tokens", "32"), ("steps", "16"), ("block_length", "16"), ("seed", "7")):
        fill(browser, field, value)
    assert run_page(browser) == "done"
    # Completion mode: the prompt, dim, before the text that continues it.
    echo = browser.find_element("id", "echo")
    assert echo.text == "It is a truth universally"
    assert float(echo.value_of_css_property("opacity")) < 1
    assert browser.find_element("id", "canvas").text and browser.find_element("id", "step").text != "–"
    browser.save_screenshot(str(tmp_path / "done.png"))

    # An over-long canvas: the server refuses it (400). The click clears canvas and counters at once,
    # before any answer, and the error shows on the blank canvas, naming the field as labelled.
    fill(browser, "max_tokens", "100000")
    fill(browser, "block_length", "")
    right_after = browser.execute_script("""
        document.getElementById('go').click();  // generate() runs up to its fetch synchronously
        const c = document.getElementById('canvas');
        return {children: c.children.length, step: document.getElementById('step').textContent,
                masked: document.getElementById('masked').textContent, final: document.getElementById('final').textContent,
                width: document.getElementById('progress').style.width};""")
    assert right_after == {"children": 0, "step": "–", "masked": "–", "final": "", "width": "0%"}
    WebDriverWait(browser, 60).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                     in ("done", "error"))
    error = browser.find_element("id", "error").text
    browser.save_screenshot(str(tmp_path / "error.png"))
    if os.environ.get("CELERIS_SCREENSHOTS"):
        shutil.copy(tmp_path / "done.png", os.environ["CELERIS_SCREENSHOTS"] + "/done.png")
        shutil.copy(tmp_path / "error.png", os.environ["CELERIS_SCREENSHOTS"] + "/error.png")
    assert error.startswith("400") and "Tokens (canvas)" in error, error
    assert "gen_length" not in error and "max_tokens" not in error, error
    assert browser.find_element("id", "canvas").text == "" and browser.find_element("id", "final").text == ""


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_page_has_a_favicon_the_browser_can_draw(live, browser):
    browser.get(live.http_url + "/")
    href = browser.execute_script("return document.querySelector('link[rel=icon]').href")
    assert href.startswith("data:image/svg+xml,")  # inline: no request, no route
    size = browser.execute_async_script("""
        const done = arguments[0], img = new Image();
        img.onload = () => done([img.naturalWidth, img.naturalHeight]); img.onerror = () => done(null);
        img.src = document.querySelector('link[rel=icon]').href;""")
    assert size and size[0] > 0 and size[1] > 0


def test_the_default_prompt_is_one_the_embedded_model_answers():
    """The page opens in chat mode with a question celeris-tiny answers (its skill, two-digit
    addition); docs/models.md has the measurement behind the choice."""
    import re

    from celeris.engine.llm import LLM
    from celeris.engine.sampling.params import fit_lengths

    page = (Path(__file__).resolve().parents[2] / "clients" / "web" / "index.html").read_text()
    prompt = re.search(r'<textarea id="prompt"[^>]*>([^<]*)</textarea>', page).group(1)
    assert re.search(r'name="mode" value="chat" checked', page)
    a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", prompt).groups())
    llm = LLM.load("celeris-tiny")
    params = fit_lengths(llm.defaults, {"gen_length": 64, "seed": 0, "temperature": 0.0})
    (out,) = llm.generate([llm.encode_prompt(messages=[{"role": "user", "content": prompt}])], params)
    assert out.text.strip() == str(a + b)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_browser_marks_a_revising_models_cells_as_they_change(browser, tmp_path_factory):
    """DiffusionGemma (tiny, random): cells of the canvas being denoised are shown as may-change
    and a replaced cell is marked in the frame that replaces it; the page ends on the final text."""
    pytest.importorskip("transformers")
    from selenium.webdriver.support.ui import WebDriverWait

    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from tests.unit.revise_references.gemma_checkpoint import write_checkpoint, write_tokenizer

    folder = write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("dg-page"), canvas_length=8, seed=8))
    llm = LLM.load(folder, EngineConfig(max_batch=2, max_queue=4, max_prompt_tokens=32, max_gen_length=64))
    with live_server(llm) as live:
        browser.get(live.http_url + "/")
        WebDriverWait(browser, 30).until(lambda d: "running" in d.find_element("id", "model").text)
        browser.find_element("xpath", "//input[@value='completion']/..").click()
        fill(browser, "prompt", "w5 w6 w7")
        for field, value in (("max_tokens", "16"), ("max_denoising_steps", "5"), ("seed", "3")):
            fill(browser, field, value)
        WebDriverWait(browser, 30).until(lambda d: d.find_element("id", "t_max").is_displayed())  # its family's knobs
        assert not browser.find_element("id", "temperature").is_displayed()  # a mask model's are hidden
        for field, value in (("t_max", "0.9"), ("stability_threshold", "2")):
            fill(browser, field, value)
        sent = browser.execute_script("return knobs()")  # the body the page sends
        assert sent["t_max"] == 0.9 and sent["stability_threshold"] == 2 and "t_min" not in sent
        browser.find_element("id", "go").click()
        WebDriverWait(browser, 120).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                          in ("done", "error"))
        assert browser.find_element("id", "error").text == ""
        frames = browser.execute_script("return window.celerisFrames")
        body = {"prompt": "w5 w6 w7", "max_tokens": 16, "max_denoising_steps": 5, "seed": 3, "t_max": 0.9,
                "stability_threshold": 2}
        req = urllib.request.Request(live.http_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        final = json.loads(urllib.request.urlopen(req).read())["choices"][0]["text"]
    assert frames[0]["maychange"] > 0 and frames[-1]["maychange"] == 0  # the first canvas, shown and provisional
    assert any(f["revised"] > 0 for f in frames)  # a later step replaced cells shown before, visibly
    assert frames[-1]["done"] and frames[-1]["revised"] == 0
    assert frames[-1]["text"] == final
