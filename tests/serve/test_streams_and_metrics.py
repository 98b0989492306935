"""The server's parts without a server: a lagging reader's merged updates, and the Prometheus text.

References: the updates concatenated by hand, and the exposition format's rules (cumulative buckets
ending in +Inf, _count equal to the +Inf bucket, _sum the sum of what was observed).
"""

import asyncio
import re

import pytest

from rlengine.serve.metrics import ServerMetrics
from rlengine.serve.protocol import ApiError
from rlengine.serve.streams import RequestStream, Update


def _drain(stream: RequestStream) -> list[list[Update]]:
    async def run():
        return [ups async for ups in stream.updates()]
    return stream.loop.run_until_complete(run())


def test_a_lagging_reader_gets_one_merged_update_per_choice():
    loop = asyncio.new_event_loop()
    try:
        stream = RequestStream(loop, 0.0)
        steps = [[Update(0, [5], [-0.5], None, "a"), Update(1, [7], [-0.7], None, "x")],
                 [Update(0, [6], [-0.6], None, "b")],
                 [Update(0, [], [], None, "", "stop", "!"), Update(1, [8], [-0.8], None, "y", "length")]]
        for step in steps:
            stream.queue.put_nowait(step)
        stream.queue.put_nowait(None)
        (merged,) = _drain(stream)  # everything was queued before the first read: one batch
        assert stream.done
        by_choice = {u.choice: u for u in merged}
        assert by_choice[0] == Update(0, [5, 6], [-0.5, -0.6], None, "ab", "stop", "!")
        assert by_choice[1] == Update(1, [7, 8], [-0.7, -0.8], None, "xy", "length", None)
    finally:
        loop.close()


def test_an_error_after_some_updates_delivers_them_first():
    loop = asyncio.new_event_loop()
    try:
        stream = RequestStream(loop, 0.0)
        stream.queue.put_nowait([Update(0, [5], [-0.5], None, "a")])
        stream.queue.put_nowait(ApiError(500, "engine step failed"))
        got = []

        async def run():
            async for ups in stream.updates():
                got.append(ups)
        with pytest.raises(ApiError):
            loop.run_until_complete(run())
        assert [[u.token_ids for u in ups] for ups in got] == [[[5]]] and stream.done
    finally:
        loop.close()


def test_prometheus_text_is_well_formed():
    m = ServerMetrics("tiny", kv_blocks_total=100)
    m.record_step(7, running=2, waiting=1, kv_used=9)
    for ttft in (0.003, 0.03, 0.3, 300.0):
        m.record_finish("length", prompt_tokens=4, ttft=ttft, tpot=0.01)
    m.record_finish("abort", prompt_tokens=2, ttft=None, tpot=None)
    text = m.render()
    sample = re.compile(r'^[a-z_:]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+(inf)?$', re.I)
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[0] != "#"}
    lab = 'model_name="tiny"'
    assert values[f"rlengine_kv_blocks_used{{{lab}}}"] == 9 and values[f"rlengine_num_requests_waiting{{{lab}}}"] == 1
    assert values[f'rlengine_request_finished_total{{{lab},finished_reason="abort"}}'] == 1
    assert values[f"rlengine_prompt_tokens_total{{{lab}}}"] == 18
    name = "rlengine_time_to_first_token_seconds"
    buckets = [(k, v) for k, v in values.items() if k.startswith(name + "_bucket")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0].endswith('le="+Inf"}') and counts[-1] == 4
    assert values[f"{name}_count{{{lab}}}"] == 4 and values[f"{name}_sum{{{lab}}}"] == pytest.approx(300.333)
    assert values[f'{name}_bucket{{{lab},le="0.005"}}'] == 1 and values[f'{name}_bucket{{{lab},le="80.0"}}'] == 3
