"""Benchmark client for any OpenAI-compatible server (streaming, standard library only).

For each concurrency level ``c``, ``c`` workers each send ``rounds`` streaming
requests back to back (closed loop, so ``c`` requests are in flight all the
time). Per request: TTFT (first content chunk), inter-token latency (gaps
between content chunks; a server that sends several tokens per chunk, as MTP
servers may, shows larger but fewer gaps), TPOT ((E2E - TTFT) / (tokens - 1)),
end-to-end latency and decode tok/s. Token counts come from ``usage`` when the
server reports it (``stream_options.include_usage``), else from chunk counts.

Speculative statistics are read when present: llama-server's ``timings``
(``draft_n``, ``draft_n_accepted``) and mlx-mtp's ``mtp`` block
(``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
``mean_acceptance_length``, ``accepted_per_pos``), at the top level of a chunk,
inside ``usage`` or inside ``timings``.

With ``--compare``, levels alternate between the two servers (A at c, B at c,
A at the next c, ...) so drift affects both alike. ``--compare`` may name the
same URL with a different ``--compare-extra-body`` (e.g. mlx-mtp's per-request
``{"num_draft_tokens": 0}``) to A/B MTP against plain decoding on one server.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence
from urllib.parse import urlsplit

from . import stats as st
from .prompts import Prompt


class ServerError(Exception):
    """The server cannot be reached or answered something unusable."""


@dataclass
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)
    model: Optional[str] = None  # None: the request carries no "model" field
    label: str = ""
    api_key: Optional[str] = None
    extra_body: Optional[dict] = None  # merged into every request, e.g. {"num_draft_tokens": 0}

    def __post_init__(self):
        u = self.url.rstrip("/")
        if "://" not in u:
            u = "http://" + u
        if u.endswith("/v1"):
            u = u[:-3]
        self.url = u
        self.label = self.label or u.split("://", 1)[1]


@dataclass
class RequestResult:
    ok: bool
    error: Optional[str] = None
    status: Optional[int] = None
    prompt: str = ""
    ttft: Optional[float] = None  # seconds to the first content chunk
    e2e: float = 0.0
    chunk_times: List[float] = field(default_factory=list)  # arrival of content chunks (s)
    completion_tokens: int = 0
    prompt_tokens: Optional[int] = None
    tokens_from_usage: bool = False
    finish_reason: Optional[str] = None
    text_chars: int = 0
    timings: Optional[dict] = None  # llama-server style
    mtp: Optional[dict] = None  # mlx-mtp style

    @property
    def itls(self) -> List[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def decode_time(self) -> float:
        return self.e2e - (self.ttft or 0.0)

    @property
    def tpot(self) -> Optional[float]:
        if self.completion_tokens > 1 and self.ttft is not None:
            return self.decode_time / (self.completion_tokens - 1)
        return None

    @property
    def tps(self) -> Optional[float]:
        """Decode tok/s of this request (the first token belongs to TTFT)."""
        if self.completion_tokens > 1 and self.decode_time > 0:
            return (self.completion_tokens - 1) / self.decode_time
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("chunk_times")
        d.update(chunks=len(self.chunk_times), tpot=self.tpot, tps=self.tps,
                 itl_p50=st.percentile(self.itls, 50), itl_max=max(self.itls, default=None))
        return d


# --- HTTP -------------------------------------------------------------------------------
def _connection(url: str, timeout: float):
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout), u.path.rstrip("/")


def _headers(target: Target, extra: Optional[dict] = None) -> dict:
    h = {"Accept": "application/json"}
    if target.api_key:
        h["Authorization"] = f"Bearer {target.api_key}"
    h.update(extra or {})
    return h


def get_json(target: Target, path: str, timeout: float = 5.0):
    """GET ``path``; returns (status, parsed JSON or None)."""
    conn, base = _connection(target.url, timeout)
    try:
        conn.request("GET", base + path, headers=_headers(target))
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(body) if body.strip() else None
    except ValueError:
        return resp.status, None


def discover_model(target: Target, timeout: float = 5.0) -> Optional[str]:
    """The first model id from ``/v1/models``, or None when the list is unusable.

    mlx_lm.server answers with an empty body when no Hugging Face cache exists;
    then requests are sent without a "model" field (servers use their default).
    Raises ServerError only when nothing listens at the URL.
    """
    try:
        status, data = get_json(target, "/v1/models", timeout)
    except (ConnectionError, OSError) as e:
        raise ServerError(f"cannot connect to {target.url}: {e}") from e
    if status == 200 and isinstance(data, dict):
        models = data.get("data") or []
        if models and isinstance(models[0], dict) and models[0].get("id"):
            return str(models[0]["id"])
    return None


def wait_ready(target: Target, timeout: float, interval: float = 0.25) -> bool:
    """Poll until the server accepts connections (any HTTP answer) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, _ = get_json(target, "/health", timeout=2.0)
            if status < 500:
                return True
        except (ConnectionError, OSError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _iter_sse(resp):
    """Yield the data payload of each server-sent event (str)."""
    data: List[str] = []
    while True:
        raw = resp.readline()
        if not raw:
            break
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        if line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _chunk_text(chunk: dict) -> str:
    """The generated text in one streamed chunk (content, reasoning or tool-call args)."""
    out = []
    for ch in chunk.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        if isinstance(ch.get("text"), str):  # /v1/completions
            out.append(ch["text"])
        delta = ch.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                out.append(delta[key])
        for tc in delta.get("tool_calls") or []:
            fn = (tc or {}).get("function") or {}
            out.append(str(fn.get("name") or "") + str(fn.get("arguments") or ""))
    return "".join(out)


def _mtp_block(chunk: dict) -> Optional[dict]:
    for holder in (chunk, chunk.get("usage") or {}, chunk.get("timings") or {}):
        if isinstance(holder, dict) and isinstance(holder.get("mtp"), dict):
            return holder["mtp"]
    return None


def stream_request(target: Target, prompt: str, max_tokens: int, *, temperature: float = 0.0,
                   endpoint: str = "chat", timeout: float = 300.0, ignore_eos: bool = False,
                   extra_body: Optional[dict] = None, label: str = "") -> RequestResult:
    """Send one streaming request and time it. Never raises for server-side problems."""
    body: Dict = {"max_tokens": max_tokens, "stream": True, "temperature": temperature,
                  "stream_options": {"include_usage": True}}
    if target.model is not None:
        body["model"] = target.model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    body.update(target.extra_body or {})
    res = RequestResult(ok=False, prompt=label)
    conn, base = _connection(target.url, timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", base + path, body=json.dumps(body).encode(),
                     headers=_headers(target, {"Content-Type": "application/json",
                                               "Accept": "text/event-stream"}))
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
            return res
        n_chunks_done = False
        for data in _iter_sse(resp):
            if data.strip() == "[DONE]":
                n_chunks_done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                err = chunk["error"]
                res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                return res
            text = _chunk_text(chunk)
            if text:
                now = time.perf_counter() - t0
                if res.ttft is None:
                    res.ttft = now
                res.chunk_times.append(now)
                res.text_chars += len(text)
            for ch in chunk.get("choices") or []:
                if isinstance(ch, dict) and ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
            usage = chunk.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                res.completion_tokens = int(usage["completion_tokens"])
                res.prompt_tokens = usage.get("prompt_tokens")
                res.tokens_from_usage = True
            if isinstance(chunk.get("timings"), dict):
                res.timings = chunk["timings"]
            mtp = _mtp_block(chunk)
            if mtp is not None:
                res.mtp = mtp
        res.e2e = time.perf_counter() - t0
        if not res.tokens_from_usage:
            res.completion_tokens = len(res.chunk_times)
        if res.ttft is None and res.completion_tokens == 0 and not n_chunks_done:
            res.error = "the stream ended without content or [DONE]"
            return res
        res.ok = True
        return res
    except (OSError, http.client.HTTPException) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        if not res.e2e:
            res.e2e = time.perf_counter() - t0
        conn.close()


# --- one concurrency level --------------------------------------------------------------
def run_level(target: Target, prompts: Sequence[Prompt], concurrency: int, rounds: int,
              max_tokens: int, tick: Callable[[], None] = lambda: None, **req_kw) -> dict:
    """``concurrency`` workers x ``rounds`` requests each. Returns raw results + wall time."""
    results: List[Optional[RequestResult]] = [None] * (concurrency * rounds)
    lock = threading.Lock()

    def worker(w: int):
        for r in range(rounds):
            i = w * rounds + r
            p = prompts[(w + r * concurrency) % len(prompts)]
            res = stream_request(target, p.text, max_tokens, label=p.name, **req_kw)
            results[i] = res
            with lock:
                tick()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True)
               for w in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall": wall, "results": [r for r in results if r is not None]}


