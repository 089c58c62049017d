"""The live page at ``/`` in a real headless browser (Debian's chromium driven by
Playwright), its event stream, and the snapshot the dashboard shows."""

import json
import os
import shutil
import time

import httpx
import pytest

from mlx_mtp.server.dashboard import DashboardFeed
from mlx_mtp.server.metrics import ServerMetrics
from server_process import ServerProcess

CHROMIUM = os.environ.get("MLX_MTP_CHROMIUM", "/usr/bin/chromium")
# The network is closed: without these, chromium keeps trying to reach Google's hosts.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
KEY = "page-key"
PROMPT = "Tell me about speculative decoding."
MAX_TOKENS = 24


def Server(ckpt, work, *flags):  # noqa: N802 (the old class name, for modules importing it)
    """A server process started without waiting (``wait()`` later), as this module's own
    ``Server`` class did before the shared helper (``server_process.ServerProcess``)."""
    return ServerProcess(ckpt, work, *flags, wait=False)


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    """Two servers on a tiny checkpoint whose MTP head is partly right, started together:
    one with ``--api-key`` and ``--memory-budget`` that always drafts (the adaptive policy
    may rightly pause for this tiny model, and the page must show acceptance), one as started
    by default (no key: the Host/Origin guard is on) without MTP."""
    ckpt = tiny_ckpt("qwen3_5", "noisy", vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
    work = tmp_path_factory.mktemp("dashboard")
    keyed = ServerProcess(ckpt, work, "--api-key", KEY, "--max-concurrency", "4",
                          "--fixed-k", "--memory-budget", "1G", wait=False)
    open_ = ServerProcess(ckpt, work, "--no-mtp", "--max-concurrency", "2", wait=False)
    try:
        keyed.wait()
        open_.wait()
        yield {"keyed": keyed.url, "open": open_.url}
    finally:
        codes = [srv.stop() for srv in (keyed, open_)]
        assert codes == [0, 0], keyed.logs() + open_.logs()


@pytest.fixture(scope="module")
def server(servers):
    return servers["keyed"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM), (f"no chromium at {CHROMIUM}: install Debian's chromium "
                                    "(.ci/run does) or set MLX_MTP_CHROMIUM")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            args=CHROMIUM_FLAGS, headless=True, viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


def open_page(browser, url: str):
    """A new tab on ``url``; returns it and the list its errors are collected in."""
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: m.type == "error" and "401" not in m.text
            and problems.append(m.text))  # a 401 before the key is given is expected
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(url + "/")
    return page, problems


def page_chat(page, thinking: str, max_tokens: int):
    """Send PROMPT from a new chat; returns the reply's (answer, thoughts, stats)."""
    from playwright.sync_api import expect

    page.click("#new-chat")
    page.select_option("#thinking", thinking)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant")
    expect(reply).to_have_attribute("data-state", "done", timeout=60_000)
    return (reply.locator(".content").text_content(),
            reply.locator(".reasoning-text").text_content(),
            reply.locator(".stats").text_content())


