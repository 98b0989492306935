"""The packaged GSM8K example job: name resolution, the shipped sample, GSM8K row mapping, the format
reward, and a 5-update GRPO run with the chat template on an offline text checkpoint whose prompts
must equal transformers' apply_chat_template output and whose generation stops at an EOS id that only
generation_config.json lists."""

import ast
import fnmatch
import json
from importlib import resources
from pathlib import Path

import pytest

from rlengine.model.config import ConfigError
from rlengine.rl.config import load_job_config
from rlengine.rl.data.rewards import final_answer_format, get_reward
from rlengine.rl.data.tasks import build_task, gsm8k_row
from rlengine.rl.trainer import Trainer

from tests.support.text_ckpt import build_text_checkpoint, checkpoint_with_eos

SAMPLE = "rlengine:configs/data/gsm8k_sample.jsonl"


def test_bare_name_resolves_to_the_packaged_config(tmp_path):
    cfg = load_job_config("gsm8k", ["--model.name", str(tmp_path)])
    assert (cfg.task.name, cfg.task.reward, cfg.task.chat_template) == ("jsonl", "math", True)
    assert (cfg.model.dtype, cfg.gen.max_tokens, cfg.train.lr, cfg.train.kl_coef) == ("bfloat16", 512, 1e-6, 0.0)
    with pytest.raises(ConfigError, match="model.name is required"):
        load_job_config("gsm8k")
    with pytest.raises(ConfigError, match=r"no packaged config of that name \(packaged: grpo, grpo_long, grpo_tools, gsm8k, ppo"):
        load_job_config("nosuchjob")
    assert load_job_config("grpo").task.name == "first-digit"  # the existing bundled configs resolve by name too


def test_sample_is_package_data_and_maps_gsm8k_rows():
    shipped = Path(str(resources.files("rlengine") / "configs" / "data" / "gsm8k_sample.jsonl"))
    rows = [json.loads(ln) for ln in shipped.read_text().splitlines()]
    assert len(rows) == 20 and all(set(r) == {"question", "answer"} and "####" in r["answer"] for r in rows)
    # setup.py ships it (an installed package has it)
    tree = ast.parse((Path(__file__).resolve().parents[2] / "setup.py").read_text())
    data = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                for kw in node.keywords if kw.arg == "package_data")
    patterns = ast.literal_eval(data)["rlengine"]
    assert any(fnmatch.fnmatch("configs/data/gsm8k_sample.jsonl", p) for p in patterns)
    task = build_task("jsonl", path=SAMPLE, num_eval=4)
    problems = task.train + task.eval
    assert len(problems) == 20 and len(task.eval) == 4
    assert all(p.answer.isdigit() and "solution" in p.extra and p.extra["solution"].endswith(p.answer)
               for p in problems)
    assert "1200" not in {p.answer for p in problems} and "375" in {p.answer for p in problems}  # "1,200 ..." row
    assert gsm8k_row({"question": "q", "answer": "so 1,200 + 5\n#### 1,205"}) == \
        {"prompt": "q", "answer": "1205", "solution": "so 1,200 + 5\n#### 1,205"}
    assert gsm8k_row({"prompt": "p", "answer": "3"}) == {"prompt": "p", "answer": "3"}
    for answer in ("####", "x #### ,", "5 ####  "):  # no final after the marker: not a GSM8K solution, kept
        assert gsm8k_row({"prompt": "p", "answer": answer}) == {"prompt": "p", "answer": answer}


@pytest.mark.parametrize("text,want", [
    ("so the answer is \\boxed{42}.", 1.0), ("\\boxed{ }", 0.0), ("steps\n#### 1,205\n", 1.0),
    ("#### twelve", 0.0), ("the answer is 42", 0.0), ("#### -3.5", 1.0),
])
def test_format_reward(text, want):
    assert final_answer_format(text, "") == want and get_reward("format") is final_answer_format


