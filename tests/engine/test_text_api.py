"""Text in, text out through the LLM API the way vLLM users write it, on the fixture checkpoint
(tests/support/text_ckpt.py, the session fixture `text_checkpoint` of tests/conftest.py).

References: one-shot tokenizer.decode for the detokenised text (and the same cut at a stop string),
transformers' AutoTokenizer.apply_chat_template ids (and its Qwen3ForCausalLM's greedy generate) for
LLM.chat, and the LM-head edit of text_ckpt.force_eos for
the two EOS ids of generation_config.json (with the file removed as the negative control).
"""

import json
import random

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.cli import main
from rlengine.engine.detokenizer import Detokenizer
from rlengine.model.factory import build_model
from rlengine.model.loader import CheckpointError
from rlengine.model.tokenizer import Tokenizer

from tests.support.text_ckpt import build_text_checkpoint, checkpoint_with_eos

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(text_checkpoint):
    return LLM(model=str(text_checkpoint.path), max_num_seqs=8)


def test_vllm_snippet_runs_and_text_is_the_decode(llm, capsys):
    outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                           SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32))
    for o in outputs:
        print(o.prompt, o.outputs[0].text)
    assert [o.prompt for o in outputs] == ["Hello, my name is", "The capital of France is"]
    assert "Hello, my name is" in capsys.readouterr().out
    for o in outputs:
        c = o.outputs[0]
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt, add_special_tokens=True)


def test_prompt_forms_agree(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    outs = [llm.generate(text, GREEDY)[0], llm.generate([{"prompt": text}], GREEDY)[0],
            llm.generate([{"prompt_token_ids": ids}], GREEDY)[0], llm.generate([ids], GREEDY)[0]]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, text, None, None]
    assert [o.outputs[0].text is None for o in outs] == [False, False, True, True]  # token prompts: no detok
    forced = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24, detokenize=True))[0]
    assert forced.outputs[0].text == outs[0].outputs[0].text
    assert llm.generate(text, SamplingParams(temperature=0.0, max_tokens=24, detokenize=False))[0].outputs[0].text \
        is None


def _printable_stop(text: str) -> str:
    """A 3-character stop string from the middle of text whose first occurrence is past position 2."""
    for i in range(3, len(text) - 3):
        cand = text[i:i + 3]
        if cand.isprintable() and "\ufffd" not in cand and text.find(cand) == i:
            return cand
    raise AssertionError(f"no printable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True], ids=["cut", "kept"])
def test_stop_string_cuts_the_text(llm, include):
    prompt = "Hello, my name is"
    free = llm.generate([prompt], GREEDY)[0].outputs[0]  # unconstrained: the stop string is sure to appear
    stop = _printable_stop(free.text)
    at = free.text.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                include_stop_str_in_output=include))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:at + len(stop) if include else at]
    # token_ids keep the token that completed the stop string, and end there
    n = len(out.token_ids)
    assert out.token_ids == free.token_ids[:n]
    dec = llm.tokenizer.decode
    assert stop in dec(out.token_ids) and stop not in dec(out.token_ids[:-1])


def test_async_scheduling_gives_the_same_text_stops_and_logprobs(llm, text_checkpoint):
    """Overlap: a stop string found at step t finishes a sample whose step t + 1 is already launched."""
    prompts = ["Hello, my name is", "The capital of France is", "日本"]
    free = llm.generate(prompts, GREEDY)
    stops = [_printable_stop(o.outputs[0].text) for o in free]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[s], logprobs=2) for s in stops]
    ref = llm.generate(prompts, params)
    got = LLM(model=str(text_checkpoint.path), max_num_seqs=8, async_scheduling=True).generate(prompts, params)
    for a, b in zip(got, ref):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, "stop", b.stop_reason)
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        torch.testing.assert_close(torch.tensor([r.logprob for e in a.logprobs for r in e.values()]),
                                   torch.tensor([r.logprob for e in b.logprobs for r in e.values()]), rtol=0, atol=1e-5)


def test_stop_strings_need_the_text():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)
    assert SamplingParams(stop="ab").stop == ["ab"]


def test_chat_matches_transformers(llm, text_checkpoint):
    import transformers
    ref_tok = transformers.AutoTokenizer.from_pretrained(text_checkpoint.path)
    conversations = [[{"role": "user", "content": "Hello, my name is"}],
                     [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "The capital of France is"}]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.chat(conversations, params)
    ref_model = transformers.Qwen3ForCausalLM.from_pretrained(text_checkpoint.path, dtype=torch.float32)
    for conv, out in zip(conversations, outs):
        ids = ref_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt_token_ids == ids
        assert out.prompt == ref_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert out.outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
        hf = ref_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        assert out.outputs[0].token_ids == hf[0, len(ids):].tolist()
    single = llm.chat(conversations[0], params)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("which", [0, 1], ids=["im_end", "endoftext"])
