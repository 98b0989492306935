"""Run under torchrun (2 ranks, gloo): a rank-0 checkpoint save that outlasts the collective timeout.

With run.dist_timeout_s = 4 and rank 0's writing of the HF weights sleeping 8 s in every save:
1 update with DDP and rank 0's one-file-per-kind save, then 2 updates with FSDP and async sharded
saves after each. The job must live: the other rank waits on the checkpoint group, whose timeout is
run.save_timeout_s. Writes OUT_JSON (rank 0): {case: [the names in its checkpoints/]}; the runs
go beside it.
Usage: torchrun --nproc-per-node 2 tests/support/slow_save.py OUT_JSON
"""

import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import rlengine.rl.trainer.checkpoint as checkpoint  # noqa: E402
import rlengine.rl.trainer.sharded as sharded  # noqa: E402
from rlengine.rl.config import load_job_config  # noqa: E402
from rlengine.rl.trainer import Trainer  # noqa: E402

SLEEP_S, TIMEOUT_S = 8.0, 4
SMALL = ["--warmstart.steps", "5", "--train.prompts_per_step", "4", "--train.group_size", "4",
         "--task.num_eval", "4", "--task.num_train", "50", "--eval.every", "2", "--run.progress", "false",
         "--run.dist_timeout_s", str(TIMEOUT_S)]


def slow(write):
    def written(*args, **kwargs):
        time.sleep(SLEEP_S)
        return write(*args, **kwargs)
    return written


def main(out_json: Path):
    out = out_json.parent
    checkpoint.save_pretrained = slow(checkpoint.save_pretrained)  # only rank 0 writes
    sharded.write_hf_export = slow(sharded.write_hf_export)
    result = {}
    for case, extra in (("ddp", ["--train.updates", "1"]),  # the final save only
                        ("fsdp-async", ["--train.updates", "2", "--run.checkpoint_every", "1", "--train.parallel",
                                        "fsdp", "--run.async_checkpoint", "true"])):  # update 2 runs under a save
        tr = Trainer(load_job_config("rlengine/configs/grpo.toml", SMALL + extra + ["--run.out_dir", str(out / case)]))
        tr.run()
        if tr.dist.is_main:
            result[case] = sorted(p.name for p in (out / case / "checkpoints").iterdir())
    if tr.dist.is_main:
        out_json.write_text(json.dumps(result))
    tr.dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
