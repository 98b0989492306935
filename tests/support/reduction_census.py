"""Run under torchrun (2 ranks, gloo): which gradient reductions one learner update makes, and in what dtype.

Wraps torch.distributed's all_reduce and reduce-scatters around one compute_grads of a batch
split into 4 micro-batches per rank, for DDP (fp32, no masters: one reduction per update) and FSDP
(bf16 parameters: every reduction in fp32). Writes {case: [[op, dtype, numel], ...], "params": n}.
Usage: torchrun --nproc-per-node 2 tests/support/reduction_census.py OUT_JSON
"""

import json
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from rlengine.model.config import preset  # noqa: E402
from rlengine.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlengine.rl.config import TrainSection  # noqa: E402
from rlengine.rl.distributed import init_from_env  # noqa: E402
from rlengine.rl.learner.learner import Learner  # noqa: E402
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from grad_equivalence import batch_of  # noqa: E402

CALLS: list = []
OPS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
REAL = {name: getattr(dist, name) for name in OPS if hasattr(dist, name)}


def _wrap(name):
    real = REAL[name]

    def counted(*args, **kwargs):
        if name == "all_reduce":
            t = args[0] if args else kwargs["tensor"]
        else:  # reduce_scatter_*(output, input): the input is what is summed over ranks
            t = args[1] if len(args) > 1 else kwargs["input"]
        CALLS.append([name, str(t.dtype).removeprefix("torch."), t.numel()])
        return real(*args, **kwargs)
    setattr(dist, name, counted)


def main(out):
    d = init_from_env()
    results = {}
    for parallel, dtype in (("ddp", torch.float32), ("fsdp", torch.bfloat16)):
        model = Qwen3ForCausalLM(preset("tiny"), seed=0).to(dtype)
        results["params"] = sum(p.numel() for p in model.parameters())
        learner = Learner(model, TrainSection(prompts_per_step=4, group_size=2, micro_batch=1, parallel=parallel,
                                              max_grad_norm=1e9), dist=d)
        batch = batch_of([0, 1, 2, 3] if d.rank == 0 else [4, 5, 6, 7])  # 4 micro-batches per rank
        CALLS.clear()
        for name in REAL:
            _wrap(name)
        learner.compute_grads(batch)
        for name in REAL:
            setattr(dist, name, REAL[name])
        results[parallel] = list(CALLS)
    if d.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    d.close()


if __name__ == "__main__":
    main(sys.argv[1])
