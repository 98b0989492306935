"""`rlengine serve` in a subprocess on a free 127.0.0.1 port, for the tests in tests/serve.

    server = start_server(["--model", "tiny", "--batch-invariant"], log_dir=tmp_path)
    server.base_url  # http://127.0.0.1:PORT/v1, for openai.OpenAI(base_url=..., api_key=...)
    scrape(server.url)["rlengine_kv_blocks_used"]; server.stop()  # SIGTERM, then the exit code

A subprocess (not a thread of the test process) so the server's memory is its own (the RSS test reads
process_resident_memory_bytes from its /metrics) and SIGTERM reaches a real main thread. The port is
picked by binding port 0 and releasing it; if another process takes it first the server fails to
start, and start_server retries on a new port. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running `rlengine serve` process."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for the exit (killed after `timeout` s); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(args: list[str], *, log_dir: Path, tries: int = 3) -> Server:
    """Start `python -m rlengine serve ARGS --host 127.0.0.1 --port P` and wait until /health answers."""
    for attempt in range(tries):
        port = free_port()
        log = log_dir / f"serve-{port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "rlengine", "serve", *args, "--host", "127.0.0.1",
                                     "--port", str(port), "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT,
                                    env=env)
        server = Server(proc, port, log)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        server.stop(5)
        if "address already in use" not in log.read_text().lower() or attempt == tries - 1:
            raise RuntimeError(f"rlengine serve did not start (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    raise AssertionError("unreachable")


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """GET /metrics -> {sample: value}, a sample named by its metric name plus its labels other than
    model_name: "rlengine_kv_blocks_used", 'rlengine_request_finished_total{finished_reason="abort"}'."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, labels = sample.partition("{")
        rest = [kv for kv in labels.rstrip("}").split(",") if kv and not kv.startswith("model_name=")]
        out[f"{name}{{{','.join(rest)}}}" if rest else name] = float(value)
    return out
