"""`rlengine bench packed_attention`: the tiled CPU kernel as a provider next to the SDPA loop, on the
heads and dtype asked for, and its bad options refused in one line."""

from __future__ import annotations

import json

import pytest

from rlengine.benchmarks.micro import packed_attention
from rlengine.model.attention import TILED
from rlengine.model.config import ConfigError


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_carry_the_tiled_provider_for_forward_cases(tmp_path, dtype):
    packed_attention.main(["--grid", "B=1,2 L=16 mode=fwd,fwd+bwd", "--heads", "4,2,32", "--dtype", dtype,
                           "--iters", "1", "--learner", "", "--out", str(tmp_path), "--threads", "1"])
    rows = json.loads((tmp_path / "bench_packed_attention.json").read_text())["rows"]
    assert [(r["B"], r["mode"]) for r in rows] == [(1, "fwd"), (1, "fwd+bwd"), (2, "fwd"), (2, "fwd+bwd")]
    assert rows[0]["T"] == 16  # B=1: exactly L tokens
    for r in rows:
        assert r["loop_ms"] > 0
        assert ("tiled_ms" in r) == (TILED and r["mode"] == "fwd")  # forward only, where built
        if "tiled_ms" in r:
            assert r["tiled_speedup"] == pytest.approx(r["loop_ms"] / r["tiled_ms"])


@pytest.mark.parametrize("argv,match", [(["--heads", "4,3,32"], "--heads"), (["--heads", "x"], "--heads"),
                                        (["--dtype", "float16"], "--dtype")])
def test_bad_options_are_refused(tmp_path, argv, match):
    with pytest.raises(ConfigError, match=match):
        packed_attention.main(["--grid", "B=1 L=8 mode=fwd", "--learner", "", "--out", str(tmp_path)] + argv)