def _reference_ids(hf_tok, messages):
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_gsm8k_job_with_chat_template_on_a_text_checkpoint(tmp_path):
    import transformers
    src = build_text_checkpoint(tmp_path / "src")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(src.path))
    system = load_job_config("gsm8k", ["--model.name", str(src.path)]).task.system_prompt
    problems = build_task("jsonl", path=SAMPLE, num_eval=4)
    reference = {p.prompt: _reference_ids(hf_tok, [{"role": "system", "content": system},
                                                   {"role": "user", "content": p.prompt}])
                 for p in problems.train + problems.eval}
    first = json.loads(Path(str(resources.files("rlengine") / "configs/data/gsm8k_sample.jsonl"))
                       .read_text().splitlines()[0])["question"]
    eot = src.eos_token_ids[1]  # <|endoftext|>: an EOS only through generation_config.json
    expected = checkpoint_with_eos(src.path, tmp_path / "ckpt", reference[first], eot, step=3)
    over = ["--model.name", str(tmp_path / "ckpt"), "--model.dtype", "float32", "--model.device", "cpu",
            "--task.reward_workers", "0", "--gen.max_tokens", "8", "--train.updates", "5",
            "--train.prompts_per_step", "2", "--train.group_size", "4", "--train.warmup_updates", "1",
            "--train.overlong_buffer", "2", "--train.dynamic_sampling", "false", "--eval.k", "1",
            "--eval.temperature", "0", "--eval.every", "5", "--eval.sets", f'{{sample = "{SAMPLE}"}}',
            "--run.out_dir", str(tmp_path / "run"), "--run.progress", "false", "--run.checkpoint_every", "0",
            "--run.samples_every", "5"]
    tr = Trainer(load_job_config("gsm8k", over))
    seen, evals = [], []
    add, gen = tr.llm.add_request, tr.eval_llm.generate
    tr.llm.add_request = lambda ids, params: seen.append(list(ids)) or add(ids, params)
    tr.eval_llm.generate = lambda prompts, params: evals.append((prompts, out := gen(prompts, params))) or out
    history = tr.run()
    assert [r["update"] for r in history] == [0, 1, 2, 3, 4, 5]
    assert len(seen) == 5 * 2 and all(ids in reference.values() for ids in seen)
    prompts, outs = evals[0]  # update 0: greedy, before any update
    i = prompts.index(reference[first])
    assert outs[i].outputs[0].token_ids == expected and expected[-1] == eot
    assert outs[i].outputs[0].finish_reason == "stop"
    assert all(len(o.outputs[0].token_ids) == 8 or o.outputs[0].finish_reason == "stop" for o in outs)
    last = history[-1]
    assert {"eval/sample/mean@1", "eval/sample/pass@1", "overlong_frac", "lr"} <= set(last)
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["prompt"].endswith("<|im_start|>assistant\n") for r in rows)


def test_chat_template_without_template_is_a_config_error(tmp_path):
    base = build_text_checkpoint(tmp_path / "base", chat_template=None)
    over = ["--model.name", str(base.path), "--model.dtype", "float32", "--model.device", "cpu",
            "--task.reward_workers", "0", "--train.warmup_updates", "0", "--run.out_dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match="no chat template"):
        Trainer(load_job_config("gsm8k", over))


def test_plain_prompts_get_the_tokenizers_special_tokens_like_transformers(tmp_path):
    """Without a chat template a prompt is encoded as transformers / vLLM encode text (a Llama 3 base
    model's BOS included); the built-in tokenizer has no post-processor, so its prompts are unchanged."""
    from tokenizers import processors

    import transformers
    from rlengine.model.tokenizer import Tokenizer
    from rlengine.rl.data.prompts import PromptEncoder

    base = build_text_checkpoint(tmp_path / "base", chat_template=None)
    tok = Tokenizer.from_pretrained(base.path)
    bos = tok.hf.token_to_id("<|im_start|>")
    tok.hf.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    tok.hf.save(str(base.path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(base.path)
    text = "Natalia sold 48 clips in April."
    ids = PromptEncoder(tok)(text)
    assert ids[0] == bos and ids[1:] == tok.encode(text)
    assert ids == transformers.AutoTokenizer.from_pretrained(base.path)(text)["input_ids"]
    builtin = Tokenizer.builtin()
    assert PromptEncoder(builtin)("12+3=") == builtin.encode("12+3=")
