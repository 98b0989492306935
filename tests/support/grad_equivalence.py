"""Run under torchrun (2 ranks, gloo): DDP / FSDP gradients and updates equal one process's.

Each rank also builds the single-process reference itself (same seed, the whole batch, no process
group), so the comparison needs no communication of its own. Exits non-zero on any mismatch.
Usage: torchrun --nproc-per-node 2 tests/support/grad_equivalence.py OUT_JSON
"""

import json
import sys

import torch

torch.set_num_threads(1)

from rlengine import LLM, SamplingParams  # noqa: E402
from rlengine.model.config import ConfigError, preset  # noqa: E402
from rlengine.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlengine.rl.learner.batching import pack  # noqa: E402
from rlengine.rl.config import TrainSection  # noqa: E402
from rlengine.rl.distributed import init_from_env  # noqa: E402
from rlengine.rl.learner.learner import Learner  # noqa: E402


def batch_of(seqs):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    comps = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (8,), generator=g)]
    olds = [(-torch.rand(len(c), generator=g) * 4 - 1).tolist() for c in comps]
    adv, rew = torch.randn(8, generator=g).tolist(), torch.rand(8, generator=g).tolist()
    return pack([prompts[i] for i in seqs], [comps[i] for i in seqs], [olds[i] for i in seqs],
                [adv[i] for i in seqs], [rew[i] for i in seqs])


def grads(learner):
    out = []
    for p in learner.optim.grad_params:
        g = p.grad
        out.append((g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone())
    return out


def params(module):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in module.parameters()]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def case(dist, parallel, algo, agg, dtype):
    cfg = dict(prompts_per_step=4, group_size=2, lr=1e-3, micro_batch=2, max_grad_norm=1e9, algo=algo, agg=agg,
               kl_coef=0.05 if algo == "grpo" else 0.0)
    # unequal shares: rank 0 has 3 sequences (2 micro-batches), rank 1 has 5 (3 micro-batches)
    mine = [0, 1, 2] if dist.rank == 0 else [3, 4, 5, 6, 7]
    ref_model = Qwen3ForCausalLM(preset("tiny"), seed=0).to(dtype)
    ref = Learner(ref_model, TrainSection(**cfg, parallel="none"))
    model = Qwen3ForCausalLM(preset("tiny"), seed=0).to(dtype)
    learner = Learner(model, TrainSection(**cfg, parallel=parallel), dist=dist)
    errs = {}
    # fp32: the first step's gradients (ranks reduce in another order: rounding only). A second step
    # is compared in float64 alone: Adam's m / sqrt(v) turns an fp32 rounding difference in a
    # near-zero gradient element into an O(lr) weight difference, whose size depends on the CPU's
    # GEMM blocking rather than on the parallel code under test.
    for step in range(2 if dtype == torch.float64 else 1):
        full, local = batch_of(range(8)), batch_of(mine)
        m_ref = ref.compute_grads(full)
        m = learner.compute_grads(local)
        g_ref, g = grads(ref), grads(learner)
        errs[f"grad{step}"] = max(rel(a, b) for a, b in zip(g, g_ref))
        errs[f"loss{step}"] = abs(m["loss"] - m_ref["loss"]) / abs(m_ref["loss"])
        if algo == "ppo":
            gc_ref = [p.grad for p in ref.critic_optim.grad_params]
            gc = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                  for p in learner.critic_optim.grad_params]
            errs[f"critic_grad{step}"] = max(rel(a, b) for a, b in zip(gc, gc_ref))
        for lr_ in (ref, learner):
            lr_.optim.step()
            if lr_.critic_optim is not None:
                lr_.critic_optim.step()
    if dtype == torch.float64:
        errs["params"] = max(rel(a, b) for a, b in zip(params(model), params(ref_model)))
    return errs, model, ref_model


def main(out):
    dist = init_from_env()
    assert dist.world == 2, "run with torchrun --nproc-per-node 2"
    results = {}
    for dtype in (torch.float32, torch.float64):
        for parallel in ("ddp", "fsdp"):
            for algo, agg in (("grpo", "token-mean"), ("grpo", "seq-mean"), ("ppo", "token-mean")):
                errs, model, ref_model = case(dist, parallel, algo, agg, dtype)
                results[f"{parallel}-{algo}-{agg}-{str(dtype)[6:]}"] = errs
    # FSDP memory: this rank's parameter + optimizer storage is ~1/2 of one process's
    model = Qwen3ForCausalLM(preset("tiny"), seed=0)
    single = Learner(Qwen3ForCausalLM(preset("tiny"), seed=0), TrainSection(prompts_per_step=4, group_size=2))
    learner = Learner(model, TrainSection(prompts_per_step=4, group_size=2, parallel="fsdp"), dist=dist)
    for lr_, b in ((single, batch_of(range(8))), (learner, batch_of([0, 1, 2] if dist.rank == 0 else [3, 4, 5, 6, 7]))):
        lr_.step(b)

    def local_bytes(lr_):
        ps = list(lr_.model.parameters())
        state = [t for st in lr_.opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
        loc = [t.to_local() if hasattr(t, "to_local") else t for t in ps + state]
        return sum(t.numel() * t.element_size() for t in loc)
    results["fsdp_bytes_ratio"] = local_bytes(learner) / local_bytes(single)
    # the engine decodes from the unsharded parameters: tokens equal to the 1-rank model's
    reference = single.model
    prompts = [[5, 17, 33, 9], [40, 2, 71]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with dist.unsharded(model):
        got = [o.outputs[0].token_ids for o in LLM(model, max_num_seqs=2, attention_backend="torch").generate(prompts, sp)]
        results["unsharded_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    expect = [o.outputs[0].token_ids for o in LLM(reference, max_num_seqs=2, attention_backend="torch").generate(prompts, sp)]
    results["engine_tokens_equal"] = got == expect
    results["resharded"] = all(hasattr(p, "to_local") for p in model.parameters())
    # a config that differs between ranks is refused on every rank
    try:
        dist.check_same("config", {"train": {"lr": 1e-3 * (1 + dist.rank)}})
        results["mismatch_detected"] = False
    except ConfigError:
        results["mismatch_detected"] = True
    write_results(dist, out, results)


def write_results(dist, out: str, results: dict) -> None:
    """Rank 0 writes the JSON the test reads; every rank leaves the process group."""
    if dist.is_main:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1])
