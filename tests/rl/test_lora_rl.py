"""LoRA RL on the shared weights: the engine decodes with the learner's adapters unmerged, the KL reference
is the base with the adapters off, checkpoints are PEFT adapters, and bad input is one line, exit 2.

References: the engine-vs-learner bounds of tests/support/engine_learner_logprobs.py (the same as without
LoRA; 0 in batch-invariant mode), the base model built without adapters, PEFT on transformers (a trained
rlengine adapter loads in peft.PeftModel with the same logits, and a peft-made adapter loads in rlengine),
and an uninterrupted run (a resumed run's metrics and adapters are the same bits). Adapters get random
non-zero B everywhere, so no comparison passes with the adapters ignored. The PEFT adapters train a full
copy of the LM head too (modules_to_save = ["lm_head"]), the run grpo.toml's tied copy of the embeddings and
the head (["embed_tokens", "lm_head"], ensure_weight_tying): saved, loaded, merged and decoded with; the
reference keeps the base.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.cli import main
from rlengine.model import load_pretrained, save_pretrained
from rlengine.model.config import preset
from rlengine.model.lora import LoraSpec, add_lora, adapters, is_lora_parameter, lora_parameters
from rlengine.model.lora_peft import peft_tensors
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.config.sections import TrainSection
from rlengine.rl.learner.learner import Learner
from rlengine.rl.trainer import Trainer

from tests.support.engine_learner_logprobs import MAX_LOW, MEAN_LOW, learner_minus_engine, rollout_batch
from tests.support.hf_models import DENSE_CONFIGS, make_hf_model, save_hf_model
from tests.support.short_runs import short_run_config, without_timings


def _lora_tiny(dtype=torch.float32, seed=5, targets="all-linear", saved=()):
    """The tiny preset with adapters whose A and B are random (B non-zero); saved=("lm_head",): a trained
    head copy, random and unlike the base head."""
    model = Qwen3ForCausalLM(preset("tiny"), seed=seed, dtype=dtype)
    add_lora(model, LoraSpec(r=4, alpha=8.0, targets=targets, modules_to_save=saved), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in adapters(model):
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=gen) * 0.3 * a.mask)
        if saved:
            # a head of the base's init scale (std 0.02): the engine-vs-learner bounds assume that scale
            model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) * 0.02)
    return model


@pytest.mark.parametrize("dtype,saved", [(torch.float32, ()), (torch.float32, ("lm_head",)),
                                         (torch.bfloat16, ("lm_head",))], ids=["fp32", "fp32-head", "bf16-head"])
def test_engine_logprobs_match_the_learner_with_adapters(dtype, saved):
    model = _lora_tiny(dtype, saved=saved)
    d = learner_minus_engine(model, rollout_batch(model), fused=False)
    if dtype == torch.float32:  # the bound without LoRA (tests/rl/test_logprob_parity.py)
        assert d.max() < 1e-5, d.max()
    else:
        assert d.max() < MAX_LOW and d.mean() < MEAN_LOW, (d.max().item(), d.mean().item())


def test_engine_logprobs_equal_the_learner_bitwise_in_batch_invariant_mode():
    model = _lora_tiny(torch.bfloat16, targets=("q_proj", "v_proj", "down_proj"))
    model.batch_invariant = True
    d = learner_minus_engine(model, rollout_batch(model), fused=False)
    assert d.max().item() == 0.0


@pytest.mark.parametrize("saved", [(), ("lm_head",)], ids=["adapters", "adapters-and-head"])
def test_kl_reference_is_the_base_with_adapters_off(saved):
    """No second copy: the reference has no parameters; its log-probs are the base model's, bit for bit
    (the base head, not the trained copy), and the policy's differ (the adapters count)."""
    model = _lora_tiny(saved=saved)
    base = Qwen3ForCausalLM(preset("tiny"), seed=5)
    learner = Learner(model, TrainSection(kl_coef=0.1))
    assert learner.ref is not None and not list(learner.ref.parameters())
    assert learner.optim.params == lora_parameters(model)  # only the adapters train
    batch = rollout_batch(model)
    ref = learner.batch_logprobs(learner.ref, batch)
    assert torch.equal(ref, learner.batch_logprobs(base, batch))
    assert not torch.equal(ref, learner.batch_logprobs(model, batch))
    assert all(a.enabled for a in adapters(model)) and model.lm_head.weight.requires_grad == bool(saved)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny preset as a HF checkpoint directory (what transformers and PEFT load as the base)."""
    return save_pretrained(Qwen3ForCausalLM(preset("tiny"), seed=0), tmp_path_factory.mktemp("tiny") / "base")


def _lora_run(tmp_path, name, base, extra=()):
    return short_run_config(tmp_path, name, ["--model.name", str(base), "--model.lora_r", "4", "--train.lr", "2e-2",
                                             "--train.kl_coef", "0.05", "--train.updates", "2",
                                             "--model.lora_modules_to_save", "embed_tokens,lm_head",
                                             "--run.checkpoint_every", "1", *extra])


def test_training_resumes_bit_identical_keeps_the_base_saves_peft_adapters_and_exports(tmp_path, tiny_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full = Trainer(_lora_run(tmp_path, "full", tiny_dir))
    history = full.run()
    run = tmp_path / "full"
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert not (ckpt / "model").exists()  # the base is not saved again
    assert {p.name for p in (ckpt / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"] and config["ensure_weight_tying"]
    record = json.loads((ckpt / "base.json").read_text())
    assert record["base_model"] == str(run / "base") and record["base_hash"].startswith("sha256:")
    # the base (the warm-started model) is unchanged, bit for bit, after training
    base = load_pretrained(run / "base")
    trained = {n.replace(".original_module.", "."): p for n, p in full.model.named_parameters()}
    assert all(torch.equal(trained[n], p) for n, p in base.named_parameters())
    assert sum(not is_lora_parameter(n) for n in trained) == len(list(base.parameters()))
    assert full.model.lm_head.weight is full.model.model.embed_tokens.weight  # one trained copy, tied
    assert not torch.equal(full.model.lm_head.weight, base.lm_head.weight)
    # PEFT loads the adapter on the transformers model of the same base: the same logits
    hf = AutoModelForCausalLM.from_pretrained(str(run / "base"), dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(ckpt / "adapter")).eval()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = full.model(ids), peft(ids).logits
        assert (ours - ref).abs().max() < 1e-4
        assert (ours - base(ids)).abs().max() > 1e-3  # the trained adapter moves the logits
    # `rlengine export --merge`: a HF checkpoint with the adapter folded in, the same logits in transformers
    assert main(["export", "--merge", str(run), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert merged.config.tie_word_embeddings  # the trained copy is both, as in the base
    with torch.no_grad():
        assert (merged(ids).logits - ours).abs().max() < 1e-4
    # resume from update 1 (the run as a stop after its first checkpoint leaves it, without a second run to
    # get there): the same metrics and the same adapter bits as the uninterrupted run
    shutil.copytree(run, tmp_path / "part")
    first, last = sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir() if p.is_dir())
    shutil.rmtree(tmp_path / "part" / "checkpoints" / last)
    (tmp_path / "part" / "checkpoints" / "latest").write_text(first)
    resumed = Trainer(_lora_run(tmp_path, "part", tiny_dir), resume=True)
    assert resumed.update == 1
    assert [without_timings(r) for r in resumed.run()] == [without_timings(r) for r in history]
    a, b = peft_tensors(full.model), peft_tensors(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """(HF base directory, a PEFT adapter directory made by peft on it with random non-zero weights, PeftModel)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("peft")
    hf = make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], vocab=256, layers=2, seed=3)
    base = save_hf_model(hf, root / "base")
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                         modules_to_save=["lm_head"]))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    peft.save_pretrained(str(root / "adapter"))
    return base, root / "adapter", peft.eval()


