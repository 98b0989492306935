"""Negative controls for the GPU tier's checks: each planted kernel bug must fail them, so a check that
passes on a GPU is known to be able to fail.

A bug is planted by loading a copy of the kernel module whose source has one line changed (the
original file is untouched); the copy runs under TRITON_INTERPRET=1 in fp32 and fp16, through the
same check functions (tests/support/kernel_checks.py) and the same kind of inputs the GPU tests use.
Each test first shows the unchanged kernel passes, then that the mutant fails:
  - fused log-prob forward leaves one vocab tile out of the log-sum-exp (the combine step drops
    split 0, one tile wide; the target logits stay complete, so only the LSE is wrong);
  - fused log-prob backward drops the entropy term of d(logits);
  - paged decode stops one token early (the last token of a 2,049-token context is dropped);
  - paged decode starts every split one token late (off by one at the split boundary).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys

import pytest
import torch

from rlengine.kernels import fused_logprob, paged_decode

from tests.support.kernel_checks import assert_decode_close, check_logprob
from tests.support.paged_decode_cases import contiguous_sdpa, needle_case

DTYPES = [torch.float32, torch.float16]


def mutant(module, old: str, new: str, tmp_path):
    """A fresh copy of `module` with the single occurrence of `old` in its source replaced by `new`."""
    src = inspect.getsource(module)
    assert src.count(old) == 1, f"the line to mutate must occur once in {module.__name__}: {old!r}"
    path = tmp_path / f"{module.__name__.rsplit('.', 1)[-1]}_mutant.py"
    path.write_text(src.replace(old, new))
    name = f"{module.__name__}_mutant_{abs(hash(new))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(name, None)
    return mod


LOGPROB_BUGS = {  # (line, mutated line, forward vocab splits: 16 = one 32-wide tile per split)
    "lse-missing-vocab-tile": ("    s = (scale * s_S).sum(dim=0)\n", "    s = (scale * s_S)[1:].sum(dim=0)\n", 16),
    "gradient-missing-entropy-term": ("        dz -= g_e[:, None] * p * tl.where(valid, logp + ent[:, None], 0.0)\n",
                                      "        dz = dz\n", 1),
}


def _logprob_inputs(dtype):
    """The GPU test's recipe at interpreter size: odd T, 16 vocab tiles of 32, logits std ~2."""
    g = torch.Generator().manual_seed(0)
    T, C, V = 21, 16, 512
    h = torch.randn(T, C, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, C, generator=g) * (2.0 / math.sqrt(C))).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return h, w, targets, torch.randn(T, generator=g), torch.randn(T, generator=g)


def _fused(module, num_splits):
    cfg = module.LogProbConfig(block_m=16, block_n=32, block_k=16, num_splits=num_splits, group_m=2, num_warps=4,
                               num_stages=1, chunk_elems=2**20)
    return lambda h, w, t, return_entropy: module.fused_logprob(h, w, t, return_entropy=return_entropy, config=cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("bug", list(LOGPROB_BUGS))
def test_logprob_check_catches(bug, dtype, tmp_path):
    old, new, splits = LOGPROB_BUGS[bug]
    ref = fused_logprob.fused_logprob_ref
    check_logprob(_fused(fused_logprob, splits), ref, *_logprob_inputs(dtype))
    bad = mutant(fused_logprob, old, new, tmp_path)
    with pytest.raises(AssertionError):
        check_logprob(_fused(bad, splits), ref, *_logprob_inputs(dtype))


DECODE_BUGS = {
    # (where the needle sits, mutated line)
    "drops-last-token": ("last", ("    tok_end = tl.minimum(tok_begin + pages_per_split * P, ctx)\n",
                                  "    tok_end = tl.minimum(tok_begin + pages_per_split * P, ctx - 1)\n")),
    "split-starts-one-late": ("split-boundary", ("    tok_end = tl.minimum(tok_begin + pages_per_split * P, ctx)\n",
                                                 "    tok_end = tl.minimum(tok_begin + pages_per_split * P, ctx)\n"
                                                 "    tok_begin = tok_begin + 1\n")),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("bug", list(DECODE_BUGS))
def test_decode_needle_catches(bug, dtype, tmp_path):
    where, (old, new) = DECODE_BUGS[bug]
    batch, out = needle_case(where, dtype)
    assert_decode_close(out, contiguous_sdpa(batch, 64**-0.5), dtype)
    bad = mutant(paged_decode, old, new, tmp_path)
    batch, out = needle_case(where, dtype, decode=bad.paged_decode)
    with pytest.raises(AssertionError):
        assert_decode_close(out, contiguous_sdpa(batch, 64**-0.5), dtype)
