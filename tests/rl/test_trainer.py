"""The RL loop end to end: resume, bad input, failing rewards, and the embedded default job."""

import json

import pytest
import torch

from rlengine.cli import main
from rlengine.model.config import ConfigError
from rlengine.rl.config import load_job_config
from rlengine.rl.data.rewards import RewardError, register_reward
from rlengine.rl.data.tasks import DatasetError, build_task, read_jsonl
from rlengine.rl.trainer import Trainer

from tests.support.short_runs import SHORT_RUN, short_run_config, without_timings

def _strip(records):
    return [without_timings(r) for r in records]


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full = Trainer(short_run_config(tmp_path, "full")).run()
    part = Trainer(short_run_config(tmp_path, "part"))
    part.run(stop_after=2)
    resumed = Trainer(short_run_config(tmp_path, "part"), resume=True)
    assert resumed.update == 2
    history = resumed.run()
    assert _strip(history) == _strip(full)
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["update"] for ln in lines] == [0, 1, 2, 3, 4]
    assert (tmp_path / "part" / "checkpoints" / "latest").read_text() == "update-000004"


def test_reward_function_that_raises_is_counted_and_run_continues(tmp_path):
    calls = {"n": 0}

    @register_reward("flaky")
    def flaky(completion, answer):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("reward server down")
        return float(completion.strip() == answer)

    # one call in three fails: tolerated up to task.max_reward_error_frac, counted in the metrics
    history = Trainer(short_run_config(tmp_path, "flaky", ["--task.reward", "flaky", "--train.updates", "2",
                                                          "--task.max_reward_error_frac", "0.5"])).run()
    assert sum(r.get("reward_errors", 0) for r in history) > 0
    assert any(r.get("eval_reward_errors", 0) > 0 for r in history)
    assert history[-1]["update"] == 2
    # above the default 1% the run stops with the reward's own traceback
    with pytest.raises(RewardError, match="reward server down"):
        Trainer(short_run_config(tmp_path, "flaky2", ["--task.reward", "flaky", "--train.updates", "2"])).run()


def test_ppo_runs_with_critic_warmup(tmp_path):
    cfg = load_job_config("rlengine/configs/ppo.toml", SHORT_RUN[:-4] + ["--run.progress", "false", "--train.group_size",
                      "1", "--train.critic_warmup", "2", "--run.out_dir", str(tmp_path / "ppo")])
    history = Trainer(cfg).run()
    steps = [r for r in history if r["update"] > 0]
    assert [r["critic_only"] for r in steps] == [True, True, False, False]
    assert [r["N"] for r in steps] == [0, 0, 4, 8]  # warm-up responses are not counted in N
    assert all(r["critic_grad_norm"] is not None for r in steps)
    telemetry = json.loads((tmp_path / "ppo" / "telemetry.json").read_text())
    if not torch.cuda.is_available():
        assert telemetry["available"] is False and "unavailable" in telemetry["reason"]


@pytest.mark.parametrize("overrides,match", [
    (["--train.bogus", "1"], "unknown config key"),
    (["--nosuch.key", "1"], "unknown config section"),
    (["--train.b_train", "30", "--train.group_size", "8"], "divisible"),
    (["--gen.b_gen", "4", "--train.group_size", "8"], "at least one group"),
    (["--gen.top_p", "0"], "top_p"),
])
def test_bad_config_is_a_clear_error(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config("rlengine/configs/grpo.toml", overrides)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": 3}\n')
    with pytest.raises(DatasetError, match=r"data.jsonl:3"):
        read_jsonl(path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"data.jsonl:2: not valid JSON"):
        read_jsonl(path)
    with pytest.raises(DatasetError, match="not found"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_jsonl_task_uses_math_verify_reward(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}/2=", "answer": f"\\frac{{{i}}}{{2}}"}) + "\n"
                            for i in range(1, 12)))
    task = build_task("jsonl", path=str(path), num_eval=2)
    assert len(task.train) + len(task.eval) == 11
    assert task.reward_fn("0.5", "\\frac{1}{2}") == 1.0
    assert task.reward_fn("0.6", "\\frac{1}{2}") == 0.0


def test_embedded_default_job_learns(tmp_path, capsys):
    """`rlengine train` with no config: the RL phase takes held-out accuracy from < 30% to >= 90%."""
    torch.set_num_threads(2)
    assert main(["train", "--run.out_dir", str(tmp_path / "default"), "--run.progress", "false"]) == 0
    records = [json.loads(ln) for ln in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["N"], r["J"]) for r in records if "J" in r]
    assert curve[0][1] < 0.30, curve
    assert max(j for _, j in curve) >= 0.90, curve
    assert "J against N" in capsys.readouterr().out


def test_async_partial_rollouts_record_policy_lag(tmp_path):
    """B_gen > B_train: unfinished responses continue under new weights and carry their lag."""
    cfg = short_run_config(tmp_path, "async", ["--gen.b_gen", "48", "--gen.max_lag", "2", "--train.updates", "4",
                                               "--gen.max_tokens", "6"])
    tr = Trainer(cfg)
    assert tr.collector.async_mode
    history = [r for r in tr.run() if r["update"] > 0]
    lags = [r["policy_lag_max"] for r in history]
    assert max(lags) >= 1 and max(lags) <= 2, lags
    # with max_lag 0 every carried-over group is stale and dropped
    cfg0 = short_run_config(tmp_path, "async0", ["--gen.b_gen", "48", "--gen.max_lag", "0", "--train.updates", "3",
                                                 "--gen.max_tokens", "6"])
    history0 = [r for r in Trainer(cfg0).run() if r["update"] > 0]
    assert sum(r["stale_dropped"] + r["stale_aborted"] for r in history0) > 0
    assert all(r["policy_lag_max"] == 0 for r in history0)


def test_gen_enforce_eager_reaches_both_engines(tmp_path):
    tr = Trainer(short_run_config(tmp_path, "eager", ["--gen.enforce_eager", "true"]))
    assert tr.llm.cuda_graphs_off == tr.eval_llm.cuda_graphs_off == "enforce_eager=True"
    default = Trainer(short_run_config(tmp_path, "graphs"))
    assert "CUDA device" in default.llm.cuda_graphs_off  # this CPU: graphs off, and it says why
