"""LLM is a thin front: its keywords become an EngineSpec and an EngineCore builds and runs the engine;
the trainer's engines come from the plan's specs through LLM.from_spec; no file in the engine or the RL
side grows past a size a reader takes in."""

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from rlengine import LLM, SamplingParams
from rlengine.engine.core import EngineCore
from rlengine.engine.spec import EngineSpec
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
# what an engine is made of: built by EngineCore from the spec, never by LLM.__init__
PARTS = {"KVPool", "KVCache", "BlockPool", "BlockManager", "Scheduler", "StepInputs", "ModelRunner", "Sampler",
         "DecodeGraphs", "CudaGraph", "resolve_backend", "backend_cls", "_new_kv_pool", "_use_decode_graphs"}


def calls_in(fn) -> set[str]:
    """Names of everything `fn` calls (f(...), obj.f(...))."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_llm_init_builds_a_spec_and_a_core_and_no_part_of_the_engine():
    called = calls_in(LLM.__init__)
    assert {"EngineSpec", "EngineCore"} <= called
    assert not called & PARTS, sorted(called & PARTS)
    # the check can fail: the core's own constructor builds the parts
    assert {"KVCache", "BlockManager", "Scheduler", "ModelRunner", "StepInputs"} <= calls_in(EngineCore.__init__) | \
        calls_in(EngineCore._new_kv_pool)


def test_an_engine_from_its_spec_decodes_like_one_from_keywords():
    model = Qwen3ForCausalLM(preset("tiny"), seed=3)
    spec = EngineSpec(max_num_seqs=4, max_model_len=64, num_kv_blocks=32, seed=5, cpu_kernels="torch")
    a = LLM.from_spec(model, spec)
    b = LLM(model, max_num_seqs=4, max_model_len=64, num_kv_blocks=32, seed=5, cpu_kernels="torch")
    assert a.spec == b.spec and a.spec.max_num_batched_tokens == 2048  # resolved: max(max_model_len, 2048)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=11)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outs_a, outs_b = a.generate(prompts, params), b.generate(prompts, params)
    for x, y in zip(outs_a, outs_b):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
    assert len(a.trace) == len(a.core.trace) > 0 and a.weight_version == 0
    a.weight_version += 1
    assert a.core.weight_version == 1


def test_a_bad_engine_spec_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineSpec(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len must be in"):
        LLM(Qwen3ForCausalLM(preset("tiny")), max_model_len=10**9)


@pytest.mark.parametrize("top", ["rlengine/engine", "rlengine/rl"])
def test_no_file_of_the_engine_or_the_rl_side_passes_400_lines(top):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
