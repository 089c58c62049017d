"""Adversarial run against a real ``mlx-mtp serve`` process: what a client sends must never
hurt the server or the other clients.

Starts a server (the embedded demo model by default, or ``--model``), then:

1. sends every bad input in ``bad_inputs()`` and checks each gets its expected 4xx status with
   the OpenAI error envelope ``{"error": {message, type, param, code}}`` and a one-line
   message (no parser state, backtrace or path);
2. times a short chat alone, while a 20 MB prompt is refused, and while a large prompt
   that fits the byte limit is being tokenized;
3. opens half-sent connections and checks they are dropped while the server keeps serving;
4. lets clients go away mid-generation (streaming and not) and times how long their slot
   stays busy;
5. runs concurrent streams with bad requests mixed in, the bad schemas among them (nothing
   lost: every stream ends with a finish reason and ``[DONE]``);
6. measures inter-token latency of running streams while a ~30k-token prompt arrives;
7. sends SIGTERM with streams in flight: each must end (complete, or an error event) and the
   process must exit 0;
8. (a second and third server) flips bytes in the data of a stored disk session and checks
   the restarted server answers as a cold one (before the SIGTERM of step 7).

``--code DIR`` runs the server from another checkout (e.g. ``/work/before``) for an A/B.
Prints a summary; ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

import httpx

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Write a haiku about caches."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
JSON = {"content-type": "application/json"}
TEXT_FIELDS = ("content", "reasoning_content", "reasoning")  # a token arrived


class Server:
    def __init__(self, args, extra: List[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if args.code:
            env["PYTHONPATH"] = str(Path(args.code).resolve())
        cmd = [sys.executable, "-m", "mlx_mtp.cli", "serve", "--port", str(self.port),
               "--log-level", "WARNING", *(["--model", args.model] if args.model else []),
               *extra]
        self.log = open(args.log, "w")
        # ``-m`` puts the working directory first on sys.path: run from the checkout's own
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=args.code or None)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {args.log}")
            if self.up():
                return
            time.sleep(0.3)
        self.proc.kill()
        raise SystemExit(f"server did not start; see {args.log}")

    def up(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str, **labels) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                                   for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, timeout: float) -> Optional[float]:
        """Seconds until no request is running, or None after ``timeout``."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.metric("mlx_mtp:num_requests_running") == 0:
                return time.perf_counter() - t0
            time.sleep(0.05)
        return None


def post(srv: Server, path: str, body=None, raw: bytes = None, headers=None, timeout=300):
    kw = {"json": body} if raw is None else {"content": raw}
    return httpx.post(srv.url + path, headers=headers, timeout=timeout, **kw)


# --- 1. bad inputs ---------------------------------------------------------------------------
RESPONSES = "/v1/responses"
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
BAD_REGEX = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}
PREFLIGHT = {"origin": "http://evil.example", "access-control-request-method": "POST"}


def any_of(n: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                       "required": [f"k{i}"]} for i in range(n)]}


def schema(s) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