def test_a_peft_adapter_loads_in_llm_and_train(tmp_path, peft_adapter):
    base, adapter, peft = peft_adapter
    llm = LLM(str(base), lora_path=str(adapter), dtype="float32", max_num_seqs=4)
    prompts = [[5, 9, 17, 3], [40, 2]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        with torch.no_grad():
            logits = peft(ids).logits[0, len(prompt) - 1:-1]
        assert out.outputs[0].token_ids == logits.argmax(-1).tolist()
        ref = logits.log_softmax(-1).gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[:, 0]
        assert (torch.tensor(out.outputs[0].token_logprobs) - ref).abs().max() < 1e-4
    trainer = Trainer(short_run_config(tmp_path, "from_peft", ["--model.name", str(base), "--model.lora_path",
                                                              str(adapter), "--warmstart.steps", "0"]))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (trainer.model(ids) - peft(ids).logits).abs().max() < 1e-4


@pytest.fixture
def other_shape_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    hf = make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], vocab=256, layers=2, seed=3)  # hidden 48, not 64
    get_peft_model(hf, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "other"))
    return str(tmp_path / "other")


@pytest.mark.parametrize("argv,named", [
    (["--model.lora_r", "4", "--model.lora_target_modules", "qkv_proj"], "unknown target module"),
    (["--model.lora_r", "-1"], "model.lora_r"),
    (["--model.name", "tiny-moe", "--model.lora_r", "4"], "MoE experts"),
    (["--model.lora_path", "{other}"], "another base model or shape"),
], ids=["unknown-target", "negative-r", "moe-experts", "adapter-of-another-shape"])
def test_bad_lora_input_is_one_line_exit_2(argv, named, tmp_path, capsys, monkeypatch, other_shape_adapter):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(other=other_shape_adapter) for a in argv]
    code = main(["train", "--warmstart.steps", "0", "--run.out_dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and " error: " in last and named in last, err


@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b", "llama-3-8b"])
def test_memory_plan_counts_training_state_for_the_adapters_only(name):
    """bf16 with fp32 masters: full fine-tuning holds 20 bytes per parameter plus a 2-byte reference copy; LoRA
    holds the 2-byte frozen base and 20 bytes per adapter element, and no reference copy."""
    from rlengine.analysis.memory import training_state_bytes
    from rlengine.analysis.roofline import param_counts
    from rlengine.model.lora import lora_stored_count

    cfg, spec = preset(name), LoraSpec(r=8, alpha=16.0, targets="all-linear")
    stored = lora_stored_count(cfg, spec)
    if name == "tiny":  # the count is what add_lora allocates
        model = Qwen3ForCausalLM(cfg, seed=0)
        assert sum(p.numel() for p in add_lora(model, spec)) == stored
        head = LoraSpec(r=8, alpha=16.0, targets="all-linear", modules_to_save=("lm_head",))
        model = Qwen3ForCausalLM(cfg, seed=0)
        assert sum(p.numel() for p in add_lora(model, head)) == lora_stored_count(cfg, head) \
            == stored + cfg.vocab_size * cfg.hidden_size  # a trained head: one full V x C copy
    n = param_counts(cfg).total
    assert training_state_bytes(cfg, "bfloat16", kl_reference=True) == 20 * n + 2 * n
    lora = training_state_bytes(cfg, "bfloat16", kl_reference=True, lora_params=stored)
    assert lora == 2 * n + 20 * stored
    assert name == "tiny" or stored < n // 50  # at real shapes the adapters are under 2% of the weights


def test_bf16_adapters_train_through_fp32_masters_and_the_base_stays_put():
    model = _lora_tiny(torch.bfloat16)
    base = {n: p.clone() for n, p in model.named_parameters() if not is_lora_parameter(n)}
    learner = Learner(model, TrainSection(lr=1e-2))
    masters = learner.optim.master_params
    assert [m.shape for m in masters] == [p.shape for p in lora_parameters(model)]
    assert all(m.dtype == torch.float32 for m in masters)
    before = [p.clone() for p in lora_parameters(model)]
    learner.step(rollout_batch(model))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(lora_parameters(model), masters))
    assert any(not torch.equal(p, b) for p, b in zip(lora_parameters(model), before))
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
