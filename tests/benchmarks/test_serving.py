"""`rlengine bench serve`: vLLM-style metrics on hand-made timelines (every number exact), the arrival
schedule, and one short run of the engine at a small request rate on the tiny preset."""

import json
import statistics

import pytest

from rlengine.benchmarks import serve
from rlengine.benchmarks.serving_metrics import RequestTiming, parse_slos, percentile, serving_metrics


def test_metrics_follow_vllm_definitions():
    reqs = [RequestTiming(arrival=0.0, input_len=10, token_times=[0.1, 0.2, 0.4]),
            RequestTiming(arrival=0.5, input_len=20, token_times=[0.8]),
            RequestTiming(arrival=1.0, input_len=5, token_times=[])]          # never served: not completed
    m = serving_metrics(reqs, duration_s=2.0, slos={"ttft": 150.0})
    assert m["completed"] == 2 and m["total_input_tokens"] == 30 and m["total_output_tokens"] == 4
    assert m["request_throughput"] == pytest.approx(1.0) and m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(17.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)                        # (100 + 300) / 2
    assert m["median_tpot_ms"] == pytest.approx(150.0)                      # (400 - 100) / 2, the only one
    assert m["mean_itl_ms"] == pytest.approx(150.0) and m["p99_itl_ms"] == pytest.approx(199.0)  # gaps 100, 200
    assert m["mean_e2el_ms"] == pytest.approx((400 + 300) / 2)
    assert m["request_goodput"] == pytest.approx(0.5)                       # only the first meets ttft <= 150 ms
    assert serving_metrics(reqs, 2.0)["request_goodput"] is None


def test_percentile_interpolates_like_numpy():
    v = [3.0, 1.0, 4.0, 1.5, 9.0]
    assert percentile(v, 50) == statistics.median(v)
    assert percentile(v, 99) == pytest.approx(9.0 - 0.04 * 5.0)             # numpy.percentile(v, 99)
    assert percentile([2.0], 90) == 2.0


def test_slo_parsing_and_arrivals():
    assert parse_slos("ttft:500 tpot:50") == {"ttft": 500.0, "tpot": 50.0} and parse_slos(None) == {}
    with pytest.raises(ValueError, match="ttft"):
        parse_slos("latency:3")
    a = serve.arrival_times(200, 10.0, seed=1)
    assert a[0] == 0.0 and a == sorted(a) and a == serve.arrival_times(200, 10.0, seed=1)
    assert 0.5 / 10 < a[-1] / 199 < 2.0 / 10                                 # mean gap near 1 / rate
    assert serve.arrival_times(4, float("inf")) == [0.0] * 4
    with pytest.raises(ValueError):
        serve.arrival_times(3, 0.0)


def test_serve_bench_runs_at_a_small_rate(tmp_path, capsys):
    assert serve.main(["--model", "tiny", "--num-requests", "6", "--request-rate", "40,inf", "--input-len", "6",
                       "--output-len", "4", "--length-dist", "uniform", "--max-num-seqs", "4",
                       "--goodput", "ttft:10000", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert [r["request_rate"] for r in data["rows"]] == [40.0, "inf"]
    for r in data["rows"]:
        assert r["completed"] == 6 and r["total_output_tokens"] == sum(
            serve.sample_lengths("uniform", 4, 6, seed=1))                 # every token stamped once
        assert r["median_ttft_ms"] > 0 and r["request_goodput"] == pytest.approx(r["request_throughput"])
    c = data["conditions"]
    assert c["attention_backend"] in ("cpp", "torch") and c["cuda_graphs"].startswith("off") and "dirty" in c
    assert "TTFT" in serve.__doc__ and "median_ttft_ms" in capsys.readouterr().out