def summarize_level(target: Target, concurrency: int, wall: float,
                    results: List[RequestResult]) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    row = {
        "server": target.label, "url": target.url, "model": target.model,
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "wall_s": wall, "completion_tokens": tokens,
        "aggregate_tps": tokens / wall if wall > 0 else 0.0,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else False,
        "chunks": sum(len(r.chunk_times) for r in ok),
    }
    for name, data in (("ttft", [r.ttft for r in ok if r.ttft is not None]),
                       ("itl", itls), ("tpot", [r.tpot for r in ok if r.tpot is not None]),
                       ("e2e", [r.e2e for r in ok])):
        s = st.summarize(data)
        for k in ("mean", "p50", "p95", "p99", "min", "max"):
            row[f"{name}_{k}_ms"] = s[k] * 1e3 if data else None
    per_req = [r.tps for r in ok if r.tps is not None]
    row["request_tps_mean"] = st.mean(per_req) if per_req else None
    row["request_tps_p50"] = st.median(per_req) if per_req else None
    row["request_tps_min"] = min(per_req) if per_req else None
    row["tokens_per_chunk"] = tokens / row["chunks"] if row["chunks"] else None
    row.update(spec_stats(ok))
    return row


def spec_stats(results: List[RequestResult]) -> dict:
    """Sum the speculative statistics the server reported (None when it reported none)."""
    out: dict = {"draft_n": None, "draft_n_accepted": None, "mtp_num_drafts": None,
                 "mtp_num_draft_tokens": None, "mtp_num_accepted_tokens": None,
                 "mtp_mean_acceptance_length": None, "mtp_accepted_per_pos": None,
                 "mtp_acceptance_per_pos": None, "acceptance_rate": None}
    tim = [r.timings for r in results if r.timings and "draft_n" in r.timings]
    if tim:
        out["draft_n"] = sum(int(t.get("draft_n") or 0) for t in tim)
        out["draft_n_accepted"] = sum(int(t.get("draft_n_accepted") or 0) for t in tim)
        if out["draft_n"]:
            out["acceptance_rate"] = out["draft_n_accepted"] / out["draft_n"]
    blocks = [r.mtp for r in results if r.mtp]
    if blocks:
        nd = sum(int(b.get("num_drafts") or 0) for b in blocks)
        ndt = sum(int(b.get("num_draft_tokens") or 0) for b in blocks)
        na = sum(int(b.get("num_accepted_tokens") or 0) for b in blocks)
        per_pos = _sum_lists(b.get("accepted_per_pos") for b in blocks)
        # Drafts per position (mlx-mtp reports them: K varies per step); else num_drafts.
        drafted = (_sum_lists(b.get("drafted_per_pos") for b in blocks)
                   if all("drafted_per_pos" in b for b in blocks) else [nd] * len(per_pos))
        out.update(mtp_num_drafts=nd, mtp_num_draft_tokens=ndt, mtp_num_accepted_tokens=na,
                   mtp_mean_acceptance_length=1 + na / nd if nd else None,
                   mtp_accepted_per_pos=per_pos,
                   mtp_acceptance_per_pos=[a / d if d else 0.0 for a, d in zip(per_pos, drafted)]
                   if nd else None)
        if ndt:
            out["acceptance_rate"] = na / ndt
    return out