def test_generation_stops_at_either_eos_id(text_checkpoint, tmp_path, which):
    eos = text_checkpoint.eos_token_ids[which]
    tok = Tokenizer.from_pretrained(text_checkpoint.path)
    prompt = tok.encode("The capital of France is")
    step = 3 + 2 * which
    dst = tmp_path / "edited"
    expected = checkpoint_with_eos(text_checkpoint.path, dst, prompt, eos, step)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    out = LLM(model=str(dst)).generate([prompt], params)[0].outputs[0]
    assert out.token_ids == expected and out.token_ids[-1] == eos
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text is None  # a token prompt
    # the module path (the trainer's): the model config itself carries generation_config.json's ids
    assert eos in build_model(str(dst), device="cpu").config.eos_token_ids
    ignored = LLM(model=str(dst)).generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                                     ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids[:step + 1] == expected
    # negative control: <|endoftext|> is an EOS id only through generation_config.json
    (dst / "generation_config.json").unlink()
    again = LLM(model=str(dst)).generate([prompt], params)[0].outputs[0]
    if eos == tok.hf.token_to_id("<|endoftext|>"):
        assert again.finish_reason == "length" and again.token_ids[:step + 1] == expected
    else:
        assert again.token_ids == expected


def test_incremental_detokenisation_equals_one_shot_decode(text_checkpoint):
    tok = Tokenizer.from_pretrained(text_checkpoint.path)
    rng = random.Random(0)
    multibyte = tok.encode("日本 café naïve 東京 crème brûlée")
    bytes_ = [i for i in range(text_checkpoint.vocab_size) if len(tok.hf.id_to_token(i)) == 1]  # single bytes
    for trial in range(60):
        pool = [multibyte, bytes_, list(range(text_checkpoint.vocab_size))][trial % 3]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        prompt = tok.encode(rng.choice(["Hello, my name is", "日本", ""]))
        for skip in (True, False):
            d = Detokenizer(tok, prompt, skip_special_tokens=skip)
            seen = ""
            for t in ids:
                d.add(t)
                assert d.text.startswith(seen)  # only ever appended to
                seen = d.text
            d.finish()
            assert d.text == tok.decode(ids, skip_special_tokens=skip), (ids, prompt)


def test_string_prompt_without_tokenizer_is_a_clear_error(text_checkpoint):
    module = build_model(str(text_checkpoint.path), device="cpu")
    bare = LLM(module)
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate(["Hello"], GREEDY)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.chat([{"role": "user", "content": "Hello"}], GREEDY)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate([[5, 6]], SamplingParams(stop=["x"]))
    with_tok = LLM(module, tokenizer=str(text_checkpoint.path))  # the trainer's shared module + its tokenizer
    assert with_tok.generate(["Hello"], GREEDY)[0].outputs[0].text is not None


def test_missing_tokenizer_files_fail_at_construction(text_checkpoint, tmp_path):
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(text_checkpoint.path, dst)
    (dst / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        LLM(model=str(dst))
    assert main(["generate", "--model", str(dst), "--prompt", "Hello"]) == 2


def test_cli_generate_prints_the_text(llm, text_checkpoint, capsys):
    path = str(text_checkpoint.path)
    assert main(["generate", "--model", path, "--prompt", "Hello, my name is", "--max-tokens", "12"]) == 0
    want = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    assert capsys.readouterr().out == want + "\n"
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert main(["generate", "--model", path, "--chat", "--system", "Be brief.", "--prompt", "Hello",
                 "--max-tokens", "12"]) == 0
    want = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    assert capsys.readouterr().out == want + "\n"


def test_cli_generate_user_errors(text_checkpoint, tmp_path, capsys):
    base = build_text_checkpoint(tmp_path / "base", chat_template=None)
    assert main(["generate", "--model", str(base.path), "--chat", "--prompt", "Hello"]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "Hello"]) == 2
    assert "not found" in capsys.readouterr().err
    long = " ".join(["Hello"] * 600)
    assert main(["generate", "--model", str(text_checkpoint.path), "--prompt", long]) == 2
    assert "leaves no room" in capsys.readouterr().err
    cfg = json.loads((text_checkpoint.path / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 512  # the long prompt above is past it
