"""`rlengine bench decode` as a user drives it, on the tiny preset (no assertion on how long anything took).

The timing method is checked on a fake clock: every generate() call of either provider advances
it by a fixed cost plus a per-token cost, so the difference method must recover exactly the
per-token cost and the ratio of the two. Also: the round order (rlengine and transformers
alternate), the prefill row, one meaning per column in the output and the JSON, defaults in
--help, the figure's transformers lines, and that no earlier default-named result is overwritten.
"""

import json

import pytest

from rlengine.benchmarks import decode, decode_rounds
from rlengine.benchmarks.hf_baseline import HFProvider
from rlengine.engine.llm import LLM

TINY = ["--model", "tiny", "--batches", "1,2", "--gen-len", "3", "--reps", "2", "--prefill-len", "16",
        "--kv-memory-gb", "0.01"]
OURS_FIXED, OURS_TOKEN, HF_FIXED, HF_TOKEN = 5.0, 0.25, 3.0, 0.5  # fake seconds per call and per generated token


class FakeClock:
    """A perf_counter that only moves when a provider's generate call says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    """Each rlengine generate(n tokens) takes OURS_FIXED + n * OURS_TOKEN fake seconds, each transformers
    call HF_FIXED + n * HF_TOKEN; returns (clock, call log of (provider, n))."""
    clock, calls = FakeClock(), []
    real_generate, real_steps = LLM.generate, HFProvider.step_times

    def ours(self, prompts, params=None, **kw):
        calls.append(("ours", params.max_tokens))
        clock.now += OURS_FIXED + params.max_tokens * OURS_TOKEN
        return real_generate(self, prompts, params, **kw)

    def hf(self, prompts, gen_len):
        calls.append(("hf", gen_len))
        clock.now += HF_FIXED + gen_len * HF_TOKEN
        return real_steps(self, prompts, gen_len)

    monkeypatch.setattr(decode_rounds, "time", clock)
    monkeypatch.setattr(LLM, "generate", ours)
    monkeypatch.setattr(HFProvider, "step_times", hf)
    return clock, calls


def test_difference_timing_alternates_providers_and_recovers_the_step(tmp_path, fake_clock, capsys):
    _, calls = fake_clock
    assert decode.main(TINY + ["--batches", "2", "--out", str(tmp_path), "--no-plot"]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    (row,) = data["rows"]
    assert row["ms_per_step"] == pytest.approx(1e3 * OURS_TOKEN)       # (wall(3) - wall(1)) / 2
    assert row["hf_ms_per_step"] == pytest.approx(1e3 * HF_TOKEN)
    assert row["ratio"] == pytest.approx(HF_TOKEN / OURS_TOKEN)
    assert row["ms_per_step_reps"] == pytest.approx([1e3 * OURS_TOKEN] * 2)
    assert data["conditions"]["timing"] == "difference"
    # warm-up (8 -> gen-len 3 tokens; transformers a full round), then 2 rounds alternating, then the prefill row
    decode_calls = calls[:calls.index(("ours", 1), 4 + 4 * 2)]
    assert decode_calls == [("ours", 1), ("ours", 3), ("hf", 1), ("hf", 3)] * 3
    pre = data["prefill"]
    assert pre["prompt_len"] == 16 and pre["b"] == 1
    assert pre["ms"] == pytest.approx(1e3 * (OURS_FIXED + OURS_TOKEN))   # wall(generate 1 token)
    assert pre["hf_ms"] == pytest.approx(1e3 * (HF_FIXED + HF_TOKEN))
    assert pre["ratio"] == pytest.approx((HF_FIXED + HF_TOKEN) / (OURS_FIXED + OURS_TOKEN))
    assert pre["tokens_per_s"] == pytest.approx(16 / (OURS_FIXED + OURS_TOKEN))
    out = capsys.readouterr().out
    assert "[1/1] context 32 B_act 2: 250.000 ms/step, transformers 500.000 ms/step, ratio 2.00x" in out
    assert "[prefill] 1 x 16 tokens" in out
    # the fake walls are far from the real per-step records: the row says the difference is not to be trusted
    assert "warning: rlengine and transformers: the wall-clock difference disagrees" in out
    assert row["timing_warning"].startswith("rlengine and transformers")


def test_steps_timing_reports_the_step_records_and_both_are_kept(tmp_path):
    assert decode.main(TINY + ["--timing", "steps", "--out", str(tmp_path), "--no-plot"]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    for row in data["rows"]:
        assert row["ms_per_step"] == pytest.approx(row["trace_ms_per_step"])
        assert row["hf_ms_per_step"] == pytest.approx(row["hf_stream_ms_per_step"])
        assert row["hf_same_frac"] == 1.0
    assert "per-step records" in data["columns"]["ms_per_step"]


def test_every_column_explained_under_the_table_and_in_the_json(tmp_path, capsys):
    assert decode.main(TINY + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "decode.json").read_text())
    table = out[out.index("\ncontext "):]
    header = table.splitlines()[1].split()
    assert list(data["columns"]) == header
    for name, text in data["columns"].items():
        assert f"  {name.ljust(max(map(len, header)))}  {text}" in out
    assert "wall(generate gen-len tokens) - wall(generate 1)" in data["columns"]["ms_per_step"]
    assert set(data["prefill_columns"]) == {"prompt_len", "b", "ms", "tokens_per_s", "hf_ms", "hf_tokens_per_s",
                                            "ratio"}
    assert (tmp_path / "decode.png").is_file()


def test_default_names_never_overwrite_and_name_replaces(tmp_path, capsys):
    args = TINY + ["--batches", "1", "--prefill-len", "0", "--hf", "none", "--out", str(tmp_path), "--no-plot"]
    for _ in range(2):
        assert decode.main(args) == 0
    assert (tmp_path / "decode.json").is_file() and (tmp_path / "decode-2.json").is_file()
    assert "decode.json exists: writing decode-2.json (pass --name to choose)" in capsys.readouterr().out
    first = (tmp_path / "decode.json").read_text()
    assert decode.main(args + ["--name", "decode"]) == 0
    assert f"replacing {tmp_path / 'decode'}.json (--name decode)" in capsys.readouterr().out
    assert (tmp_path / "decode.json").read_text() != first and not (tmp_path / "decode-3.json").exists()
    assert "prefill" not in json.loads(first)  # --prefill-len 0: no prefill row


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(default: 64)", "(default: difference)", "(default: 512)", "(default: 1,2,4,8,16,32,64,128,256)",
                 "(default: qwen3-30m)", "(default: 3)"):
        assert text in out


def test_figure_draws_the_transformers_lines(monkeypatch, tmp_path):
    from rlengine.plots import measurements

    figs = []
    monkeypatch.setattr(measurements, "_save", lambda fig, out: figs.append(fig) or out)
    rows = [{"context": 32, "b_act": b, "tokens_per_s": 10.0 * b, "ms_per_step": 1.0, "hf_tokens_per_s": 5.0 * b,
             "hf_ms_per_step": 2.0, "roofline_tokens_per_s": 100.0 * b} for b in (1, 2, 4)]
    measurements.plot_decode({"rows": rows}, tmp_path / "x.png")
    ax_q, ax_t = figs[0].axes
    assert [ln.get_label() for ln in ax_t.get_lines()] == ["rlengine", "transformers"]
    assert [list(ln.get_ydata()) for ln in ax_q.get_lines()] == [[10, 20, 40], [5, 10, 20], [100, 200, 400]]
