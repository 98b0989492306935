"""Run under torchrun (2 ranks, gloo): an FSDP learner's sharded checkpoint, what its save gathers, and its reload.

Builds a bf16 tiny model under FSDP with fp32 masters and a KL reference, takes one update (so Adam
has moments), then saves with sharded.save_sharded while every all-gather is counted (elements received)
and DTensor.full_tensor is forbidden. A fresh learner on both ranks loads it back; each rank checks
its own shards equal. Rank 0 then writes (outside the counted save) the full masters and moments to
REF.safetensors, for the one-process load the test does, and OUT_JSON:
{"gathered": elements all-gathered during the save, "params": model elements, "state": learner
elements (masters + moments), "same_after_load": bool, "ckpt": the checkpoint directory}.
Usage: torchrun --nproc-per-node 2 tests/support/sharded_save.py OUT_JSON
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from safetensors.torch import save_file  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from rlengine.model.config import preset  # noqa: E402
from rlengine.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlengine.rl.config import TrainSection  # noqa: E402
from rlengine.rl.distributed import init_from_env  # noqa: E402
from rlengine.rl.learner.learner import Learner  # noqa: E402
from rlengine.rl.trainer.sharded import learner_state, load_sharded, save_sharded  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from grad_equivalence import batch_of  # noqa: E402

GATHERED = [0]
GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather", "_all_gather_base")


def _learner(d, seed):
    model = Qwen3ForCausalLM(preset("tiny"), seed=seed).to(torch.bfloat16)
    return Learner(model, TrainSection(prompts_per_step=4, group_size=2, micro_batch=2, parallel="fsdp",
                                       kl_coef=0.1, master_weights="fp32"), dist=d)


def _counting(real):
    def counted(*args, **kwargs):
        t = args[0]  # the output: what this rank receives
        GATHERED[0] += t.numel() if torch.is_tensor(t) else sum(x.numel() for x in t)
        return real(*args, **kwargs)
    return counted


def main(out):
    d = init_from_env()
    learner = _learner(d, seed=0)
    learner.step(batch_of([0, 1, 2, 3] if d.rank == 0 else [4, 5, 6, 7]))
    tensors, _ = learner_state(learner)
    real = {name: getattr(dist, name) for name in GATHERS if hasattr(dist, name)}
    full_tensor = DTensor.full_tensor
    for name, fn in real.items():
        setattr(dist, name, _counting(fn))

    def forbidden(self, *a, **k):
        raise AssertionError("a checkpoint save gathered a full DTensor")
    DTensor.full_tensor = forbidden
    run_dir = Path(out).parent / "run"
    path = save_sharded(run_dir, 1, model=learner.model, learner=learner, state={"update": 1}, dist=d).wait()
    d.wait_for_save()
    for name, fn in real.items():
        setattr(dist, name, fn)
    DTensor.full_tensor = full_tensor
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()

    fresh = _learner(d, seed=7)  # other weights, no optimizer state yet
    load_sharded(ckpt, model=fresh.model, learner=fresh, dist=d)
    loaded, _ = learner_state(fresh)
    same = loaded.keys() == tensors.keys() and all(
        torch.equal(_local(loaded[k]), _local(tensors[k])) for k in tensors)
    same &= all(torch.equal(_local(p), _local(m.to(p.dtype)))
                for p, m in zip(fresh.model.parameters(), fresh.master_params))
    same = d.all_max([0.0 if same else 1.0])[0] == 0.0  # both ranks' shards
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()}
    if d.is_main:
        save_file({k: v.contiguous() for k, v in full.items()}, str(Path(out).parent / "REF.safetensors"))
        n_state = sum(v.numel() for k, v in full.items() if k.startswith(("master.", "optim.")))
        with open(out, "w") as f:
            json.dump({"gathered": GATHERED[0], "params": sum(p.numel() for p in learner.model.parameters()),
                       "state": n_state, "same_after_load": bool(same), "ckpt": str(path or ckpt)}, f)
    d.close()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


if __name__ == "__main__":
    main(sys.argv[1])