def _sum_lists(lists) -> List[int]:
    out: List[int] = []
    for values in lists:
        for j, v in enumerate(values or []):
            if len(out) <= j:
                out.append(0)
            out[j] += int(v)
    return out


# --- driver -----------------------------------------------------------------------------
def resolve_targets(targets: List[Target], wait: float = 0.0) -> List[str]:
    """Check each server answers; fill in model ids from /v1/models. Returns notes."""
    notes = []
    for t in targets:
        if wait > 0 and not wait_ready(t, wait):
            raise ServerError(f"{t.url} did not answer within {wait:.0f} s")
        found = discover_model(t)
        if t.model is None:
            if found is None:
                notes.append(f"{t.label}: /v1/models gave no model id; sending requests "
                             "without a 'model' field (the server's default model)")
            t.model = found
    return notes


def run_server_bench(targets: List[Target], prompts: Sequence[Prompt], levels: Sequence[int],
                     rounds: int, max_tokens: int, warmup: bool = True,
                     tick: Callable[[], None] = lambda: None, passes: int = 1, **req_kw) -> dict:
    """Run every level on every target, alternating targets within a level.

    With ``passes`` > 1 each level runs that many times per target in A B B A ...
    order (a linear drift then costs both alike); a target's row pools its passes
    (tokens over summed wall time) and keeps each pass's throughput.
    """
    if warmup:
        for t in targets:
            w = stream_request(t, prompts[0].text, min(8, max_tokens), **req_kw)
            if not w.ok:
                raise ServerError(f"warm-up request to {t.url} failed: {w.error}")
    rows, requests = [], []
    for c in levels:
        runs = {id(t): [] for t in targets}
        for p in range(passes):
            for t in (targets if p % 2 == 0 else targets[::-1]):
                out = run_level(t, prompts, c, rounds, max_tokens, tick, **req_kw)
                runs[id(t)].append(out)
                for r in out["results"]:
                    requests.append({"server": t.label, "concurrency": c, "pass": p,
                                     **r.to_dict()})
        for t in targets:
            outs = runs[id(t)]
            row = summarize_level(t, c, sum(o["wall"] for o in outs),
                                  [r for o in outs for r in o["results"]])
            row["pass_aggregate_tps"] = [
                sum(r.completion_tokens for r in o["results"] if r.ok) / o["wall"]
                if o["wall"] > 0 else 0.0 for o in outs]
            rows.append(row)
    return {"levels": rows, "requests": requests}


def request_units(levels: Sequence[int], rounds: int, n_targets: int) -> int:
    return sum(levels) * rounds * n_targets
