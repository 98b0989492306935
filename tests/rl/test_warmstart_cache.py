"""run.warmstart_cache: a run that loads its warm start from the cache computes the same bits as one
that trains it, and the key changes with what the warm start depends on, not with the RL settings."""

import torch

from rlengine.rl.config import load_job_config
from rlengine.rl.data.warmstart import warmstart_key
from rlengine.rl.trainer import Trainer

SMALL = ["--warmstart.steps", "20", "--train.updates", "2", "--train.prompts_per_step", "2",
         "--train.group_size", "4", "--eval.every", "2", "--task.num_eval", "8", "--task.num_train", "50",
         "--run.progress", "false"]
# what a record measures of the machine (times, rates, time-weighted batch statistics), not of the run
MACHINE = ("t_", "timing_s/", "perf/", "b_act_", "q")


def _run(tmp_path, name, extra=()):
    cfg = load_job_config("rlengine/configs/grpo.toml", SMALL + ["--run.out_dir", str(tmp_path / name), *extra])
    trainer = Trainer(cfg)
    start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.run()
    records = [{k: v for k, v in r.items() if not k.startswith(MACHINE)} for r in trainer.history]
    return start, records, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer


def test_cached_warmstart_is_the_same_bits(tmp_path):
    cache = ["--run.warmstart_cache", str(tmp_path / "cache")]
    a_start, a_rec, a_end, a = _run(tmp_path, "plain")
    b_start, b_rec, b_end, b = _run(tmp_path, "stores", cache)
    c_start, c_rec, c_end, c = _run(tmp_path, "loads", cache)
    (entry,) = [p for p in (tmp_path / "cache").iterdir()]         # one key, stored by the second run
    assert (entry / "model.safetensors").is_file()
    assert a.warmstart_losses == b.warmstart_losses == c.warmstart_losses and len(a.warmstart_losses) == 20
    for other in (b_start, c_start):
        assert all(torch.equal(a_start[k], other[k]) for k in a_start)   # the warm-started weights
    for other in (b_end, c_end):
        assert all(torch.equal(a_end[k], other[k]) for k in a_end)       # and what RL made of them
    assert a_rec == b_rec == c_rec and len(a_rec) == 3
    # the warm start did change the weights (a cache of the initial weights would pass the above too)
    cold = Trainer(load_job_config("rlengine/configs/grpo.toml", SMALL + ["--warmstart.steps", "0", "--run.out_dir",
                                                                      str(tmp_path / "cold")]))
    assert any(not torch.equal(v, a_start[k]) for k, v in cold.model.state_dict().items())
    cfg = load_job_config("rlengine/configs/grpo.toml", SMALL)
    key = warmstart_key(cfg.to_dict(), threads=1, device="cpu")
    same = load_job_config("rlengine/configs/grpo.toml", SMALL + ["--train.lr", "7e-4", "--gen.b_gen", "16",
                                                              "--train.group_size", "8", "--run.out_dir", "x"])
    assert warmstart_key(same.to_dict(), threads=1, device="cpu") == key
    for change in (["--warmstart.lr", "2e-3"], ["--run.seed", "1"], ["--task.num_train", "40"]):
        other = load_job_config("rlengine/configs/grpo.toml", SMALL + change)
        assert warmstart_key(other.to_dict(), threads=1, device="cpu") != key, change
    assert warmstart_key(cfg.to_dict(), threads=2, device="cpu") != key
