"""GPU tier settings. tools/gpu_check.sh runs this tier as four pytest processes at once on one device, so an
engine built with no pool size (no num_kv_blocks, kv_cache_memory or gpu_memory_utilization) takes at most
KV_TEST_BYTES here instead of its default 80% of the free memory: on the first H200 run one such engine took
110 GiB and the other processes failed to allocate (cuBLAS handles, a MoE test's gradients). Engines that
size their pool themselves keep their own sizing."""

import pytest
import torch

from rlengine.engine import core as engine_core  # EngineCore sizes a pool it builds itself

KV_TEST_BYTES = 8 * 2**30


@pytest.fixture(autouse=True)
def _bounded_default_kv_pool(monkeypatch):
    default = engine_core.default_num_blocks

    def bounded(device, gpu_memory_utilization, max_model_len, budget, per_block, *args):
        if budget is None and gpu_memory_utilization is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = min(int(free * 0.8), KV_TEST_BYTES)
        return default(device, gpu_memory_utilization, max_model_len, budget, per_block, *args)

    monkeypatch.setattr(engine_core, "default_num_blocks", bounded)