def api_chat(url: str, thinking: bool, max_tokens: int = MAX_TOKENS) -> dict:
    """The same greedy request the page sends, answered by the API without streaming."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "chat_template_kwargs": {"enable_thinking": thinking}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


# --- the snapshot ------------------------------------------------------------------------
class FakeEngine:
    def __init__(self, metrics):
        from mlx_mtp.decode.policy import DraftPolicy
        from mlx_mtp.server.memory_budget import MemoryBudget
        from mlx_mtp.server.prefix_cache import PrefixCache

        self.metrics, self.alive, self.max_concurrency = metrics, True, 4
        self.prefix_cache = PrefixCache(8, 1 << 20)
        self.running = []
        self.memory = MemoryBudget(4 << 20).report_to(self)
        self.num_draft_tokens = 3
        self.batch = type("Batch", (), {"policy": DraftPolicy(), "__len__": lambda self: 2})()


def test_snapshot_rates_acceptance_and_policy():
    metrics = ServerMetrics("m", running=lambda: 2, waiting=lambda: 1)
    engine = FakeEngine(metrics)
    now = [100.0]
    feed = DashboardFeed(type("State", (), {"engine": engine, "model_name": "m"})(),
                         clock=lambda: now[0])
    first = feed.snapshot()
    assert first["generation_tokens_per_second"] == 0 and first["per_position"] == []
    assert feed.snapshot() is first  # viewers within half a second share a snapshot
    assert first["acceptance_rate"] is None
    # Steps of K=3 (2 and 0 accepted) and one of K=1 (accepted): position 3 is drafted
    # twice, position 1 three times.
    for drafted, accepted in ((3, 2), (3, 0), (1, 1)):
        metrics.record_step(drafted, accepted)
    metrics.generation_tokens.inc(30)
    now[0] += 2.0
    s = feed.snapshot()
    assert s["generation_tokens_per_second"] == pytest.approx(15.0)
    assert [(p["drafted"], p["accepted"]) for p in s["per_position"]] == [(3, 2), (2, 1), (2, 0)]
    assert [p["rate"] for p in s["per_position"]] == pytest.approx([2 / 3, 0.5, 0.0])
    assert s["acceptance_rate"] == pytest.approx(3 / 7)
    assert s["mean_acceptance_length"] == pytest.approx(2.0)
    assert (s["requests_running"], s["requests_waiting"]) == (2, 1)
    # The policy view covers 1, 2, 4 (the limit) and the current batch size.
    policy = s["draft_policy"]
    assert [r["batch_size"] for r in policy["by_batch_size"]] == [1, 2, 4]
    assert all(r["k"] is not None and 0 <= r["k"] <= 3 for r in policy["by_batch_size"])
    assert policy["batch_size"] == 2 and policy["max_k"] == 3
    assert s["memory"] == {"budget_bytes": 4 << 20, "sequences_bytes": 0, "reserved_bytes": 0,
                           "prefix_cache_bytes": 0}
    # Older samples leave the rate window: seconds later with no new tokens, the rate is 0.
    now[0] += 4.0
    assert feed.snapshot()["generation_tokens_per_second"] == 0
    json.dumps(s)  # the event stream sends it as JSON


def test_policy_view_reads_a_copy_while_the_engine_records_steps():
    import threading

    from mlx_mtp.server.dashboard import _policy_copy, draft_policy_view

    engine = FakeEngine(ServerMetrics("m"))
    policy = engine.batch.policy
    for step in range(200):
        policy.record_step(1 + step % 4, step % 4, 0.01 * (1 + step % 4), [step % 4])
    before = [policy.describe(b, 3) for b in (1, 2, 4)]
    mine = _policy_copy(policy)
    mine.record_step(4, 3, 5.0, [0, 0, 0, 0])  # the copy's measurements are its own
    assert [policy.describe(b, 3) for b in (1, 2, 4)] == before

    # The engine thread keeps recording (new cells too) while viewers read.
    stop = threading.Event()

    def engine_steps():
        step = 0
        while not stop.is_set():
            step += 1
            policy.record_step(1 + step % 7, step % 4, 0.01, [step % 4] * (1 + step % 7))

    worker = threading.Thread(target=engine_steps)
    worker.start()
    try:
        views = [draft_policy_view(engine) for _ in range(100)]
    finally:
        stop.set()
        worker.join()
    assert all(len(v["by_batch_size"]) == 3 for v in views)


# --- the routes --------------------------------------------------------------------------
def test_page_is_public_data_needs_the_key(server):
    page = httpx.get(server + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "/static/app.js" in page.text
    assert httpx.get(server + "/static/app.js", timeout=10).headers["content-type"].startswith(
        "text/javascript")
    missing = httpx.get(server + "/static/secret.py", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()

    for path in ("/v1/dashboard", "/v1/dashboard/events"):
        r = httpx.get(server + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY}"}
    snap = httpx.get(server + "/v1/dashboard", headers=auth, timeout=10).json()
    assert snap["alive"] and snap["max_concurrency"] == 4
    events, arrivals = [], []
    with httpx.stream("GET", server + "/v1/dashboard/events", headers=auth, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                arrivals.append(time.monotonic())
                if len(events) == 3:
                    break
    # One snapshot per second (a loaded machine may stretch the second a little).
    assert all(0.8 < b - a < 3 for a, b in zip(arrivals, arrivals[1:])), arrivals
    assert events[0]["time"] < events[1]["time"] < events[2]["time"]


# --- the browser -------------------------------------------------------------------------
def test_browser_chat_round_trip_and_live_dashboard(server, browser, tmp_path):
    from playwright.sync_api import expect

    page, problems = open_page(browser, server)
    # Without the key, the event stream answers 401 and the page asks for it.
    expect(page.locator("#status")).to_have_attribute("data-state", "error")
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    expect(page.locator("#status")).to_have_attribute("data-state", "live")
    expect(page.locator("#finished")).to_have_text("0")
    generated_before = page.text_content("#generated")

    answers = {thinking: page_chat(page, thinking, MAX_TOKENS) for thinking in ("off", "on")}
    # What the page rendered is what the API returns for the same request.
    plain, thought = api_chat(server, False), api_chat(server, True)
    content, reasoning, stats = answers["off"]
    assert content and content == plain["content"]
    assert reasoning == "" and "reasoning_content" not in plain
    assert f"{MAX_TOKENS} tokens" in stats and "MTP accepted" in stats
    content, reasoning, _ = answers["on"]
    assert reasoning and reasoning.strip() == thought["reasoning_content"]
    assert content == (thought["content"] or "")

    # The dashboard moved: four requests (two from the page, two from the API).
    expect(page.locator("#finished")).to_have_text("4", timeout=10_000)
    assert page.text_content("#generated") != generated_before
    assert int(page.text_content("#generated").replace(",", "")) >= 4 * MAX_TOKENS - 8
    assert page.locator("#positions tbody tr").count() >= 1
    assert "%" in page.text_content("#positions tbody tr:first-child")
    assert page.locator("#k-table tbody tr").count() >= 2
    assert page.text_content("#cache-tokens") != "0 of 0"
    # serve --memory-budget: the budget, and the prompts the prefix cache keeps within it
    expect(page.locator("#memory-budget")).to_have_text("1.0 GB")
    assert page.text_content("#memory-prefix-cache").endswith(("KB", "MB"))
    page.screenshot(path=str(tmp_path / "dashboard.png"))
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert not problems, problems
    page.close()


def test_browser_without_key_passes_the_origin_guard(servers, browser):
    """Started without a key, the server refuses cross-origin browser requests; the
    page's own (same-origin) requests must get through."""
    from playwright.sync_api import expect

    url = servers["open"]
    page, problems = open_page(browser, url)
    expect(page.locator("#status")).to_have_attribute("data-state", "live")
    content, _, stats = page_chat(page, "off", 8)
    assert content == api_chat(url, False, 8)["content"]
    assert "8 tokens" in stats and "MTP" not in stats
    expect(page.locator("#policy-mode")).to_have_text("MTP off")
    expect(page.locator("#finished")).to_have_text("2", timeout=10_000)
    assert not problems, problems
    page.close()
