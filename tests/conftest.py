"""Settings for the whole suite: deterministic fp32, Triton through its interpreter, gpu marker handling,
and the fixtures that test files in several folders share.

Test folders are packages (tests/__init__.py), so pytest imports each file by its dotted name
(tests.engine.test_sampler) with the repository root on sys.path: two files may share a basename in
different folders, and helpers are imported as `from tests.support.hf_models import ...`.
"""

import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in this test tier.
os.environ.setdefault("TRITON_INTERPRET", "1")

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    # Without a GPU the gpu-marked tests are deselected (not skipped): they cannot run here.
    keep = [item for item in items if "gpu" not in item.keywords]
    dropped = [item for item in items if "gpu" in item.keywords]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """One text checkpoint (tests/support/text_ckpt.py) per test session, read-only: copy it before
    editing weights. Used by the tokenizer / chat-template tests and the engine's text API tests."""
    from tests.support.text_ckpt import build_text_checkpoint

    return build_text_checkpoint(tmp_path_factory.mktemp("text_ckpt") / "ckpt")
