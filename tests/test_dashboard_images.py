"""Images on the live page: pasted, dropped and picked images become OpenAI ``image_url``
parts (data URLs of the files' own bytes, images before the question), and the answer the
page shows is transformers' greedy text for the same images (the tiny Qwen3.5-VL fixture
of ``test_vision.py``)."""

import base64
import json
from pathlib import Path

import pytest

from server_process import ServerProcess
from test_dashboard_browser import browser, open_page  # noqa: F401  (the browser fixture)

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_5_vl"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())["cases"]
N = 16

pytestmark = pytest.mark.slow

PASTE_AND_DROP = """async ([kind, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], kind + ".png", { type: "image/png" }));
  const init = { bubbles: true, cancelable: true };
  if (kind === "paste") {
    document.getElementById("prompt").dispatchEvent(
      new ClipboardEvent("paste", { ...init, clipboardData: data }));
  } else {
    document.getElementById("chat-form").dispatchEvent(
      new DragEvent("drop", { ...init, dataTransfer: data }));
  }
}"""


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    srv = ServerProcess(FIXTURE / "checkpoint", tmp_path_factory.mktemp("vision-page"),
                        "--vision")
    try:
        yield srv.url
    finally:
        assert srv.stop() == 0, srv.logs()


def test_pasted_and_dropped_images_are_sent_and_answered(vision_server, browser):  # noqa: F811
    from playwright.sync_api import expect
    from transformers import AutoTokenizer

    page, problems = open_page(browser, vision_server)
    b64 = {n: base64.b64encode((FIXTURE / n).read_bytes()).decode()
           for n in ("image_a.png", "image_b.png")}
    page.evaluate(PASTE_AND_DROP, ["paste", b64["image_a.png"]])
    expect(page.locator("#attachments .thumb")).to_have_count(1)
    page.evaluate(PASTE_AND_DROP, ["drop", b64["image_b.png"]])
    expect(page.locator("#attachments .thumb")).to_have_count(2)
    # A third, picked with the file dialog, then removed again: not sent.
    page.set_input_files("#image-file", str(FIXTURE / "image_a.png"))
    expect(page.locator("#attachments .thumb")).to_have_count(3)
    page.locator("#attachments .thumb button").nth(2).click()
    expect(page.locator("#attachments .thumb")).to_have_count(2)

    ref = REFERENCE[1]  # images a and b, then the question
    page.fill("#max-tokens", str(N))
    page.fill("#temperature", "0")
    page.fill("#prompt", ref["user_text"])
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant")
    expect(reply).to_have_attribute("data-state", "done", timeout=120_000)
    expect(page.locator(".msg.user .images img")).to_have_count(2)
    expect(page.locator("#attachments .thumb")).to_have_count(0)

    user, answer = json.loads(page.evaluate("JSON.stringify(conversation)"))
    assert user["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64[n]}}
        for n in ref["images"]] + [{"type": "text", "text": ref["user_text"]}]
    tok = AutoTokenizer.from_pretrained(str(FIXTURE / "checkpoint"))
    assert answer["content"] == tok.decode(ref["output"])
    assert f"{N} tokens" in reply.locator(".stats").text_content()
    assert not problems, problems
    page.close()
