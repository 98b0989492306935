"""Multi-turn jobs end to end: the [env] section builds the drivers, evaluation runs episodes (J is the
environments' reward), and the built-in tool task (configs/grpo_tools.toml) learns in a short smoke run.
"""

import json

import pytest
import torch

from rlengine import LLM
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.config import EvalSection, load_job_config
from rlengine.rl.data.reward_pool import InlineRunner
from rlengine.rl.data.tasks import Problem
from rlengine.rl.distributed import Dist
from rlengine.rl.env import End, Environment, TrajectoryDriver, TrajectoryLimits
from rlengine.rl.rollout.evaluation import EvalSet, Evaluator
from rlengine.rl.trainer import Trainer


class AnswerEnv(Environment):
    """Two model turns with an observation between; the episode's reward is whether the row's answer is "1"."""

    def step(self, turn):
        return [7, 8] if turn.index == 0 else End(float(self.problem.answer == "1"))


def test_evaluation_runs_episodes_and_j_is_the_environments_reward():
    problems = [Problem(f"{i}:", a) for i, a in enumerate("01101")]
    tok = Tokenizer.builtin()
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=2), max_num_seqs=10, block_size=4)
    driver = TrajectoryDriver(AnswerEnv, tok, TrajectoryLimits(max_turns=3, max_turn_tokens=4, max_total_tokens=16))
    ev = Evaluator(llm, tok.encode, InlineRunner(lambda c, a: 0.5), tok, [EvalSet("heldout", problems)],
                   EvalSection(k=2, temperature=1.0), max_tokens=16, seed=0, max_error_frac=0.0, dist=Dist(),
                   env=driver)
    m = ev.run()
    assert m["J"] == 3 / 5 and m["eval/heldout/pass@2"] == 3 / 5  # the environments', not the reward fn's 0.5
    assert not driver.live and not driver.done and not llm.has_unfinished()


def test_env_section_wires_a_plugin_environment_into_the_job(tmp_path):
    cfg = load_job_config(None, ["--env.name", "tests.rl.test_env_job:AnswerEnv", "--env.max_turns", "2",
                                 "--env.max_turn_tokens", "4", "--gen.max_tokens", "12", "--train.updates", "1",
                                 "--train.group_size", "2", "--train.prompts_per_step", "2",
                                 "--train.dynamic_sampling", "false", "--warmstart.steps", "0",
                                 "--task.num_eval", "8", "--run.out_dir", str(tmp_path / "run"), "--run.progress",
                                 "false"])
    trainer = Trainer(cfg)
    assert trainer.parts.collector.env is not None and trainer.parts.evaluator.env is not None
    answers = [p.answer for p in trainer.parts.evaluator.problems]
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["num_turns/max"] == 2 and rows[-1]["multi_turn/obs_tokens_mean"] == 2.0  # 2 turns each
    j = [r["J"] for r in rows if "J" in r]
    assert j and all(x == sum(a == "1" for a in answers) / len(answers) for x in j)  # J on episodes


@pytest.fixture
def one_thread():
    """One torch thread, as the job's own runs (OMP_NUM_THREADS=1): the curve below was recorded so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tool_task_smoke_j_rises(tmp_path, one_thread):
    """configs/grpo_tools.toml cut to 30 updates: the format warm start leaves J near chance, RL lifts it."""
    cfg = load_job_config("grpo_tools", ["--train.updates", "30", "--eval.every", "30", "--task.num_eval", "64",
                                         "--run.out_dir", str(tmp_path / "run"), "--run.progress", "false"])
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    j = [r["J"] for r in rows if "J" in r]
    calls = [r["tools/calls_per_trajectory"] for r in rows if "tools/calls_per_trajectory" in r]
    assert len(j) == 2 and j[0] <= 0.3 and j[-1] >= j[0] + 0.1, j
    assert len(calls) == 30 and min(calls) > 0.5  # the warm start taught the call: trajectories use the tool
