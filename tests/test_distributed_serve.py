"""``mlx-mtp serve`` over two local ranks (ring backend, under mlx.launch as users start it;
other modules' clusters start the ranks as mlx.launch does, without it), both split modes.

Rank 0 serves HTTP; rank 1 replays its engine steps. Greedy answers (chat, stream,
concurrent requests) must equal a single-process server's, byte for byte. Then each
mode loses a rank on purpose: a follower that stops answering fails in-flight and new
requests with a 503 envelope within the watchdog's timeout and ``/health`` says so; a
SIGTERM to rank 0 fails in-flight requests with a 503 and every rank exits.
"""

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess, free_port, metric
from rank_jobs import free_port_base, rank_envs, rank_pids, yield_cores
from test_distributed import LAUNCH

START_TIMEOUT = 300.0  # two cold ranks on a loaded 2-core machine
WATCHDOG = 15.0  # --distributed-timeout of the test servers
EXIT_TIMEOUT = 60.0
PROMPTS = ["hello there", "def fibonacci(n):", "import os\nimport sys\n"]
MAX_TOKENS = 12
GENERATED = "mlx_mtp:generation_tokens_total"


def chat(url: str, content: str, timeout: float = 120.0, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def stream_text(url: str, content: str) -> str:
    import json

    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "stream": True}
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


