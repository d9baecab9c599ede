"""The web page as a person sees it on a 1280x800 screen (issue 45): Generate and the canvas in one
viewport before and while a run draws, only the loaded model's family's knobs, and a header
whose counts are the server's once the run has ended.

Uses the headless Chromium of test_web_page.py (its `browser` and `live` fixtures).
"""

from __future__ import annotations

import os
import urllib.request
import json

import pytest

from tests.integration.browser import browser, fill, live  # noqa: F401  (fixtures)

WIDTH, HEIGHT = 1280, 800
# Where the Generate button and the canvas are, in viewport pixels.
RECTS = """
const r = (id) => { const b = document.getElementById(id).getBoundingClientRect();
                    return {top: b.top, bottom: b.bottom, left: b.left, right: b.right}; };
return {go: r('go'), canvas: r('canvas'), output: r('output'), h: window.innerHeight, w: window.innerWidth};
"""
# Installed before clicking: the same rectangles at every canvas change, and the header's text.
# The first change also asks /health, as the page's 5 s poll does when it lands mid-run.
OBSERVE = """
window.during = [];
const canvas = document.getElementById('canvas');
const rects = new Function(arguments[0]);
new MutationObserver(() => {
  if (!window.during.length) loadInfo();
  window.during.push(rects());
}).observe(canvas, {childList: true});
"""
MASK_ONLY = ("steps", "block_length", "temperature", "threshold", "remasking", "frequency_penalty")
OTHER_FAMILIES = ("editing_threshold", "max_post_steps", "max_denoising_steps", "entropy_bound", "t_min", "t_max",
                  "stability_threshold", "confidence_threshold")


def in_view(rects: dict) -> list[str]:
    """What is not on screen: Generate must be wholly inside; the canvas's first line at least."""
    h, w, out = rects["h"], rects["w"], []
    go, canvas = rects["go"], rects["canvas"]
    if not (go["top"] >= 0 and go["bottom"] <= h and go["left"] >= 0 and go["right"] <= w):
        out.append(f"Generate at {go}")
    if not (0 <= canvas["top"] and canvas["top"] + 24 <= h and canvas["left"] >= 0 and canvas["right"] <= w):
        out.append(f"canvas at {canvas}")
    return out


def open_page(browser, url: str) -> None:  # noqa: F811
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    browser.get(url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element("tag name", "body").get_attribute("data-family"))


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_generate_and_the_canvas_share_one_1280x800_viewport(live, browser):  # noqa: F811
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, live.http_url)
    before = browser.execute_script(RECTS)
    assert (before["w"], before["h"]) == (WIDTH, HEIGHT)
    assert in_view(before) == []
    for field, value in (("max_tokens", "64"), ("steps", "64"), ("block_length", "16"), ("seed", "7")):
        fill(browser, field, value)
    assert in_view(browser.execute_script(RECTS)) == []  # typing scrolls nothing away
    browser.execute_script(OBSERVE, RECTS)
    browser.find_element("id", "go").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element("tag name", "body").get_attribute("data-state")
                                     in ("done", "error"))
    assert browser.find_element("id", "error").text == ""
    header = browser.find_element("id", "model").text  # read at once: the state is set after the header
    during = browser.execute_script("return window.during")
    assert len(during) >= 3
    assert [in_view(r) for r in during] == [[] for _ in during]
    if os.environ.get("CELERIS_SCREENSHOTS"):
        browser.save_screenshot(os.environ["CELERIS_SCREENSHOTS"] + "/layout-1280x800.png")
    assert "· 0 running" in header, header


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_only_the_loaded_families_knobs_show(live, browser):  # noqa: F811
    card = json.loads(urllib.request.urlopen(live.http_url + "/v1/models").read())["data"][0]
    assert card["celeris"] == {"architecture": "llada", "family": "full", "token_editing": False,
                               "decoding_modes": []}
    open_page(browser, live.http_url)
    assert browser.find_element("tag name", "body").get_attribute("data-family") == "full"
    for knob in MASK_ONLY + ("max_tokens", "seed"):
        assert browser.find_element("id", knob).is_displayed(), knob
    for knob in OTHER_FAMILIES:
        assert not browser.find_element("id", knob).is_displayed(), knob
    # A value left in a hidden field is never sent (the server refuses another family's knob).
    browser.execute_script("document.getElementById('t_max').value = '0.9';"
                           "document.getElementById('editing_threshold').value = '0.5';")
    sent = browser.execute_script("return knobs()")
    assert "t_max" not in sent and "editing_threshold" not in sent