def bad_inputs(ctx: int) -> list:
    """(name, path, body or raw bytes, extra headers, expected status; None: any 4xx).
    The grammar cases (issue 25) are also mixed into the concurrent streams of step 5.
    Headers asking ``access-control-request-method`` make it a CORS preflight (OPTIONS)."""
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    m = {"messages": MSG}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 60}
                                             for i in range(14000)}}  # ~1.3 MB
    strict = [{"type": "function", "function": {"name": "f", "strict": True,
                                                "parameters": BAD_REGEX}}]
    return [
        ("malformed JSON", CHAT, b'{"messages": [', JSON, 400),
        ("body not an object", CHAT, b"[1, 2]", JSON, 400),
        ("deeply nested JSON", CHAT, deep, JSON, 400),
        ("lone UTF-16 surrogate", CHAT, b'{"messages": [{"role": "user", "content": '
                                        b'"\\ud800"}]}', JSON, 400),
        ("wrong type", CHAT, dict(m, temperature="hot"), None, 400),
        ("unknown model", CHAT, dict(m, model="gpt-9"), None, 404),
        ("empty messages", CHAT, {"messages": []}, None, 400),
        ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400),
        ("temperature 3", CHAT, dict(m, temperature=3), None, 400),
        ("top_p 5", CHAT, dict(m, top_p=5), None, 400),
        ("negative max_tokens", CHAT, dict(m, max_tokens=-5), None, 400),
        ("absurd max_tokens", CHAT, dict(m, max_tokens=10 ** 12), None, 400),
        ("n = 3 (supported: 200)", CHAT, dict(m, n=3, max_tokens=4), None, 200),
        ("top_logprobs 99", CHAT, dict(m, logprobs=True, top_logprobs=99), None, 400),
        ("50,000 stop strings", CHAT, dict(m, stop=[f"s{i}" for i in range(50000)]), None, 400),
        ("1 MB stop string", CHAT, dict(m, stop="x" * (1 << 20)), None, 400),
        ("chat_template via kwargs", CHAT, dict(m, chat_template_kwargs={
            "chat_template": "{% for i in range(10**6) %}{% for j in range(10**6) %}x"
                             "{% endfor %}{% endfor %}"}), None, 400),
        ("documents via kwargs", CHAT, dict(m, chat_template_kwargs={"documents": [{}]}), None,
         None),
        ("unknown tool_choice function", CHAT, dict(m, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "launch_missiles"}}), None, 400),
        ("tool_choice required, no tools", CHAT, dict(m, tool_choice="required"), None, 400),
        ("bad tool-call arguments", CHAT, {"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": "{oops"}}]}]}, None, 400),
        ("num_draft_tokens 99", CHAT, dict(m, num_draft_tokens=99), None, 400),
        ("prompt longer than the context", COMPLETIONS, {"prompt": "word " * (ctx + 10)}, None,
         400),
        ("empty prompt", COMPLETIONS, {"prompt": ""}, None, 400),
        ("token id out of range", COMPLETIONS, {"prompt": [1, 10 ** 9]}, None, 400),
        ("several prompts", COMPLETIONS, {"prompt": ["a", "b"]}, None, 400),
        ("text/plain body", CHAT, json.dumps(m).encode(), {"content-type": "text/plain"}, 415),
        ("cross-origin page", CHAT, m, {"origin": "http://evil.example"}, 403),
        ("disallowed CORS preflight", CHAT, None, PREFLIGHT, 403),
        ("foreign Host (DNS rebinding)", CHAT, m, {"host": "evil.example"}, 403),
        ("17 MB body", COMPLETIONS, json.dumps({"prompt": "a" * (17 << 20)}).encode(), JSON,
         413),
        ("unknown route", "/v1/embeddings", {"input": "x"}, None, 404),
        # issue 25: grammars that compile but whose matcher fails, or too big to compile
        ("$ref-cycle schema", CHAT, dict(m, response_format=schema(CYCLE)), None, 400),
        ("2,500-branch anyOf schema", CHAT, dict(m, response_format=schema(any_of(2500))),
         None, 400),
        ("5,000-branch anyOf schema", CHAT, dict(m, response_format=schema(any_of(5000))),
         None, 400),
        ("1.3 MB schema, 14,000 properties", CHAT, dict(m, response_format=schema(huge)), None,
         400),
        ("json_schema without json_schema", CHAT, dict(m, response_format={
            "type": "json_schema"}), None, 400),
        ("strict forced tool, invalid regex", CHAT, dict(m, tools=strict, tool_choice={
            "type": "function", "function": {"name": "f"}}), None, 400),
        ("reasoning summary not a list", RESPONSES, {"input": [
            {"type": "reasoning", "summary": 5}, {"role": "user", "content": "hi"}]}, None, 400),
        ("reasoning text not a string", RESPONSES, {"input": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]},
            {"role": "user", "content": "hi"}]}, None, 400),
        ("text part with non-string text", CHAT, {"messages": [
            {"role": "user", "content": [{"type": "text", "text": 5}]}]}, None, 400),
    ]


LEAKS = ("<state>", "backtrace", "Parser:", "/home/", "/work/", "/usr/", ".rs:")


def check_envelope(r: httpx.Response, status: Optional[int] = None) -> Optional[str]:
    """None if ``r`` has the expected status (any 4xx if None) and the OpenAI error envelope
    with a one-line message that shows no internal state or path, else what is wrong.
    ``status`` 200: the request must be served (a case that used to be refused)."""
    if status == 200:
        return None if r.status_code == 200 else f"status {r.status_code} (expected 200)"
    if not 400 <= r.status_code < 500 or status not in (None, r.status_code):
        return f"status {r.status_code}" + (f" (expected {status})" if status else "")
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {r.status_code} without an error envelope: {r.text[:80]!r}"
    if set(err) != {"message", "type", "param", "code"} or not err["message"]:
        return f"malformed envelope {err}"
    message = str(err["message"])
    if "\n" in message or any(leak in message for leak in LEAKS):
        return f"message shows internals: {message[:120]!r}"
    return None


