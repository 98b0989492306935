"""`rlengine serve` as a command: the missing-extra message, graceful shutdown on SIGTERM, the package's
place in the layering, and `rlengine bench serve --url` against a running server.
"""

import json
import signal
import sys
import threading
import time

import httpx
import pytest

from rlengine.benchmarks import serve as bench_serve
from rlengine.cli import main

from tests.support.http_server import start_server
from tests.test_package_layout import import_graph


@pytest.mark.parametrize("module", ["fastapi", "uvicorn"])
def test_without_the_serve_extra_it_prints_one_line_and_exits_2(monkeypatch, capsys, module):
    monkeypatch.setitem(sys.modules, module, None)  # importlib.util.find_spec -> None: "not installed"
    assert main(["serve", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rlengine[serve]" in err[0] and module in err[0]


def test_only_the_cli_imports_rlengine_serve():
    importers = {a for a, deps in import_graph().items() if any(d == "rlengine.serve" or d.startswith("rlengine.serve.")
                                                                  for d in deps)}
    assert importers and all(a.startswith(("rlengine.cli", "rlengine.serve")) for a in importers), importers


def _stream(url, body, log):
    """POST a streamed completion, appending each event to `log` (a list shared with the test)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    log.append(line[6:])
    except httpx.HTTPError as exc:
        log.append(f"error: {type(exc).__name__}")


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(tmp_path):
    server = start_server(["--model", "qwen3-30m", "--max-model-len", "4096", "--shutdown-timeout", "2",
                           "--threads", "1"], log_dir=tmp_path)
    try:
        body = {"model": "qwen3-30m", "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        long_log, short_log = [], []
        long = threading.Thread(target=_stream, args=(server.url, {**body, "prompt": [5, 6], "max_tokens": 4000},
                                                      long_log))
        long.start()
        deadline = time.monotonic() + 30
        while not long_log and time.monotonic() < deadline:
            time.sleep(0.01)
        short = threading.Thread(target=_stream, args=(server.url, {**body, "prompt": [7, 8], "max_tokens": 12},
                                                       short_log))
        short.start()
        while not short_log and time.monotonic() < deadline:
            time.sleep(0.01)
        assert long_log and short_log, "no first tokens within 30 s"
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # no new request is admitted: 503 while draining, or the listening socket is closed
            r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": [1], "max_tokens": 1}, timeout=5)
            assert r.status_code == 503, r.text
        except httpx.TransportError:
            pass
        assert server.proc.wait(30) == 0, server.log.read_text()[-2000:]
        assert time.monotonic() - t0 < 2 + 10  # the deadline, plus the app's and the interpreter's teardown
        long.join(10)
        short.join(10)
    finally:
        server.stop(5)
    assert short_log[-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0] for e in short_log[:-1]]
    assert finals[-1]["finish_reason"] == "length"
    assert sum(len(c["token_ids"]) for c in finals) == 12  # every token of the short request arrived
    # the long request was ended at the deadline as a normal stream: finish_reason "abort", then [DONE]
    assert long_log[-1] == "[DONE]", long_log[-3:]
    assert json.loads(long_log[-2])["choices"][0]["finish_reason"] == "abort"
    assert sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in long_log[:-1]) < 4000


def test_bench_serve_over_http_gives_rows_beside_the_in_process_ones(tiny_server, tmp_path, capsys):
    assert bench_serve.main(["--model", "tiny", "--url", tiny_server.url, "--num-requests", "6", "--request-rate",
                             "inf", "--input-len", "6", "--output-len", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert [r["client"] for r in rows] == ["in-process", "http"]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 24
        # TPOT is (E2EL - TTFT) / (tokens - 1): 0 when a stream that fell behind got all 4 tokens in its first chunk
        assert r["median_ttft_ms"] > 0 and r["median_tpot_ms"] >= 0 and r["median_e2el_ms"] >= r["median_ttft_ms"]
    assert "http" in capsys.readouterr().out
