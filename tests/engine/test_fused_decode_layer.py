"""gen.decode_kernels = "fused": the six-launch decode layer (model/fused_decode.py) on the GPU's kernels.

Under TRITON_INTERPRET=1 with the Triton backend and the model's fast path set to the Triton ops (as
on a GPU; decode_launches._gpu_path_on_cpu), a tiny Qwen3 (Qwen3-0.6B's head layout) decodes greedily
with the torch and the fused settings: the same tokens, log-probs within low_precision_bounds(L) in
fp16 and to fp32 rounding in fp32 (the fused path rounds fewer intermediates, so the two differ by the
torch path's roundings). The launch counter pins <= 6 launches a layer on the fused path at B_act 1
and 64, and 9 where only the K/V store is folded in (a step the six-launch layer does not take).
"""

import dataclasses

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.benchmarks import decode_launches as dl
from rlengine.model import fused_decode
from rlengine.model.config import ConfigError
from rlengine.model.qwen3 import Qwen3ForCausalLM

from tests.support.engine_learner_logprobs import low_precision_bounds

LAYERS = 2


def _generate(decode_kernels: str, dtype: torch.dtype):
    """Greedy completions of two prompts: the prefill on the CPU ops (the same for both settings), the
    decode steps on the GPU path under the interpreter. Few heads (H 4, Hkv 2): the interpreter runs
    one program at a time."""
    cfg = dataclasses.replace(dl.count_config(LAYERS), num_attention_heads=4, num_key_value_heads=2)
    model = Qwen3ForCausalLM(cfg, dtype=dtype)
    model.init_weights(seed=3, std=0.2)  # logits spread well beyond rounding: greedy choices are not ties
    llm = LLM(model, max_num_seqs=4, max_model_len=64, attention_backend="triton", block_size=16, num_kv_blocks=12,
              enforce_eager=True, decode_kernels=decode_kernels, cpu_kernels="torch")
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for n in (5, 16):  # 16: the first decoded token opens a second page
        llm.add_request(torch.randint(3, 500, (n,), generator=gen).tolist(), params)
    outs = llm.step()  # prefill
    with dl._gpu_path_on_cpu():
        while llm.has_unfinished():
            outs += llm.step()
    return sorted((o for o in outs if o.finished), key=lambda o: int(o.request_id))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_decode_matches_the_torch_path(dtype, monkeypatch):
    calls = []
    real = fused_decode.forward
    monkeypatch.setattr(fused_decode, "forward", lambda *a: calls.append(1) or real(*a))
    want, got = _generate("torch", dtype), _generate("fused", dtype)
    assert len(calls) == 2, "the six-launch layer did not run every decode step"
    want, got = [o.outputs[0] for o in want], [o.outputs[0] for o in got]
    assert len(got) == 2 and [c.token_ids for c in got] == [c.token_ids for c in want]
    diff = torch.tensor([a - b for g, w in zip(got, want) for a, b in zip(g.token_logprobs, w.token_logprobs)]).abs()
    max_bound, mean_bound = low_precision_bounds(LAYERS) if dtype == torch.float16 else (1e-4, 1e-5)
    assert diff.max() <= max_bound and diff.mean() <= mean_bound, (diff.max(), diff.mean())


@pytest.mark.parametrize("b_act", [1, 64])
def test_fused_path_is_six_launches_a_layer(b_act):
    n = {L: dl.count_step(L, b_act, decode_kernels="fused") for L in (2, 4)}
    for kind in ("eager", "graph"):
        total = {L: (r[kind] if kind == "eager" else r[kind][1]).total for L, r in n.items()}
        per_layer, constant = dl._per_layer(total[2], total[4], 2, 4)
        assert per_layer == 6 and constant == 9, (kind, per_layer, constant)  # constant: as on the torch path
    eager = n[2]["eager"]  # 2 layers: norm+qkv, o_proj+res, norm+gate_up+SiLU, down+res; q/k-norm+RoPE+store
    assert dict(eager.triton) == {"_small_m_gemm_kernel": 8, "_qk_norm_rope_kernel": 2, "_split_kernel": 2,
                                  "_rms_norm_kernel": 1}
    # embedding, LM head (its name is the CPU kernel choice's), the greedy sampler's four ops: no GEMM, no store
    assert "store_kvcache" not in eager.torch and sum(eager.torch.values()) == 6


def test_store_folded_into_rope_alone_is_nine_launches_a_layer(monkeypatch):
    """Where the six-launch layer does not apply (here forced off), fused still drops the K/V store."""
    monkeypatch.setattr(fused_decode, "six_launch_ok", lambda *a: False)
    n = {L: dl.count_step(L, 1, decode_kernels="fused")["eager"].total for L in (2, 4)}
    assert (n[4] - n[2]) / 2 == 9


def test_bad_setting_is_one_config_error():
    from rlengine.engine.spec import EngineSpec
    from rlengine.rl.config.sections import GenSection

    for make in (lambda: EngineSpec(decode_kernels="fast"), lambda: GenSection(decode_kernels="fast")):
        with pytest.raises(ConfigError, match="decode_kernels must be torch|fused, got 'fast'"):
            make()
    assert fused_decode.DEFAULT_DECODE_KERNELS == "torch" == GenSection().decode_kernels == EngineSpec().decode_kernels


def test_cli_bad_setting_exits_2(capsys):
    from rlengine.cli import main

    assert main(["info", "--plan", "grpo", "--gen.decode_kernels", "fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gen.decode_kernels must be torch|fused" in err


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 64])
def test_fused_decode_matches_the_torch_path_on_a_gpu(num_prompts):
    """bf16 on a GPU with decode CUDA graphs (the engine's default there), at B_act 1 and 64."""
    def run(decode_kernels):
        model = Qwen3ForCausalLM(dl.count_config(LAYERS), dtype=torch.bfloat16, device="cuda")
        model.init_weights(seed=3, std=0.2)
        llm = LLM(model, max_num_seqs=64, max_model_len=128, attention_backend="triton", decode_kernels=decode_kernels)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
                   for n in torch.randint(4, 40, (num_prompts,), generator=gen)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        return [o.outputs[0] for o in outs]

    want, got = run("torch"), run("fused")
    same = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
    assert same == len(want), f"{len(want) - same} of {len(want)} greedy completions differ"
    diff = torch.tensor([a - b for g, w in zip(got, want) for a, b in zip(g.token_logprobs, w.token_logprobs)]).abs()
    max_bound, mean_bound = low_precision_bounds(LAYERS)
    assert diff.max() <= max_bound and diff.mean() <= mean_bound, (diff.max(), diff.mean())
