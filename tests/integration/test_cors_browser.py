"""CORS in a real browser: a page on another loopback origin calls the gateway with the headers the
openai JS SDK sends (`x-stainless-*`). Chromium refuses the call unless the preflight allows them."""

from __future__ import annotations

import http.server
import threading

import pytest

from tests.integration.live_server import live_server
from tests.integration.browser import browser  # noqa: F401  (the headless Chromium fixture)

FETCH = """
const [url, done] = arguments;
fetch(url + '/v1/completions', {method: 'POST', headers: {
    'Content-Type': 'application/json', 'Authorization': 'Bearer s3cret',
    'x-stainless-os': 'Linux', 'x-stainless-lang': 'js', 'x-stainless-retry-count': '0'},
  body: JSON.stringify({prompt: 'It is a truth', max_tokens: 4})})
  .then(r => r.json().then(b => done({status: r.status, text: b.choices ? b.choices[0].text : null})))
  .catch(e => done({error: String(e)}));
"""


@pytest.fixture
def other_origin():
    """A blank page on another loopback origin (another port)."""
    class Blank(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>app</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blank)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def cross_origin_fetch(driver, page: str, api: str) -> dict:
    driver.get(page + "/")
    return driver.execute_async_script(FETCH, api)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("allowed", ["origin", "*"])
def test_openai_sdk_headers_pass_cors_from_an_allowed_origin(tiny_llm, browser, other_origin, allowed):  # noqa: F811
    origins = (other_origin,) if allowed == "origin" else ("*",)
    with live_server(tiny_llm, allowed_origins=origins, api_token="s3cret") as s:
        result = cross_origin_fetch(browser, other_origin, s.http_url)
    assert result.get("status") == 200, result
    assert isinstance(result["text"], str)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_browser_on_another_origin_is_refused(tiny_llm, browser, other_origin):  # noqa: F811
    with live_server(tiny_llm, allowed_origins=("https://app.example.com",), api_token="s3cret") as s:
        result = cross_origin_fetch(browser, other_origin, s.http_url)
    assert "error" in result  # the browser blocks the call: TypeError: Failed to fetch
