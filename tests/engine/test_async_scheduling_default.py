"""Async scheduling (overlap) is the default on a CUDA device and off elsewhere; an explicit setting wins.

The trainer's engines come from the plan's EngineSpec (async_scheduling None) through LLM.from_spec, so they
resolve the same way as LLM(...). The overlap itself is tested in test_overlap_scheduling.py.
"""

import pytest
import torch

from rlengine import LLM
from rlengine.engine.spec import EngineSpec, resolve_engine_spec
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM


@pytest.mark.parametrize("setting, device, expected", [(None, "cuda", True), (None, "cpu", False),
                                                       (False, "cuda", False), (True, "cpu", True)])
def test_resolved_setting(setting, device, expected):
    spec = resolve_engine_spec(EngineSpec(async_scheduling=setting), 4096, shared_pool=False,
                               device=torch.device(device))
    assert spec.async_scheduling is expected


def test_cpu_engines_stay_synchronous_by_default():
    model = Qwen3ForCausalLM(preset("tiny"))
    assert EngineSpec().async_scheduling is None
    assert LLM(model, attention_backend="cpp").async_scheduling is False
    assert LLM.from_spec(model, EngineSpec(max_num_seqs=2)).async_scheduling is False
    assert LLM(model, attention_backend="cpp", async_scheduling=True).async_scheduling is True
