"""`rlengine bench prefill` and `rlengine bench learner` on the tiny preset: rows, JSON, bad input.

No timing is asserted. The learner bench's two sides must compute the same loss on the same weights
(rlengine's packed log-prob head against transformers' [B, S] logits), which checks that the bench
compares like with like; the prefill bench's two calls must give the same last-token logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlengine.benchmarks import learner, prefill
from rlengine.model.config import ConfigError


def test_learner_bench_rows_and_matching_losses(tmp_path, capsys):
    assert learner.main(["--model", "tiny", "--dtypes", "float32", "--micro-batch", "2", "--seq-len", "12",
                         "--prompt-len", "4", "--rounds", "1", "--threads", "1", "--plain-head",
                         "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "learner.json").read_text())
    (row,) = data["rows"]
    assert set(learner.COLUMNS) <= set(row) and row["micro_batch"] == 2 and row["seq_len"] == 12
    assert row["rlengine_ms"] > 0 and row["hf_ms"] > 0 and len(row["rounds_ms"]["hf"]) == 1
    assert row["plain_head_ms"] > 0 and len(row["rounds_ms"]["plain_head"]) == 1
    assert row["ratio_cpu"] > 0 and row["cpu_ms"]["rlengine"] > 0 and row["plain_head_ratio_cpu"] > 0
    # fp32 on both sides: the losses agree to fp32 rounding of a [T, V] log-softmax and a mean
    assert row["loss_diff"] < 1e-5
    assert data["threads"] == 1 and "cpu_model" in data
    assert "ratio" in capsys.readouterr().out


def test_learner_step_loss_is_the_masked_surrogate():
    from rlengine.model import Qwen3ForCausalLM
    from rlengine.model.config import preset

    model = Qwen3ForCausalLM(preset("tiny"), dtype=torch.float64)
    mb = learner._batch(model.config.vocab_size, 3, 10, 4, seed=1)
    loss = learner.rlengine_step(model, mb)
    with torch.no_grad():  # the reference: full logits of each sequence alone, float64
        logp = torch.cat([model(mb.input_ids[a:b][None]).log_softmax(-1)[0].gather(-1, mb.targets[a:b, None])[:, 0]
                          for a, b in zip(mb.cu_seqlens, mb.cu_seqlens[1:])])
        m = mb.loss_mask.double()
        want = (-(mb.advantages.double()) * torch.exp(logp - mb.old_logprobs.double()) * m).sum() / m.sum()
    assert abs(loss - want.item()) < 1e-9
    assert model.lm_head.weight.grad is not None
    # the diagnostic provider: the same loss, its log_softmax in fp32 (as the transformers side): fp32 rounding
    # of log-probs of magnitude < 8, ~1e-6 at most after the mean of A * ratio terms
    assert abs(learner.plain_head_step(model, mb) - want.item()) < 1e-6


def test_prefill_bench_rows_and_same_logits(tmp_path):
    assert prefill.main(["--model", "tiny", "--dtypes", "float32", "--lengths", "9", "--batches", "1,2",
                         "--rounds", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "prefill.json").read_text())
    assert [(r["seq_len"], r["batch"]) for r in data["rows"]] == [(9, 1), (9, 2)]
    assert all(r["ratio"] > 0 and r["ratio_cpu"] > 0 for r in data["rows"]) and data["threads"] == 1
    ours, hf = prefill.load_pair("tiny", torch.float32, 0, str(tmp_path))
    ours_call, hf_call = prefill.prefill_calls(ours, hf, 2, 9)
    torch.testing.assert_close(ours_call(), hf_call()[:, -1].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bench,argv", [
    (learner, ["--micro-batch", "0"]), (learner, ["--seq-len", "4", "--prompt-len", "8"]),
    (learner, ["--dtypes", "float16"]), (prefill, ["--lengths", "a"]), (prefill, ["--batches", "0"]),
    (prefill, ["--model", "tiny", "--lengths", "100000"]), (prefill, ["--model", "tiny", "--layers", "99"]),
])
def test_bad_input_names_the_option(bench, argv):
    with pytest.raises(ConfigError, match="--"):
        bench.main(argv)
