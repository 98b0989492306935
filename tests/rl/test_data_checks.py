"""Bad data is reported with file:line before training starts: empty prompts, non-string
answers (read_jsonl), prompts that do not fit the model (Task.check_prompts)."""

import json

import pytest

from rlengine.model.config import ConfigError
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data.tasks import DatasetError, build_task, first_digit_task, read_jsonl

GOOD = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10)]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_empty_prompt_names_its_line(tmp_path, prompt):
    path = _write(tmp_path / "data.jsonl", GOOD[:2] + [{"prompt": prompt, "answer": "1"}] + GOOD[2:])
    with pytest.raises(DatasetError, match=r"data\.jsonl:3: the prompt is empty"):
        read_jsonl(path)


@pytest.mark.parametrize("answer,shown", [(4, "int 4"), (0.5, "float 0.5"), (True, "bool true"),
                                          (None, "NoneType null"), ([1], "list [1]")])
def test_non_string_answer_names_its_line(tmp_path, answer, shown):
    path = _write(tmp_path / "data.jsonl", GOOD[:1] + [{"prompt": "1+1=", "answer": answer}] + GOOD[1:])
    with pytest.raises(DatasetError, match=r"data\.jsonl:2: 'answer' must be a string") as info:
        read_jsonl(path)
    assert shown in str(info.value)


def test_rows_keep_their_origin(tmp_path):
    # blank lines are skipped but still counted: line numbers match the file
    path = _write(tmp_path / "data.jsonl", GOOD[:2] + [""] + GOOD[2:4])
    problems = read_jsonl(path)
    assert [p.source for p in problems] == [f"{path}:{n}" for n in (1, 2, 4, 5)]
    assert problems[0].answer == "0"


def test_dataset_error_is_a_config_error():
    # the CLI prints ConfigError as one line without a traceback
    assert issubclass(DatasetError, ConfigError) and issubclass(DatasetError, ValueError)


def test_too_long_prompt_names_file_line_and_both_counts(tmp_path):
    tok = Tokenizer.builtin()
    long_prompt = "1234567890" * 3 + "="
    n = len(tok.encode(long_prompt))
    limit = max(len(tok.encode(r["prompt"])) for r in GOOD)
    assert limit < n
    train = _write(tmp_path / "train.jsonl", GOOD)
    held = _write(tmp_path / "held.jsonl", GOOD[:3] + [{"prompt": long_prompt, "answer": "1"}])
    task = build_task("jsonl", path=str(train), eval_path=str(held), reward="exact")
    task.check_prompts(tok.encode, n)                       # control: the long prompt fits a limit of n
    with pytest.raises(DatasetError) as info:
        task.check_prompts(tok.encode, limit, limit="max_position_embeddings 64 - gen.max_tokens 58")
    msg = str(info.value)
    assert f"{held}:4: prompt is {n} tokens, more than the {limit} allowed" in msg
    assert "max_position_embeddings 64 - gen.max_tokens 58" in msg
    assert "train.jsonl" not in msg                         # only the offending row is named
    # the train split is checked too
    _write(train, GOOD + [{"prompt": long_prompt, "answer": "1"}])
    task = build_task("jsonl", path=str(train), eval_path=str(held), reward="exact")
    with pytest.raises(DatasetError, match=rf"train\.jsonl:11: prompt is {n} tokens"):
        task.check_prompts(tok.encode, limit)


def test_many_bad_prompts_are_summarised(tmp_path):
    tok = Tokenizer.builtin()
    path = _write(tmp_path / "data.jsonl", [{"prompt": "9" * (20 + i), "answer": "1"} for i in range(8)])
    task = build_task("jsonl", path=str(path), eval_path=str(path), reward="exact")
    with pytest.raises(DatasetError, match=r"(?s)16 prompt\(s\) do not fit.*\(and 11 more\)"):
        task.check_prompts(tok.encode, 10)


def test_built_in_task_problems_are_named_by_split_and_index():
    tok = Tokenizer.builtin()
    task = first_digit_task(20, 4, seed=0)
    task.check_prompts(tok.encode, 11)                      # "5830271694:" is 11 tokens
    with pytest.raises(DatasetError, match=r"first-digit train\[0\]: prompt is 11 tokens, more than the 10"):
        task.check_prompts(tok.encode, 10)
    with pytest.raises(DatasetError, match="encodes to no tokens"):
        task.check_prompts(lambda text: [], 10)
