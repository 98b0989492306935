"""Named eval sets: mean@k and pass@k per set (hand-derived), J from the primary set, config shapes.

pass@k here is the fraction of prompts with at least one of their k samples correct (reward >=
eval.pass_threshold); with exactly k samples per prompt that is also the unbiased estimator at n = k.
"""

import json
from types import SimpleNamespace

import pytest

from rlengine.model.config import ConfigError
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.config import EvalSection, load_job_config
from rlengine.rl.distributed import Dist
from rlengine.rl.rollout.evaluation import EvalSet, Evaluator
from rlengine.rl.data.reward_pool import InlineRunner
from rlengine.rl.data.tasks import Problem
from rlengine.rl.trainer import Trainer


class ScriptedLLM:
    """Stand-in engine: the k samples of each prompt are fixed strings (which the reward scores)."""

    def __init__(self, tok, samples: dict[str, list[str]]):
        self.tok, self.samples, self.params = tok, samples, []

    def generate(self, prompts, params):
        self.params.extend(params)
        outs = []
        for ids in prompts:
            texts = self.samples[self.tok.decode(ids)]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=self.tok.encode(t)) for t in texts]))
        return outs


def _evaluator(section, threshold_reward=None):
    tok = Tokenizer.builtin()
    a = [Problem("1:", "1"), Problem("2:", "2"), Problem("3:", "3")]
    b = [Problem("4:", "4"), Problem("5:", "5")]
    # set a: prompt 1 one of two right, prompt 2 none, prompt 3 both; set b: only the last sample of prompt 5
    samples = {"1:": ["1", "9"], "2:": ["0", "0"], "3:": ["3", "3"], "4:": ["0", "0"], "5:": ["0", "5"]}
    llm = ScriptedLLM(tok, samples)
    reward = threshold_reward or (lambda c, ans: float(c == ans))
    sets = [EvalSet("a", a), EvalSet("b", b)]
    return Evaluator(llm, tok.encode, InlineRunner(reward), tok, sets, section, max_tokens=2, seed=0,
                     max_error_frac=0.0, dist=Dist()), llm


def test_mean_and_pass_at_k_by_hand():
    ev, llm = _evaluator(EvalSection(k=2, sets={"a": "a.jsonl", "b": "b.jsonl"}))
    m = ev.run()
    assert m["eval/a/mean@2"] == pytest.approx(3 / 6) and m["eval/a/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/b/mean@2"] == pytest.approx(1 / 4) and m["eval/b/pass@2"] == pytest.approx(1 / 2)
    assert m["J"] == m["eval/a/mean@2"] and m["eval_reward_errors"] == 0
    assert len({p.seed for p in llm.params}) == 5  # one seed per prompt across both sets
    ev, _ = _evaluator(EvalSection(k=2, sets={"a": "a.jsonl", "b": "b.jsonl"}, primary="b"))
    assert ev.run()["J"] == pytest.approx(1 / 4)


def test_pass_threshold():
    # partial credit 0.5 for a wrong digit: mean@k counts it, pass@k (threshold 1) does not
    reward = lambda c, ans: 1.0 if c == ans else 0.5  # noqa: E731
    ev, _ = _evaluator(EvalSection(k=2, sets={"a": "a.jsonl", "b": "b.jsonl"}), reward)
    m = ev.run()
    assert m["eval/a/mean@2"] == pytest.approx((1 + .5 + .5 + .5 + 1 + 1) / 6) and m["eval/a/pass@2"] == pytest.approx(2 / 3)
    ev, _ = _evaluator(EvalSection(k=2, sets={"a": "a.jsonl", "b": "b.jsonl"}, pass_threshold=0.5), reward)
    assert ev.run()["eval/a/pass@2"] == 1.0


def test_config_shapes_and_unknown_primary(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[eval]\nk = 2\nprimary = "math"\n[eval.sets]\ngsm8k = "g.jsonl"\nmath = "m.jsonl"\n')
    cfg = load_job_config(toml)
    assert cfg.eval.sets == {"gsm8k": "g.jsonl", "math": "m.jsonl"} and cfg.eval.primary_set == "math"
    inline = load_job_config(None, ["--eval.sets", '{x = "x.jsonl"}'])
    assert inline.eval.set_names == ["x"] and inline.eval.primary_set == "x"
    assert load_job_config(None, []).eval.set_names == ["heldout"]  # no sets: the task's held-out split
    with pytest.raises(ConfigError, match="eval.primary = 'nope' is not an eval set; sets: gsm8k, math"):
        load_job_config(toml, ["--eval.primary", "nope"])
    with pytest.raises(ConfigError, match="eval.primary"):
        load_job_config(None, ["--eval.primary", "x"])


def test_trainer_reports_every_set_and_j_from_primary(tmp_path):
    def write(name, digits):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{d}{d + 1}{d + 2}:", "answer": str(d)}) + "\n"
                                for d in digits))
        return str(path)
    train, a, b = write("train", range(7)), write("a", [1, 2, 3]), write("b", [4, 5])
    over = ["--task.name", "jsonl", "--task.path", train, "--task.reward", "exact", "--warmstart.steps", "5",
            "--train.updates", "2", "--train.prompts_per_step", "2", "--train.group_size", "4", "--eval.k", "2",
            "--eval.every", "1", "--run.progress", "false", "--eval.sets", f'{{a = "{a}", b = "{b}"}}',
            "--eval.primary", "b", "--run.out_dir", str(tmp_path / "run")]
    history = Trainer(load_job_config("grpo", over)).run()
    for r in [h for h in history if "J" in h]:
        assert {"eval/a/mean@2", "eval/a/pass@2", "eval/b/mean@2", "eval/b/pass@2"} <= set(r)
        assert r["J"] == r["eval/b/mean@2"] and r["eval/a/pass@2"] >= r["eval/a/mean@2"] - 1e-12
    default = Trainer(load_job_config("grpo", ["--warmstart.steps", "0", "--train.updates", "1",
                                           "--train.prompts_per_step", "2", "--train.group_size", "4",
                                           "--task.num_eval", "4", "--task.num_train", "20", "--run.progress",
                                           "false", "--run.out_dir", str(tmp_path / "default")])).run()
    assert default[0]["J"] == default[0]["eval/heldout/mean@4"]
