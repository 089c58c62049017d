"""Many distributed cases on one pair of local ranks (ring backend), for the distributed tests.

``RankJobs`` starts a rank script on two ranks as ``mlx.launch -n 2 --backend ring`` starts
them (``MLX_RANK``, and ``MLX_HOSTFILE`` naming one local port per rank) but without the
launcher process: its output threads poll without sleeping and keep most of a core busy for
as long as the ranks run (measured on 12 family jobs under a shared load: 110 s under
mlx.launch, 30 s started directly). ``rank_envs`` is that environment, for the other
tests that start ranks: ``run_ranks`` (a command on two ranks, e.g. ``generate``) and
test_distributed_serve's ``Cluster`` (``serve``). mlx.launch itself stays tested where users
meet it, ``generate`` and ``serve`` under it (``launch`` in test_distributed.py,
``Cluster(..., launcher=True)`` in test_distributed_serve.py); there ``yield_cores`` puts its
threads last once the ranks run.

Starting two ranks (Python, MLX, mlx-lm, transformers) costs more than a tiny model's
decodes, so a test module writes every case as a job and one pair of ranks runs them all;
each rank writes one result per job and the tests are parametrised over the jobs, so a
failure still names its case. In a test module::

    with RankJobs(SCRIPT, jobs, workdir) as ranks:  # the ranks start; this returns at once
        expected = ...                      # single-process references, while the ranks run
        results = ranks.results()           # {job name: (rank 0 result, rank 1 result)}

and in the rank script ``serve_jobs(run)``, ``run(job, group)`` returning one JSON-able
result per job (``distributed_rank.py``).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

RANKS = 2
TIMEOUT = 600  # every job of a module on two ranks, on a shared, loaded 2-core machine


def free_port_base(n: int = 4) -> int:
    """A base port with ``n`` free ports after it (other engineers launch rings too)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def rank_pids(launcher_pid: int) -> dict:
    """{rank: pid} of mlx.launch's children (each rank's shell execs Python)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid:
            for var in env:
                if var.startswith(b"MLX_RANK="):
                    ranks[int(var[9:])] = int(entry.name)
    return ranks


def yield_cores(launcher: subprocess.Popen, timeout: float = 60.0):
    """Once mlx.launch has started its ranks (at the usual priority), its own threads run at
    the lowest: they poll without sleeping, and the ranks come first for the cores."""
    deadline = time.time() + timeout
    while len(rank_pids(launcher.pid)) < RANKS:
        if launcher.poll() is not None or time.time() > deadline:
            return
        time.sleep(0.1)
    try:
        threads = os.listdir(f"/proc/{launcher.pid}/task")
    except FileNotFoundError:  # it ended meanwhile
        return
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def rank_envs(workdir: Path, env: dict = None) -> list:
    """Each rank's environment as ``mlx.launch -n 2 --backend ring`` gives it: ``MLX_RANK``
    and ``MLX_HOSTFILE`` (written in ``workdir``) naming one free local port per rank."""
    base = free_port_base(RANKS)
    hosts = Path(workdir) / f"hosts-{base}.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(RANKS)]))
    return [dict(env or os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hosts))
            for r in range(RANKS)]


def run_ranks(argv: list, workdir: Path, timeout: float) -> subprocess.CompletedProcess:
    """``argv`` on two ranks started as mlx.launch starts them, for tests not about mlx.launch
    itself; the ranks' output joined in rank order, the first exit code that is not 0."""
    procs = [subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for env in rank_envs(workdir)]
    outs = []
    try:
        for p in procs:
            if procs[0].returncode:  # rank 0 failed: the others wait in a collective
                p.kill()
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return subprocess.CompletedProcess(argv, code, "".join(o for o, _ in outs),
                                       "".join(e for _, e in outs))


class RankFailed(AssertionError):
    """A rank exited with an error, or the ranks did not finish in time."""


class RankJobs:
    """``script`` on two local ranks over ``jobs`` (dicts, each with a unique "name"). A rank
    that fails stops the other (it would wait in a collective forever); ``results()`` then
    raises ``RankFailed`` with the job each rank was in and its stderr."""

    def __init__(self, script, jobs: list, workdir: Path, timeout: float = TIMEOUT):
        names = [j["name"] for j in jobs]
        assert len(set(names)) == len(names), "job names must be unique"
        self.jobs, self.dir, self.timeout = jobs, Path(workdir), timeout
        (self.dir / "jobs.json").write_text(json.dumps(jobs))
        argv = [sys.executable, str(script), str(self.dir / "jobs.json"), str(self.dir / "out")]
        self.start = time.time()
        self.procs = []
        for r, env in enumerate(rank_envs(self.dir)):
            with open(self.dir / f"rank{r}.stderr", "w") as err:
                self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.DEVNULL, stderr=err))

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # e.g. a failed reference: no rank outlives the test
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def results(self) -> dict:
        """Wait for both ranks; {job name: (rank 0 result, rank 1 result)}."""
        while any(c != 0 for c in (p.poll() for p in self.procs)):
            failed = [r for r, p in enumerate(self.procs) if p.returncode]
            if failed or time.time() - self.start > self.timeout:
                self.__exit__()
                head = (f"rank(s) {failed} failed" if failed else
                        f"the ranks did not finish in {self.timeout:.0f}s")
                raise RankFailed("\n".join([head] + [
                    f"rank {r} (exit {p.returncode}) {self._running(r)}:\n"
                    f"{(self.dir / f'rank{r}.stderr').read_text()[-2000:]}"
                    for r, p in enumerate(self.procs)]))
            time.sleep(0.2)
        per_rank = [json.loads((self.dir / f"out.{r}").read_text()) for r in range(RANKS)]
        return {j["name"]: tuple(r[i] for r in per_rank) for i, j in enumerate(self.jobs)}

    def _running(self, rank: int) -> str:
        log = self.dir / f"out.{rank}.log"
        started = log.read_text().split("\n") if log.exists() else []
        running = [s for s in started if s.startswith("start ")]
        return f"in job {running[-1][6:]!r}" if running else "before its first job"


def serve_jobs(run):
    """A rank script's main: ``run(job, group)`` for every job of ``argv[1]``, in order (every
    rank runs the same jobs: collectives pair up); the results go to ``<argv[2]>.<rank>``,
    progress to ``<argv[2]>.<rank>.log`` (which job a failed or stuck rank was running)."""
    import mlx.core as mx

    group = mx.distributed.init()
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = []
    with open(f"{sys.argv[2]}.{group.rank()}.log", "w") as log:
        for job in jobs:
            log.write(f"start {job['name']}\n")
            log.flush()
            results.append(run(job, group))
    Path(f"{sys.argv[2]}.{group.rank()}").write_text(json.dumps(results))
