"""`rlengine bench decode --count-launches`: today's launch counts of one decode step, pinned.

The Triton backend's path under the interpreter (kernel bodies skipped: only launches are counted),
132 simulated SMs, max_model_len 40,960, a 2- and a 4-layer model. A change that adds a kernel to a
layer, a launch outside the layers, or takes the head / sampler out of the graph fails here; update
the pins only together with the reason in the change.
"""

import json

import pytest

from rlengine.benchmarks import decode_launches as dl
from rlengine.cli import main as cli_main

# per layer: 2 add+RMSNorm, q/k-norm+RoPE, split-KV decode (Triton); qkv, o, gate_up, down GEMMs and the K/V
# store (torch); no merge at one split
PER_LAYER_TRITON = {"_rms_norm_kernel": 2, "_qk_norm_rope_kernel": 1, "_split_kernel": 1, "_silu_and_mul_kernel": 1}
PER_LAYER = 10
# outside the layers: embedding, final norm, LM head, greedy sampler (max, gather, logsumexp, sub), 2 packing copies
CONSTANT = 9


@pytest.fixture(scope="module")
def table():
    return {row["b_act"]: row for row in dl.launch_table((1, 64), (2, 4))}


@pytest.mark.parametrize("b_act", [1, 64])
def test_launch_counts_are_pinned(table, b_act):
    row = table[b_act]
    assert row["eager_per_layer"] == row["graph_per_layer"] == PER_LAYER
    assert row["eager_constant"] == row["graph_inside_constant"] == CONSTANT
    kinds = row["eager_by_kind"]
    assert kinds[4]["triton"] - kinds[2]["triton"] == 2 * sum(PER_LAYER_TRITON.values())
    assert {k: v for k, v in row["eager_ops"]["triton"].items() if k != "_rms_norm_kernel"} == \
        {k: 2 * v for k, v in PER_LAYER_TRITON.items() if k != "_rms_norm_kernel"}
    assert row["eager_ops"]["triton"]["_rms_norm_kernel"] == 2 * 2 + 1  # + the final norm
    assert "_merge_kernel" not in row["graph_inside_ops"]["triton"] and row["kv_splits"] == 1
    # the sampler's log-prob is z[token] - logsumexp(z): no [B, V] log_softmax in the step
    assert not {"_log_softmax", "log_softmax"} & set(row["graph_inside_ops"]["torch"])
    assert row["graph_inside_ops"]["torch"]["logsumexp"] == 1


@pytest.mark.parametrize("b_act", [1, 64])
def test_head_and_sampler_in_the_graph_leave_at_most_four_launches_outside(table, b_act):
    row = table[b_act]
    # the replay and the copy of its packed tokens | log-probs (the D2H copy on a GPU), + the H2D upload there
    assert row["graph_outside_ops"] == {"triton": {}, "torch": {}, "copies": {"copy_": 1}, "replays": 1}
    assert row["graph_outside_gpu"] == 3 <= 4
    assert row["graph_outside_top_p"] == row["graph_outside"]


def test_capacity_would_plan_33_splits_at_b1(table):
    """What the graph planned before splits followed the context: 132 SMs, Hkv 8 -> ceil(264 / 8)."""
    assert table[1]["capacity_splits"] == 33 and table[64]["capacity_splits"] == 1


def test_cli_count_launches(tmp_path, capsys):
    assert cli_main(["bench", "decode", "--count-launches", "--batches", "1", "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_launches.json").read_text())
    assert [r["b_act"] for r in data["rows"]] == [1] and data["sms"] == 132 and data["max_model_len"] == 40960
    assert "eager_per_layer" in capsys.readouterr().out


def test_cli_count_launches_bad_sms(tmp_path, capsys):
    assert cli_main(["bench", "decode", "--count-launches", "--sms", "0", "--device", "cpu",
                     "--out", str(tmp_path)]) == 2
    assert "--sms must be >= 1" in capsys.readouterr().err