class Cluster:
    """``mlx-mtp serve --distributed MODE`` on two local ranks (ring backend). With
    ``launcher``: under ``mlx.launch -n 2 --backend ring``, as users start it; without: both
    ranks started directly as mlx.launch starts them (``rank_jobs.rank_envs``), saving the
    launcher's start and its busy output threads, for tests not about mlx.launch itself."""

    def __init__(self, ckpt: Path, workdir: Path, mode: str, *flags, launcher: bool = False,
                 wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"cluster-{mode}-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", MLX_MTP_BLAS="reference",
                   HF_HOME=str(workdir / "hf-home-must-not-exist"))
        serve = [sys.executable, "-m", "mlx_mtp.cli", "serve",
                 "--model", str(ckpt), "--port", str(self.port), "--temp", "0",
                 "--distributed", mode, "--distributed-timeout", str(WATCHDOG),
                 "--log-level", "WARNING", *flags]
        # Own sessions: the whole group can be killed whatever a test did to it.
        self.launcher = launcher
        if launcher:
            cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port",
                   str(free_port_base()), "--", *serve]
            self.procs = [subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)]
            threading.Thread(target=yield_cores, args=self.procs, daemon=True).start()
        else:
            self.procs = [subprocess.Popen(serve, stdout=self.log, stderr=subprocess.STDOUT,
                                           env=e, start_new_session=True)
                          for e in rank_envs(workdir, env)]
        if wait:
            self.wait()

    def wait(self, timeout: float = START_TIMEOUT):
        """Return once rank 0's ``/health`` answers 200 (within ``timeout`` from now); kill
        every process and raise if one exits or it does not get there."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                logs = self.logs()
                self.kill()
                raise RuntimeError(f"a rank or mlx.launch exited:\n{logs}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            logs = self.logs()
            self.kill()
            raise RuntimeError(f"the cluster did not become healthy:\n{logs}")
        self.ranks = (rank_pids(self.procs[0].pid) if self.launcher else
                      {r: p.pid for r, p in enumerate(self.procs)})
        assert sorted(self.ranks) == [0, 1], self.ranks

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait_exit(self, timeout: float = EXIT_TIMEOUT) -> int:
        """The exit code: mlx.launch's, or the first rank's that is not 0."""
        deadline = time.time() + timeout
        try:
            codes = [p.wait(max(deadline - time.time(), 0.01)) for p in self.procs]
        except subprocess.TimeoutExpired:
            alive = [p for p in self.ranks.values() if Path(f"/proc/{p}").exists()]
            logs = self.logs()
            self.kill()
            raise AssertionError(f"not every rank exited in {timeout}s (alive: {alive}):\n"
                                 f"{logs}")
        return next((c for c in codes if c != 0), 0)

    def kill(self):
        for p in self.procs:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            p.wait(30)
        self.log.close()


@contextlib.contextmanager
def served_together(specs: dict, root: Path):
    """{name: (one-process server, cluster)} for ``specs`` {name: (checkpoint, mode, flags)}
    (the server's flags: ``--temp 0`` and ``flags``; the cluster's: ``flags``), every process
    started at once, none waited for: a test waits for its own, whose start overlapped the
    tests before it (their reference requests, a watchdog's wait). All stop at the end."""
    out = {}
    try:
        for name, (ckpt, mode, flags) in specs.items():
            work = root / f"served-{name}"
            work.mkdir()
            out[name] = (ServerProcess(ckpt, work, "--temp", "0", *flags, wait=False),
                         Cluster(ckpt, work, mode, *flags, wait=False))
        yield out
    finally:
        for server, cluster in out.values():
            server.stop()
            cluster.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_mtp.testing.tiny import make_tiny

    # MoE whose answers depend on the prompt and whose head is right a few % of the time
    # (drafts accepted and rejected); the tokenizer's whole vocabulary, so text prompts
    # stay in range.
    return make_tiny(tmp_path_factory.mktemp("dserve") / "m", "qwen3_5_moe", head="noisy",
                     trunk_scale=4.0, seed=5, vocab_size=4096)


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    """The single-process server, started without waiting (the first cluster starts
    meanwhile)."""
    server = ServerProcess(model, tmp_path_factory.mktemp("single"), "--temp", "0",
                           wait=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(single):
    """The single-process server's greedy answers."""
    single.wait()
    try:
        return {p: chat(single.url, p).json()["choices"][0]["message"]["content"]
                for p in PROMPTS}
    finally:
        single.stop()


# pipeline: always K=2 (every step drafts and rolls back); tensor: K adapts (rank 0's
# draft policy, calibrated at start on every rank, picks K for all).
FLAGS = {"pipeline": ["--num-draft-tokens", "2", "--fixed-k"], "tensor": []}


@pytest.fixture(scope="module")
def clusters(model, single, tmp_path_factory):  # ``single``: starts first
    """Every cluster of this module under mlx.launch (as users start it), started at once, none
    waited for: later ones start while the first answers and waits for its watchdog."""
    out = {}
    try:
        for name, mode, flags in (("pipeline", "pipeline", FLAGS["pipeline"]),
                                  ("tensor", "tensor", FLAGS["tensor"]),
                                  ("killed", "pipeline", [])):
            out[name] = Cluster(model, tmp_path_factory.mktemp(name), mode, *flags,
                                launcher=True, wait=False)
        yield out
    finally:
        for c in out.values():
            c.kill()


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def cluster(request, clusters):
    c = clusters[request.param]
    c.mode = request.param
    c.wait()
    return c


def test_chat_stream_and_concurrent_equal_single_process(cluster, expected):
    assert len(set(expected.values())) == len(PROMPTS)  # answers tell prompts apart
    for p in PROMPTS:
        r = chat(cluster.url, p)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == expected[p]
        if cluster.mode == "pipeline":  # MTP ran inside the distributed batch
            assert body["mtp"]["num_draft_tokens"] > 0
    assert stream_text(cluster.url, PROMPTS[1]) == expected[PROMPTS[1]]
    # Several rows in one batch, joining at different steps; prefix-cache hits too.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [(p, pool.submit(chat, cluster.url, p)) for p in PROMPTS * 2]
        for p, job in jobs:
            r = job.result()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected[p]
    assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200


def decoding(url: str, before: float, timeout: float = 120.0):
    """Return once rank 0 generated tokens past ``before`` (its count before a request):
    the request in flight decodes. (A fixed sleep raced with fast clusters: a long request
    can still end within seconds.)"""
    deadline = time.time() + timeout
    while metric(url, GENERATED) < before + 2:
        assert time.time() < deadline, "the request did not start decoding"
        time.sleep(0.05)


def eos_ids(ckpt) -> list:
    from mlx_mtp.models.io.loader import load_config, load_tokenizer

    return sorted(load_tokenizer(ckpt, load_config(ckpt)).eos_token_ids)


def test_lost_rank_fails_requests_with_503_and_every_rank_exits(cluster, model):
    # A request still decoding when the rank goes: no end of sequence, many tokens.
    long = {"max_tokens": 3000, "logit_bias": {str(t): -100 for t in eos_ids(model)}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start, before = time.time(), metric(cluster.url, GENERATED)
        inflight = pool.submit(chat, cluster.url, PROMPTS[0], 180.0, **long)
        decoding(cluster.url, before)
        if cluster.mode == "pipeline":
            # A follower that hangs: the ring blocks, rank 0's watchdog notices.
            os.kill(cluster.ranks[1], signal.SIGSTOP)
            r = inflight.result()
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "distributed_rank_lost"
            assert time.time() - start < WATCHDOG + 60
            assert httpx.get(cluster.url + "/health", timeout=5).status_code == 503
            again = chat(cluster.url, PROMPTS[1], 30.0)
            assert again.status_code == 503 and again.json()["error"]["type"] == \
                "service_unavailable_error"
            assert again.json()["error"]["code"] == "distributed_rank_lost"
            # SIGTERM to rank 0 while its engine thread sits in the blocked collective:
            # rank 0 still exits.
            os.kill(cluster.ranks[0], signal.SIGTERM)
            deadline = time.time() + EXIT_TIMEOUT
            while Path(f"/proc/{cluster.ranks[0]}").exists() and time.time() < deadline:
                if Path(f"/proc/{cluster.ranks[0]}/stat").read_text().split()[2] == "Z":
                    break  # exited; the launcher has not reaped it yet
                time.sleep(0.5)
            assert time.time() < deadline, "rank 0 ignored SIGTERM"
            os.kill(cluster.ranks[1], signal.SIGKILL)
            cluster.wait_exit()
        else:
            # SIGTERM to rank 0: in-flight requests get a 503, the follower is told to stop.
            os.kill(cluster.ranks[0], signal.SIGTERM)
            r = inflight.result()
            assert r.status_code == 503, r.text
            assert cluster.wait_exit() == 0


def test_killed_follower_fails_requests_with_503(model, clusters):
    # A follower process that dies (its sockets close): the in-flight request gets a 503
    # at once, whichever notices first (rank 0's next collective raises, or mlx.launch
    # stops rank 0 because a rank exited with an error), and every process exits.
    cluster = clusters["killed"]
    cluster.wait()
    try:
        long = {"max_tokens": 3000, "logit_bias": {str(t): -100 for t in eos_ids(model)}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            before = metric(cluster.url, GENERATED)
            inflight = pool.submit(chat, cluster.url, PROMPTS[0], 180.0, **long)
            decoding(cluster.url, before)
            killed = time.time()
            os.kill(cluster.ranks[1], signal.SIGKILL)
            r = inflight.result()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert time.time() - killed < WATCHDOG  # not the watchdog: the closed sockets
        cluster.wait_exit()
    finally:
        cluster.kill()


def test_follower_replays_the_engine_step_for_step(model):
    """In one process (a group of one): rank 0's engine records its messages, and a
    ``Follower`` on a second copy of the model replays them; every row's tokens match
    (joins at different steps, K per row, a prefix-cache restore, sampled rows seeded
    and not, a cancelled row), and an iteration sends one message per prompt chunk and
    one per decode step, nothing more."""
    import json

    import mlx.core as mx

    from mlx_mtp.decode.sampling import SamplingParams
    from mlx_mtp.models.distributed import load_distributed
    from mlx_mtp.server.distributed import Follower, LeaderSync
    from mlx_mtp.server.engine import Engine
    from mlx_mtp.server.events import Done, EngineRequest
    from mlx_mtp.server.prefix_cache import PrefixCache

    group = mx.distributed.init()
    assert group.size() == 1
    leader, tokenizer = load_distributed(str(model), "pipeline", group)
    messages = []

    def record(payload=None):
        messages.append(payload)
        return payload

    leader.broadcast = record
    sync = LeaderSync(leader)
    sync.idle_seconds = 3600.0  # no heartbeats: every message carries model work
    engine = Engine(leader, tokenizer, num_draft_tokens=2, adaptive=False, prefill_step_size=64,
                    prefix_cache=PrefixCache(8, 1 << 30), sync=sync, calibrate=False,
                    log_interval=0)
    sync.attach(engine)
    emitted, done, rows = {}, set(), {}
    admitted = sync.admitted

    def admit(seq, entry):
        admitted(seq, entry)
        rows[seq.req.request_id] = sync.rows[seq.req.request_id]

    sync.admitted = admit
    base = [(7 * i + 3) % 4000 for i in range(150)]  # two prompt chunks and a boundary

    def request(prompt, **kw) -> EngineRequest:
        def on_event(ev):
            if isinstance(ev, Done):
                done.add(req.request_id)
            elif hasattr(ev, "token_ids"):
                emitted.setdefault(req.request_id, []).extend(ev.token_ids)
        req = EngineRequest(prompt=prompt, on_event=on_event, **{"max_tokens": 10, **kw})
        return req

    first = [request(base, boundaries=[100]),
             request([5, 17, 301, 44, 9], sampling=SamplingParams(temperature=1.0, seed=3)),
             request([11, 12, 13], sampling=SamplingParams(temperature=0.8))]
    later = [request(base[:101] + [1, 2, 3]),  # restores the entry stored at 100
             request([40, 41, 42, 43], num_draft_tokens=1)]
    cancelled = request([9, 8, 7, 6, 5], max_tokens=1000)
    for r in first + [cancelled]:
        engine.submit(r)
    per_iteration, n, stored = [], 0, False
    while engine.step() or engine.num_waiting:
        ops = [op for m in messages[n:] for op in json.loads(m)["ops"]]
        work = sum(op[0] in ("prefill", "step") for op in ops)
        per_iteration.append((len(messages) - n, work))
        n = len(messages)
        if not stored and (stored := sync.entries != {}):  # the prefix at 100 is cached
            engine.cancel(cancelled)
            for r in later:
                engine.submit(r)
    sync.stopped()
    assert done == {r.request_id for r in first + later}
    ops = [op for m in messages for op in json.loads(m)["ops"]]
    assert any(op[0] == "admit" and op[6] is not None for op in ops)  # a restored prefix
    assert any(op[0] == "step" and len(set(op[1])) > 1 for op in ops)  # K differs by row
    assert all(count == work for count, work in per_iteration[1:]), per_iteration
    assert any(work == 1 for _, work in per_iteration)  # decode-only iterations: 1 message

    class Recording(Follower):
        tokens = {}  # row id -> every token its steps produced

        def _step(self, ks):
            self.next_ks = ks
            for rid, out in self.batch.step().items():
                self.tokens.setdefault(rid, []).extend(out.tokens)

    replica, _ = load_distributed(str(model), "pipeline", group)
    feed = iter(messages)
    replica.broadcast = lambda payload=None: next(feed)
    follower = Recording(replica)
    assert follower.run() == 0  # the last message says stop
    for r in first + later:
        ids = emitted[r.request_id]
        assert follower.tokens[rows[r.request_id]][: len(ids)] == ids, r.request_id


def test_follower_watchdog_ends_with_its_loop():
    # The watchdog exits the process when rank 0 goes silent; once the loop has returned
    # it must not (it killed the test process two minutes after the replay test).
    import json as _json
    import threading

    from mlx_mtp.server.distributed import Follower

    class Stub:
        def broadcast(self, payload=None):
            return _json.dumps({"seq": 0, "ops": [["stop"]]})

    before = set(threading.enumerate())
    follower = Follower(Stub(), timeout=0.01)
    assert follower.run() == 0
    watchdogs = [t for t in threading.enumerate()
                 if t not in before and t.name == "mlx-mtp-watchdog"]
    for t in watchdogs:  # past timeout + heartbeat: with the old watchdog this process exits(1)
        t.join(2.5)
    assert not [t for t in watchdogs if t.is_alive()]
