"""A text checkpoint built offline: a trained byte-level BPE tokenizer, a ChatML chat template, two EOS ids
and a random tiny Qwen3 whose vocabulary matches the tokenizer.

    from tests.support.text_ckpt import build_text_checkpoint, force_eos
    ckpt = build_text_checkpoint(tmp_path / "ckpt")    # or the session fixture `text_checkpoint` (tests/conftest.py)
    LLM(model=str(ckpt.path)); AutoTokenizer.from_pretrained(ckpt.path)  # both load it

The directory holds what a Hugging Face chat model ships: tokenizer.json (BPE trained here with the
`tokenizers` library on CORPUS, specials <|endoftext|> <|im_start|> <|im_end|>), tokenizer_config.json
(eos as an AddedToken dict, pad, CHAT_TEMPLATE: ChatML with a default system prompt), generation_config.json
(eos_token_id = [<|im_end|>, <|endoftext|>]; config.json names <|im_end|> only, as Qwen3 chat checkpoints do,
so <|endoftext|> stops a response only through generation_config.json), model.safetensors (rlengine's save_pretrained,
untied embeddings so editing an LM-head row leaves the input embeddings alone). transformers loads it too
(AutoTokenizer, Qwen3ForCausalLM). A random model never emits EOS on its own: `force_eos` edits the LM
head so that greedy decoding of one prompt stops with a chosen EOS id after a chosen number of tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlengine.model.config import ModelConfig
from rlengine.model.loader import load_pretrained, save_pretrained
from rlengine.model.qwen3 import Qwen3ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (the BPE trainer puts them first)
CORPUS = [
    "Hello, my name is Ada and I like to write programs.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "You are a helpful assistant. Answer the question in one sentence.",
    "What is two plus three? Two plus three is five.",
    "A café in Paris serves crème brûlée; the naïve visitor orders two.",
    "日本 is Japan, 日本語 is Japanese, 東京 is Tokyo.",
    "user assistant system: the quick brown fox jumps over the lazy dog 0123456789",
]
# ChatML in Qwen2.5's shape: the system turn if given, else a default one; whitespace control on every tag.
CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant after the system turn') }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


@dataclass(frozen=True)
class TextCheckpoint:
    """What build_text_checkpoint wrote."""

    path: Path                 # the checkpoint directory
    eos_token_ids: list[int]   # generation_config.json's eos_token_id list: [<|im_end|>, <|endoftext|>]
    vocab_size: int            # tokenizer vocabulary = the model's vocab_size


def train_tokenizer(vocab_size: int = 400) -> HFTokenizer:
    """Byte-level BPE trained on CORPUS (every byte is in the alphabet, so any text encodes)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def build_text_checkpoint(path: str | Path, *, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
                          num_layers: int = 2) -> TextCheckpoint:
    """Write the checkpoint directory described in the module docstring; returns its facts.

    chat_template=None leaves the template out (a base model). Takes well under a second.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False, "special": True},
        "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 1024,
    }
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot], "bos_token_id": None}))
    V = tok.get_vocab_size()
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rope_theta=10_000.0, tie_word_embeddings=False, eos_token_id=im_end, pad_token_id=eot)
    save_pretrained(Qwen3ForCausalLM(cfg, device="cpu", dtype=torch.float32, seed=seed), path)
    return TextCheckpoint(path, [im_end, eot], V)


@torch.no_grad()
def greedy_ids(model: Qwen3ForCausalLM, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain-forward greedy decoding (no cache, no EOS): the reference the engine must reproduce."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids], device=model.device))[0, -1].argmax()))
    return ids[len(prompt_ids):]


@torch.no_grad()
def force_eos(model: Qwen3ForCausalLM, prompt_ids: list[int], eos_id: int, step: int,
              margin: float = 10.0) -> list[int]:
    """Edit LM-head row `eos_id` in place so greedy decoding of prompt_ids emits `step` unchanged tokens
    and then eos_id; returns those step + 1 token ids.

    How: decode greedily `step` tokens, take the final hidden states h_0..h_step that choose tokens
    0..step, and set the row to the part of h_step orthogonal to h_0..h_{step-1}, scaled so its logit at
    step `step` beats the best other logit by `margin`. At the earlier steps its logit is ~0 (orthogonal),
    below the (positive) best logit there, so those tokens do not change: exact for this prompt whatever
    the random weights. Needs an untied LM head (asserted) and step < hidden size.
    """
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "tied embeddings"
    gen = greedy_ids(model, prompt_ids, step)
    seq = torch.tensor(list(prompt_ids) + gen, device=model.device)
    hidden = model.forward_packed(seq, [0, len(seq)], return_hidden=True).double()
    hidden = hidden[len(prompt_ids) - 1:]  # [step + 1, C]: the states that choose tokens 0..step
    q, _ = torch.linalg.qr(hidden[:step].T) if step else (hidden[:0].T, None)  # orthonormal basis of h_0..h_{step-1}
    h = hidden[step]
    row = h - q @ (q.T @ h)
    W = model.lm_head.weight
    W[eos_id] = 0.0
    logits = hidden @ W.double().T  # [step+1, V] without the EOS row
    assert (logits[:step].max(dim=-1).values > 1e-3).all(), "an earlier step's best logit is not positive"
    W[eos_id] = (row * (logits[step].max() + margin) / (row @ h)).to(W.dtype)
    got = greedy_ids(model, prompt_ids, step + 1)
    assert got == gen + [eos_id], (got, gen, eos_id)
    return got


def checkpoint_with_eos(src: Path, dst: Path, prompt_ids: list[int], eos_id: int, step: int) -> list[int]:
    """Copy checkpoint `src` to `dst` with force_eos applied to its weights; returns the expected ids."""
    import shutil

    shutil.copytree(src, dst)
    model = load_pretrained(dst)
    expected = force_eos(model, prompt_ids, eos_id, step)
    save_pretrained(model, dst)
    return expected
