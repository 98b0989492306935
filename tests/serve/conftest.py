"""Servers for the serve tests: `rlengine serve` in a subprocess on a free 127.0.0.1 port
(tests/support/http_server.py), one per session and model, stopped with SIGTERM at the end.

text_server: the text checkpoint (byte-level BPE, ChatML chat template; tests/support/text_ckpt.py)
with an API key, batch-invariant so its outputs equal the in-process LLM's bit for bit whatever the
server batches together. tiny_server: the tiny preset (the built-in tokenizer has no chat template),
batch-invariant, no key: the load tests. One torch thread each: the tiny models gain nothing from two,
and on a loaded 2-core machine a second OpenMP thread turns a millisecond step into tens of them.
"""

import openai
import pytest

from rlengine import LLM

from tests.support.http_server import start_server

API_KEY = "test-key-123"
TEXT_MODEL = "text-ckpt"


@pytest.fixture(scope="session")
def text_server(text_checkpoint, tmp_path_factory):
    server = start_server(["--model", str(text_checkpoint.path), "--served-model-name", TEXT_MODEL,
                           "--batch-invariant", "--api-key", API_KEY, "--max-num-seqs", "16", "--threads", "1"],
                          log_dir=tmp_path_factory.mktemp("serve_text"))
    yield server
    assert server.stop() == 0, server.log.read_text()[-2000:]


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    server = start_server(["--model", "tiny", "--batch-invariant", "--max-num-seqs", "64", "--threads", "1"],
                          log_dir=tmp_path_factory.mktemp("serve_tiny"))
    yield server
    assert server.stop() == 0, server.log.read_text()[-2000:]


@pytest.fixture(scope="session")
def text_llm(text_checkpoint):
    """The reference: the same checkpoint in process, batch-invariant like the server."""
    return LLM(model=str(text_checkpoint.path), batch_invariant=True, max_num_seqs=16)


@pytest.fixture(scope="session")
def client(text_server):
    return openai.OpenAI(base_url=text_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
