"""``mlx-mtp serve`` as a real process on 127.0.0.1, for tests that talk to it over HTTP.

One helper for every such test module: ``ServerProcess(ckpt, workdir, *flags)`` starts the
server and waits until ``/health`` answers; with ``wait=False`` it returns at once, so
several servers can start together, and ``wait()`` is called later.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT = 180.0  # seconds; two cores shared by several test runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, **labels) -> float:
    """One sample of the server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()):
                return s.value
    raise KeyError(name)


class ServerProcess:
    def __init__(self, ckpt: Path, workdir: Path, *flags, wait: bool = True,
                 timeout: float = START_TIMEOUT):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(workdir) / f"server-{self.port}.log"
        self.hf_home = Path(workdir) / f"hf-home-must-not-exist-{self.port}"
        # Exact-equality checks (batched == alone) need a row-invariant BLAS; the
        # OpenBLAS path is covered by tests/test_fast_blas.py.
        env = dict(os.environ, HF_HOME=str(self.hf_home), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", MLX_MTP_BLAS="reference")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_mtp.cli", "serve", "--model", str(ckpt),
             "--port", str(self.port), "--log-level", "WARNING", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait(timeout)

    def wait(self, timeout: float = START_TIMEOUT):
        """Return once ``/health`` answers 200; kill the process and raise if it exits
        or does not get there within ``timeout`` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def metric(self, name: str, **labels) -> float:
        return metric(self.url, name, **labels)

    def stop(self, sig=signal.SIGINT, timeout=20) -> int:
        """Send ``sig`` and wait for the exit code (AssertionError if it is ignored)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server ignored signal {sig}:\n{self.logs()}")
        self.log.close()
        return self.proc.returncode
