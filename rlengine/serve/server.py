"""Run the app under uvicorn: `serve(llm, ...)` blocks until SIGTERM / SIGINT, then shuts down gracefully.

rlengine/cli builds the LLM from the command line and calls `serve`. Shutdown, on the first signal:
the engine loop stops admitting (new requests get 503) and uvicorn closes the listening socket; requests
in flight get `shutdown_timeout` seconds to finish, then the engine aborts the rest, so each ends as a
normal response with finish_reason "abort" (a stream with its `data: [DONE]`) rather than a cut
connection. uvicorn's own graceful deadline, a few seconds later, only backs that up. The app's
lifespan then stops the engine thread, and `serve` returns 0. uvicorn would re-raise the caught signal
after its shutdown (exit code 143 for SIGTERM); a graceful stop is a normal exit here, so the signal is
not re-raised. A second SIGINT forces the exit.
"""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn

from rlengine.engine.llm import LLM
from rlengine.model.config import ConfigError
from rlengine.serve.app import build_app
from rlengine.serve.engine_loop import EngineLoop
from rlengine.serve.metrics import ServerMetrics

log = logging.getLogger("rlengine.serve")
GRACE_S = 3.0  # after the engine aborted what was left: time for those final responses to be written


class _Server(uvicorn.Server):
    """uvicorn.Server whose signal handler first closes the engine loop to new requests."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop, deadline_s: float):
        super().__init__(config)
        self.engine, self.deadline_s = engine, deadline_s
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        self.engine.draining = True
        if self._deadline is None:
            self._deadline = threading.Timer(self.deadline_s, self.engine.abort_all)
            self._deadline.daemon = True
            self._deadline.start()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a graceful stop exits 0 (see the module docstring)


def build(llm: LLM, *, model_name: str, api_key: str | None = None, shutdown_timeout: float = 10.0):
    """The app and its engine loop for `llm` (not started: the app's lifespan starts the loop)."""
    metrics = ServerMetrics(model_name, kv_blocks_total=llm.block_manager.num_blocks)
    engine = EngineLoop(llm, metrics)
    app = build_app(engine, metrics, model_name=model_name, max_model_len=llm.max_model_len,
                    tokenizer=llm.tokenizer, api_key=api_key, stop_timeout=min(shutdown_timeout, 5.0))
    return app, engine


def check_address(host: str, port: int) -> None:
    """ConfigError naming --host / --port when the address cannot be bound (in use, or not this machine's),
    before the model's server starts (uvicorn would log it and exit 1)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot bind ({exc.strerror}); pick another port") from None


def serve(llm: LLM, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          shutdown_timeout: float = 10.0, log_level: str = "info", access_log: bool = False) -> int:
    """Serve until a signal; returns the exit code (0 after a graceful shutdown)."""
    check_address(host, port)
    app, engine = build(llm, model_name=model_name, api_key=api_key, shutdown_timeout=shutdown_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + GRACE_S, lifespan="on")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log.info("serving %s on http://%s:%d (max_model_len %d, %d KV blocks of %d tokens, max_num_seqs %d%s)",
             model_name, host, port, llm.max_model_len, llm.block_manager.num_blocks, llm.block_size,
             llm.max_num_seqs, ", API key required" if api_key else "")
    _Server(config, engine, shutdown_timeout).run()
    if engine.failed:
        log.error("the engine loop failed: %s", engine.failed)
        return 1
    return 0
