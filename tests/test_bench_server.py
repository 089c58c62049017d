"""Server-mode benchmark against a stub OpenAI-compatible SSE server (and the real one)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_mtp.bench.prompts import builtin_prompts
from mlx_mtp.bench.server import (Target, discover_model, resolve_targets, run_server_bench,
                                  stream_request, wait_ready)
from mlx_mtp.cli import main


class StubServer:
    """A minimal streaming chat-completions server.

    ``max_tokens`` tokens are streamed ``tokens_per_chunk`` at a time, ``delay``
    seconds apart, then a usage chunk carrying llama-server ``timings`` and an
    mlx-mtp ``mtp`` block. ``models_body`` is what GET /v1/models returns
    (``b""`` imitates mlx_lm.server without a Hugging Face cache).
    """

    def __init__(self, tokens_per_chunk=1, delay=0.002, models_body=None, fail_every=0,
                 prefill_delay=0.01):
        self.tokens_per_chunk = tokens_per_chunk
        self.delay = delay
        self.prefill_delay = prefill_delay
        self.models_body = models_body if models_body is not None else json.dumps(
            {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}).encode()
        self.fail_every = fail_every
        self.bodies = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, body: bytes, ctype="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, stub.models_body)
                elif self.path == "/health":
                    self._send(200, b'{"status":"ok"}')
                else:
                    self._send(404, b'{"error":{"message":"not found"}}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.bodies.append(body)
                    n_req = len(stub.bodies)
                if stub.fail_every and n_req % stub.fail_every == 0:
                    return self._send(500, b'{"error":{"message":"boom","type":"server_error"}}')
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                stub.stream(self.wfile, body)
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def stream(self, w, body):
        def event(obj):
            w.write(f"data: {json.dumps(obj)}\n\n".encode())
            w.flush()

        n, k = body["max_tokens"], self.tokens_per_chunk
        w.write(b": keepalive 0/1\n\n")
        time.sleep(self.prefill_delay)
        event({"id": "c1", "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        sent = 0
        while sent < n:
            m = min(k, n - sent)
            event({"id": "c1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"content": " tok" * m}, "finish_reason": None}]})
            sent += m
            time.sleep(self.delay)
        event({"id": "c1", "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        drafts = (n - 1) // 2
        event({"id": "c1", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7},
               "timings": {"predicted_n": n, "draft_n": 2 * drafts, "draft_n_accepted": drafts},
               "mtp": {"num_drafts": drafts, "num_draft_tokens": 2 * drafts,
                       "num_accepted_tokens": drafts, "mean_acceptance_length": 1.5,
                       "accepted_per_pos": [drafts, 0]}})
        w.write(b"data: [DONE]\n\n")
        w.flush()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


PROMPTS = builtin_prompts("builtin:qa")


def test_stream_request_fields():
    with StubServer() as s:
        r = stream_request(Target(s.url, "stub-model"), "hi", 12)
    assert r.ok, r.error
    assert r.completion_tokens == 12 and r.tokens_from_usage and r.prompt_tokens == 7
    assert len(r.chunk_times) == 12 and len(r.itls) == 11
    assert 0 < r.ttft < r.e2e
    assert r.finish_reason == "length"
    assert r.timings["draft_n"] == 10 and r.mtp["num_drafts"] == 5
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 11)
    assert s.bodies[0]["stream"] is True
    assert s.bodies[0]["stream_options"] == {"include_usage": True}
    assert s.bodies[0]["model"] == "stub-model"


def test_server_bench_levels_consistent():
    with StubServer(tokens_per_chunk=2) as s:
        t = Target(s.url)
        assert resolve_targets([t]) == [] and t.model == "stub-model"
        out = run_server_bench([t], PROMPTS, [1, 3], rounds=2, max_tokens=10)
    rows = out["levels"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert len(out["requests"]) == (1 + 3) * 2
    for r in rows:
        assert r["requests"] == 2 * r["concurrency"] and r["errors"] == 0
        assert r["completion_tokens"] == 10 * r["requests"] and r["tokens_from_usage"]
        assert r["chunks"] == 5 * r["requests"] and r["tokens_per_chunk"] == pytest.approx(2.0)
        assert 0 < r["ttft_p50_ms"] < r["e2e_p50_ms"]
        assert r["ttft_max_ms"] < r["e2e_max_ms"]
        assert r["itl_p50_ms"] <= r["itl_p95_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
        assert r["itl_p50_ms"] > 0 and r["tpot_mean_ms"] > 0
        assert r["aggregate_tps"] == pytest.approx(r["completion_tokens"] / r["wall_s"])
        assert r["request_tps_mean"] > 0
        # Speculative statistics summed over requests: each reports 4 drafts, 4 accepted.
        assert r["draft_n"] == 8 * r["requests"] and r["draft_n_accepted"] == 4 * r["requests"]
        assert r["mtp_num_drafts"] == 4 * r["requests"]
        assert r["mtp_accepted_per_pos"] == [4 * r["requests"], 0]
        assert r["mtp_acceptance_per_pos"] == [1.0, 0.0]
        assert r["mtp_mean_acceptance_length"] == pytest.approx(2.0)
        assert r["acceptance_rate"] == pytest.approx(0.5)
    for q in out["requests"]:
        assert q["ok"] and q["ttft"] < q["e2e"] and q["completion_tokens"] == 10
    # Warm-up request + measured ones.
    assert len(s.bodies) == 1 + 8


def test_model_discovery_falls_back_on_empty_models_body():
    with StubServer(models_body=b"") as s:
        t = Target(s.url + "/v1/")
        assert t.url == s.url
        assert discover_model(t) is None
        notes = resolve_targets([t])
        assert t.model is None and "without a 'model' field" in notes[0]
        out = run_server_bench([t], PROMPTS, [2], rounds=1, max_tokens=4, warmup=False)
    assert out["levels"][0]["errors"] == 0
    assert all("model" not in b for b in s.bodies)


def test_errors_counted_and_unreachable_server(tmp_path, capsys):
    with StubServer(fail_every=2) as s:
        out = run_server_bench([Target(s.url, "m")], PROMPTS, [2], rounds=2, max_tokens=4,
                               warmup=False)
    row = out["levels"][0]
    assert row["requests"] == 4 and row["errors"] == 2
    assert "HTTP 500" in row["error_samples"][0]
    # Nothing listening: a clear error, exit code 2.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["bench", "--server", f"http://127.0.0.1:{port}", "-o", str(tmp_path)]) == 2
    assert "cannot connect" in capsys.readouterr().err


def test_cli_server_compare_writes_outputs(tmp_path):
    with StubServer(tokens_per_chunk=3, delay=0.001) as a, StubServer(delay=0.003) as b:
        rc = main(["bench", "--server", a.url, "--compare", b.url, "--label", "mtp",
                   "--compare-label", "plain", "--compare-extra-body", '{"num_draft_tokens": 0}',
                   "--concurrency", "1,2", "--rounds", "1",
                   "--max-tokens", "6", "--prompts", "builtin:qa", "-o", str(tmp_path),
                   "--quiet"])
    assert rc == 0
    assert all(x.get("num_draft_tokens") == 0 for x in b.bodies)
    assert all("num_draft_tokens" not in x for x in a.bodies)
    data = json.loads((tmp_path / "server.json").read_text())
    assert [(r["server"], r["concurrency"]) for r in data["levels"]] == [
        ("mtp", 1), ("plain", 1), ("mtp", 2), ("plain", 2)]
    assert [c["concurrency"] for c in data["compare"]] == [1, 2]
    assert all(c["aggregate_tps_ratio"] > 0 for c in data["compare"])
    assert data["targets"][0]["model"] == "stub-model"
    for f in ["server.csv", "server_requests.csv", "latency_vs_concurrency.png",
              "README_snippet_server.md"]:
        assert (tmp_path / f).stat().st_size > 0, f


def test_passes_interleave_abba_and_pool(tmp_path):
    """--passes: each level runs per server in A B B A order; rows pool the passes."""
    with StubServer(tokens_per_chunk=2, delay=0.001) as a, StubServer(delay=0.001) as b:
        rc = main(["bench", "--server", a.url, "--compare", b.url, "--label", "A",
                   "--compare-label", "B", "--concurrency", "1", "--rounds", "1",
                   "--passes", "3", "--max-tokens", "4", "--prompts", "builtin:qa",
                   "-o", str(tmp_path), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "server.json").read_text())
    order = [(r["server"], r["pass"]) for r in data["requests"]]
    assert order == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    for row in data["levels"]:
        assert row["requests"] == 3 and len(row["pass_aggregate_tps"]) == 3
        assert min(row["pass_aggregate_tps"]) <= row["aggregate_tps"] <= max(
            row["pass_aggregate_tps"])
    c = data["compare"][0]
    assert 0 < c["pass_ratio_min"] <= c["pass_ratio_max"]
    assert main(["bench", "--server", "http://127.0.0.1:1", "--passes", "0"]) == 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_server_bench(tmp_path):
    from mlx_mtp.testing.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "ckpt", "qwen3_5", "oracle", vocab_size=4096, trunk_scale=0.1)
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_mtp.cli", "serve", "--model", str(ckpt),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        target = Target(f"http://127.0.0.1:{port}")
        ready = False
        for _ in range(240):
            if proc.poll() is not None:
                break
            if wait_ready(target, 0.25):
                ready = True
                break
        assert ready, (tmp_path / "server.log").read_text()[-2000:]
        resolve_targets([target])
        out = run_server_bench([target], PROMPTS, [1, 4], rounds=1, max_tokens=8, timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    for r in out["levels"]:
        assert r["errors"] == 0, r["error_samples"]
        assert r["completion_tokens"] > 0 and r["aggregate_tps"] > 0
        assert r["ttft_p50_ms"] < r["e2e_p50_ms"] and r["itl_p50_ms"] is not None
        if r["mtp_num_drafts"]:  # the oracle head: every draft the server reports is accepted
            assert r["acceptance_rate"] == pytest.approx(1.0)
    for q in out["requests"]:
        assert q["ttft"] < q["e2e"]
        if q["tokens_from_usage"]:
            assert 0 < q["completion_tokens"] <= 8
            assert q["chunks"] <= q["completion_tokens"]


def test_cli_sampling_flags_become_request_fields(tmp_path):
    with StubServer() as s:
        rc = main(["bench", "--server", s.url, "--concurrency", "1", "--rounds", "1",
                   "--max-tokens", "4", "--prompts", "builtin:qa", "-o", str(tmp_path),
                   "--quiet", "--no-warmup", "--temp", "0.7", "--seed", "3", "--coupled",
                   "--repetition-penalty", "1.2", "--frequency-penalty", "0.5"])
    assert rc == 0 and s.bodies
    for body in s.bodies:
        assert body["temperature"] == 0.7 and body["seed"] == 3
        assert body["mtp_coupled"] is True and body["repetition_penalty"] == 1.2
        assert body["frequency_penalty"] == 0.5 and "presence_penalty" not in body
