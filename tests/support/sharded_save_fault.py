"""Run under torchrun (2 ranks, gloo): FSDP sharded saves that fail part way, and what they leave behind.

The tiny bf16 FSDP learner of sharded_save.py (fp32 masters, KL reference) takes one update and saves
update 1; its shards are kept as the reference. It takes a second update (so every tensor differs
from update 1's), then each case saves update 2 with one fault injected on one rank:
  begin        rank 0 cannot make the checkpoint's directory (ENOSPC)
  shard        rank 1 writes part of its shard file, then ENOSPC (DCP's write step)
  model        rank 0's model export is written, then ENOSPC (stage "partial")
  pointer      rank 0 has renamed the checkpoint and written latest.tmp, then ENOSPC ("before-pointer")
  async-shard  the shard fault of rank 1 in an asynchronous save (run.async_checkpoint)
Each case must end on both ranks (no rank left waiting) with CheckpointError. Afterwards update 2
saves normally. Writes OUT_JSON (rank 0): {case: {"errors": [each rank's error type and message],
"left": the names in checkpoints/, "latest": what `latest` names, "same": update 1 loads back (every
rank its own shards) to the state it was saved from}, "after": the names once update 2 saved}.
Usage: torchrun --nproc-per-node 2 tests/support/sharded_save_fault.py OUT_JSON
"""

import errno
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from torch.distributed.checkpoint import HuggingFaceStorageWriter  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import rlengine.rl.trainer.sharded as sharded  # noqa: E402
from rlengine.model.config import preset  # noqa: E402
from rlengine.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlengine.rl.config import TrainSection  # noqa: E402
from rlengine.rl.distributed import init_from_env  # noqa: E402
from rlengine.rl.learner.learner import Learner  # noqa: E402
from rlengine.rl.trainer.sharded import learner_state, load_sharded, save_sharded  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grad_equivalence import batch_of  # noqa: E402

CASES = ("begin", "shard", "model", "pointer", "async-shard")


def _full():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _learner(d, seed):
    model = Qwen3ForCausalLM(preset("tiny"), seed=seed).to(torch.bfloat16)
    return Learner(model, TrainSection(prompts_per_step=4, group_size=2, micro_batch=2, parallel="fsdp",
                                       kl_coef=0.1, master_weights="fp32"), dist=d)


def _local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _inject(case: str, rank: int):
    """Install the fault of `case` on this rank; returns (on_stage, undo)."""
    real_begin, real_write = sharded.begin_checkpoint, HuggingFaceStorageWriter.write_data
    if case == "begin" and rank == 0:
        def begin(*a, **k):
            raise _full()
        sharded.begin_checkpoint = begin
    if case in ("shard", "async-shard") and rank == 1:
        def write_data(self, plan, planner):
            out = Path(self.path)
            out.mkdir(parents=True, exist_ok=True)
            (out / "shard-00002-model-00001-of-00001.safetensors").write_bytes(b"\x00" * 100)  # part of it
            raise _full()
        HuggingFaceStorageWriter.write_data = write_data
    when = {"model": "partial", "pointer": "before-pointer"}.get(case) if rank == 0 else None

    def on_stage(stage):
        if stage == when:
            raise _full()

    def undo():
        sharded.begin_checkpoint, HuggingFaceStorageWriter.write_data = real_begin, real_write
    return on_stage, undo


def main(out):
    d = init_from_env()
    learner = _learner(d, seed=0)
    learner.step(batch_of([0, 1, 2, 3] if d.rank == 0 else [4, 5, 6, 7]))
    run_dir = Path(out).parent / "run"
    save_sharded(run_dir, 1, model=learner.model, learner=learner, state={"update": 1}, dist=d).settle()
    at_one = {k: _local(v) for k, v in learner_state(learner)[0].items()}
    learner.step(batch_of([1, 2, 3, 4] if d.rank == 0 else [5, 6, 7, 0]))
    ckpts, result = run_dir / "checkpoints", {}
    for case in CASES:
        on_stage, undo = _inject(case, d.rank)
        error = None
        try:
            save_sharded(run_dir, 2, model=learner.model, learner=learner, state={"update": 2}, dist=d,
                         asynchronous=case.startswith("async"), on_stage=on_stage).settle()
        except BaseException as exc:  # noqa: BLE001 - recorded and checked by the test
            error = f"{type(exc).__name__}: {exc}"
        finally:
            undo()
        errors = d.all_gather_objects(error)
        fresh = _learner(d, seed=7)
        load_sharded(ckpts / (ckpts / "latest").read_text(), model=fresh.model, learner=fresh, dist=d)
        loaded = learner_state(fresh)[0]
        same = loaded.keys() == at_one.keys() and all(torch.equal(_local(loaded[k]), at_one[k]) for k in at_one)
        same = d.all_max([0.0 if same else 1.0])[0] == 0.0
        if d.is_main:
            result[case] = {"errors": errors, "left": sorted(p.name for p in ckpts.iterdir()),
                            "latest": (ckpts / "latest").read_text(), "same": bool(same)}
        d.barrier()
    save_sharded(run_dir, 2, model=learner.model, learner=learner, state={"update": 2}, dist=d).settle()
    if d.is_main:
        result["after"] = sorted(p.name for p in ckpts.iterdir())
        Path(out).write_text(json.dumps(result))
    d.close()


if __name__ == "__main__":
    main(sys.argv[1])