def send_bad(srv: Server, case) -> Optional[str]:
    name, path, body, headers, status = case
    try:
        if headers and "access-control-request-method" in headers:
            r = httpx.options(srv.url + path, headers=headers, timeout=120)
        else:
            raw = body if isinstance(body, bytes) else None
            r = post(srv, path, None if raw else body, raw=raw, headers=headers, timeout=120)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return check_envelope(r, status)


# --- 2. latency of a short chat beside huge requests ----------------------------------------
def short_chat(srv: Server) -> float:
    t0 = time.perf_counter()
    r = post(srv, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 15,
                         "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def beside(srv: Server, heavy: Callable[[], object], delay: float = 0.5) -> tuple:
    """(short-chat latency while ``heavy`` runs, heavy's duration, heavy's result)."""
    out = {}

    def run():
        t0 = time.perf_counter()
        try:
            out["result"] = heavy()
        except Exception as e:  # keep going: the summary reports it
            out["result"] = e
        out["seconds"] = time.perf_counter() - t0

    t = threading.Thread(target=run)
    t.start()
    time.sleep(delay)
    latency = short_chat(srv)
    t.join()
    return latency, out["seconds"], out["result"]


# --- 3. half-open connections ------------------------------------------------------------------
def half_open(srv: Server, n: int, wait: float) -> tuple:
    """Open ``n`` connections that send half a request; -> (dropped within ``wait``, served
    meanwhile)."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  if i % 2 else b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mess")
        socks.append(s)
    served = short_chat(srv) < 60
    deadline = time.time() + wait
    dropped = 0
    for s in socks:
        s.settimeout(max(deadline - time.time(), 0.01))
        try:
            while s.recv(65536):
                pass
            dropped += 1  # EOF: the server closed it (408 first for half bodies)
        except OSError:
            pass
        s.close()
    return dropped, served


# --- 4. clients that leave ----------------------------------------------------------------------
def leave_after(srv: Server, seconds: float, stream: bool) -> Optional[float]:
    """A long generation whose client leaves after ``seconds``; -> seconds until its slot
    is free (None: still busy after 30 s)."""
    body = json.dumps({"messages": MSG, "max_tokens": 4000, "temperature": 0,
                       "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        time.sleep(seconds)
    return srv.wait_idle(30)


# --- 5-7. streams --------------------------------------------------------------------------------
def stream_chat(srv: Server, content: str, max_tokens: int, stamps: Optional[list] = None):
    """One streaming chat -> (finish_reason or error code, saw [DONE])."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    finish, done = None, False
    try:
        with httpx.stream("POST", srv.url + CHAT, json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return obj["error"].get("code"), False
                for c in obj.get("choices") or []:
                    delta = c.get("delta") or {}
                    if stamps is not None and any(delta.get(k) for k in TEXT_FIELDS):
                        stamps.append(time.perf_counter())
                    finish = c.get("finish_reason") or finish
    except httpx.HTTPError as e:
        return f"{type(e).__name__}", False
    return finish, done


def run_threads(fns) -> list:
    results = [None] * len(fns)

    def call(i):
        results[i] = fns[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def itl_while_long_prompt(srv: Server, n_streams: int, prompt_tokens: int) -> dict:
    """Inter-token gaps (client side) of running streams while a long prompt arrives."""
    stamps = [[] for _ in range(n_streams)]
    arrival = {}

    def long_prompt():
        time.sleep(2.0)  # the streams are running
        arrival["t"] = time.perf_counter()
        r = post(srv, COMPLETIONS, {"prompt": "def f(x):\n    return x\n" * (prompt_tokens // 8),
                                    "max_tokens": 1, "temperature": 0})
        arrival["done"] = time.perf_counter()
        arrival["status"] = r.status_code
        arrival["prompt_tokens"] = (r.json().get("usage") or {}).get("prompt_tokens")

    fns = [lambda i=i: stream_chat(srv, f"Story number {i}", 400, stamps[i])
           for i in range(n_streams)] + [long_prompt]
    run_threads(fns)
    t0, t1 = arrival["t"], arrival["done"]
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if t0 <= b <= t1]
    gaps.sort()
    pct = (lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3) if gaps else \
        (lambda q: float("nan"))
    return {"prompt_tokens": arrival.get("prompt_tokens"), "status": arrival.get("status"),
            "prefill_s": t1 - t0, "gaps": len(gaps), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "max_ms": gaps[-1] * 1e3 if gaps else float("nan")}


def sigterm_in_flight(srv: Server, n: int) -> dict:
    results = [None] * n
    threads = []
    for i in range(n):
        def run(i=i):
            results[i] = stream_chat(srv, f"Tell me story {i}", 2000)
        threads.append(threading.Thread(target=run))
        threads[-1].start()
    time.sleep(3.0)
    t0 = time.perf_counter()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        code = "hung (killed)"
    exit_s = time.perf_counter() - t0
    for t in threads:
        t.join(30)
    ended = sum(1 for r in results if r is not None and (r[1] or r[0] == "shutting_down"))
    return {"streams": n, "ended": ended, "exit_code": code, "exit_s": exit_s,
            "results": [r[0] if r else None for r in results]}


# --- 8. disk sessions ---------------------------------------------------------------------------
def disk_session_corruption(args, workdir: Path) -> dict:
    """A conversation is stored by one server, bytes of its entry's data are flipped, and a
    restarted server must answer as the first one did (cold), never from the damaged state."""
    flags = ["--prompt-cache-dir", str(workdir), "--prompt-cache-min-tokens", "64"]
    body = {"messages": [{"role": "user", "content": "Summarise: " + "the cache holds " * 60}],
            "max_tokens": 24, "temperature": 0}
    answers, damaged = [], 0
    for corrupt in (False, True):
        srv = Server(args, flags)
        try:
            if corrupt:
                for f in workdir.glob("*.safetensors"):
                    data = bytearray(f.read_bytes())
                    start = 8 + int.from_bytes(data[:8], "little")
                    for i in range(start + 100, len(data), max(1, (len(data) - start) // 7)):
                        data[i] ^= 0x10  # header and size intact
                    f.write_bytes(bytes(data))
                    damaged += 1
            r = post(srv, CHAT, body)
            answers.append((r.status_code, r.json()["choices"][0]["message"]["content"],
                            r.json()["usage"].get("prompt_tokens_details", {})))
        finally:
            srv.proc.send_signal(signal.SIGTERM)
            srv.proc.wait(60)
        if not corrupt:  # restart over the same directory, after the entries are written
            time.sleep(1.0)
    (s1, cold, _), (s2, after, details) = answers
    return {"status": [s1, s2], "entries_damaged": damaged, "equal_to_cold": cold == after,
            "cached_tokens_after_corruption": (details or {}).get("cached_tokens")}


# --- the run -----------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--code", default=None, help="run the server from this checkout")
    ap.add_argument("--log", default="/tmp/mlx-mtp-adversarial-server.log")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--long-prompt-tokens", type=int, default=30000)
    ap.add_argument("--skip-itl", action="store_true", help="skip step 6 (long prefill)")
    ap.add_argument("--itl-only", action="store_true", help="run step 6 only")
    ap.add_argument("--skip-disk", action="store_true", help="skip step 8 (disk sessions)")
    args = ap.parse_args()

    probe = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "serve", "--help"],
                           capture_output=True, text=True, cwd=args.code or None,
                           env=dict(os.environ, **({"PYTHONPATH": args.code} if args.code
                                                   else {})))
    hardened = "--read-timeout" in probe.stdout
    extra = ["--read-timeout", "3"] if hardened else []
    if "--allowed-origins" in probe.stdout:  # a CORS setup: preflights are answered
        extra += ["--allowed-origins", "http://ui.example"]
    srv = Server(args, extra)
    card = httpx.get(srv.url + "/v1/models").json()["data"][0]
    ctx = card.get("max_model_len") or 32768
    report = {"code": args.code or "this checkout", "model": card["id"]}
    print(f"server: {report['code']}, model {card['id']}, context {ctx}")

    if args.itl_only:
        itl = itl_while_long_prompt(srv, 4, min(args.long_prompt_tokens, ctx - 100))
        print(json.dumps(itl))
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        return
    cases = bad_inputs(ctx)
    failures = {}
    for case in cases:
        err = send_bad(srv, case)
        if err:
            failures[case[0]] = err
    report["bad_inputs"] = {"n": len(cases), "ok": len(cases) - len(failures),
                            "failures": failures}
    print(f"1. bad inputs: {len(cases) - len(failures)}/{len(cases)} answered 4xx with the "
          "OpenAI error envelope")
    for name, err in failures.items():
        print(f"     {name}: {err}")

    alone = statistics.median(short_chat(srv) for _ in range(3))
    huge = json.dumps({"prompt": "a" * (20 << 20)}).encode()
    with_20mb, s20, r20 = beside(srv, lambda: post(srv, COMPLETIONS, raw=huge, headers=JSON))
    big_chars = min(4 << 20, 8 * ctx * 35)  # a few MB that pass the body cap
    big = json.dumps({"prompt": "def f(x):\n    return x\n" * (big_chars // 24)}).encode()
    with_big, sbig, rbig = beside(srv, lambda: post(srv, COMPLETIONS, raw=big, headers=JSON))
    status = lambda r: getattr(r, "status_code", type(r).__name__)  # noqa: E731
    report["short_chat_s"] = {"alone": alone, "beside_20MB": with_20mb, "20MB_s": s20,
                              "20MB_status": status(r20), "beside_big": with_big,
                              "big_bytes": len(big), "big_s": sbig, "big_status": status(rbig)}
    print(f"2. 15-token chat: alone {alone:.2f} s; while a 20 MB prompt is refused "
          f"{with_20mb:.2f} s (refused in {s20:.2f} s, HTTP {status(r20)}); while a "
          f"{len(big) / 1e6:.1f} MB prompt is processed {with_big:.2f} s ({sbig:.2f} s, "
          f"HTTP {status(rbig)})")

    wait = 10.0 if hardened else 15.0
    dropped, served = half_open(srv, 40, wait)
    report["half_open"] = {"n": 40, "dropped": dropped, "within_s": wait, "served": served}
    print(f"3. half-open connections: {dropped}/40 dropped within {wait:g} s; a chat was "
          f"{'served' if served else 'NOT served'} meanwhile")

    freed = {kind: leave_after(srv, 1.0, kind == "stream") for kind in ("non-stream", "stream")}
    report["disconnect_slot_free_s"] = freed
    fmt = lambda v: f"{v:.2f} s" if v is not None else "still busy after 30 s"  # noqa: E731
    print(f"4. client leaves after 1 s: slot free {fmt(freed['non-stream'])} later "
          f"(non-streaming), {fmt(freed['stream'])} (streaming)")

    mixed = cases[:12] + [c for c in cases if "schema" in c[0]]
    bad_mix = [lambda c=c: send_bad(srv, c) for c in mixed]
    streams = [lambda i=i: stream_chat(srv, f"Request {i} about topic {i * 7}", 64)
               for i in range(16)]
    res = run_threads(streams + bad_mix)
    complete = sum(1 for r in res[:16] if r[1] and r[0] in ("stop", "length"))
    bad_ok = sum(1 for r in res[16:] if r is None)
    report["load"] = {"streams": 16, "complete": complete, "bad": len(bad_mix), "bad_ok": bad_ok}
    print(f"5. load: {complete}/16 concurrent streams complete ([DONE] and a finish reason), "
          f"{bad_ok}/{len(bad_mix)} bad requests mixed in answered 4xx")

    if not args.skip_itl:
        itl = itl_while_long_prompt(srv, 4, min(args.long_prompt_tokens, ctx - 100))
        report["itl_long_prompt"] = itl
        print(f"6. inter-token latency of 4 running streams while a {itl['prompt_tokens']}-token "
              f"prompt arrives ({itl['prefill_s']:.1f} s): p50 {itl['p50_ms']:.0f} ms, p99 "
              f"{itl['p99_ms']:.0f} ms, max {itl['max_ms']:.0f} ms over {itl['gaps']} gaps")

    if not args.skip_disk:
        import tempfile

        disk = disk_session_corruption(args, Path(tempfile.mkdtemp(prefix="adv-sessions-")))
        report["disk_session_corruption"] = disk
        print(f"8. disk session ({disk['entries_damaged']} entries) with flipped data bytes: "
              f"answer "
              f"{'equals' if disk['equal_to_cold'] else 'DIFFERS from'} the cold one, "
              f"{disk['cached_tokens_after_corruption']} cached tokens used")

    up = srv.up()
    report["server_up"] = up
    sig = sigterm_in_flight(srv, 4)
    report["sigterm"] = sig
    print(f"7. SIGTERM with {sig['streams']} streams in flight: {sig['ended']}/{sig['streams']} "
          f"ended cleanly ({', '.join(map(str, sig['results']))}), exit code {sig['exit_code']} "
          f"after {sig['exit_s']:.1f} s")
    print(f"server up until SIGTERM: {'yes' if up else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
