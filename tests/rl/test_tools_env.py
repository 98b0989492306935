"""The tool environment beside decoding: a slow tool parks only its own trajectory, failing tools are counted.

The decode test runs the real engine, driver and ToolEnv: trajectory A calls a tool that sleeps 1 s while
trajectory B decodes. Engine steps recorded between the tool's start and end (read from the engine's own
trace by the tool) must exist and must not contain A, and A's record must not grow while its tool runs;
nothing is asserted on wall time. A tool that raises, returns something that is not text or JSON, or hangs
past its timeout gets an error observation and a count, and the next call still works.
"""

import threading
import time

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data.tasks import Problem
from rlengine.rl.env import End, Environment, ModelTurn, TrajectoryDriver, TrajectoryLimits
from rlengine.rl.env.pending import Pending
from rlengine.rl.env.tool_calls import CompactFormat
from rlengine.rl.env.tool_env import ToolBox, ToolEnv
from rlengine.rl.env.tools import make_tool

NO_ARGS = {"type": "object", "properties": {}}


def _schema(name):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": NO_ARGS}}


def bad_schema_tool():
    """A tool plugin whose schema does not parse (tests/cli/test_bad_input_tour.py)."""


bad_schema_tool.tool_schema = '{"type": "function", "function": {"name": "bad",'


def echo_tool(text: str) -> str:
    return text


echo_tool.tool_schema = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


class NapEnv(ToolEnv):
    """Turn 0 calls the tool (whatever the random model wrote); the turn after its result ends the episode."""

    def step(self, turn):
        if self.calls == 0:
            return super().step(ModelTurn(turn.index, turn.token_ids, "nap()", turn.finish_reason))
        return End(1.0)


class TalkEnv(Environment):
    """Three model turns with a fixed observation between them."""

    def step(self, turn):
        return End(0.0) if turn.index >= 2 else [5, 6, 7]


def test_a_sleeping_tool_parks_its_trajectory_while_others_decode():
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=3), max_num_seqs=8, block_size=4)
    seen = {}

    def nap():
        seen["start"] = (len(llm.core.trace), len(driver.live[("a", 0)].tokens))
        time.sleep(1.0)
        seen["end"] = (len(llm.core.trace), len(driver.live[("a", 0)].tokens))
        return "ok"

    box = ToolBox([make_tool(nap, _schema("nap"))], CompactFormat(), lambda *a: 0.0)
    make_env = lambda p: NapEnv(p, box) if p.prompt == "a" else TalkEnv(p)  # noqa: E731
    limits = TrajectoryLimits(max_turns=4, max_turn_tokens=30, max_total_tokens=100)
    driver = TrajectoryDriver(make_env, Tokenizer.builtin(), limits, counts=box.counts)
    tok = Tokenizer.builtin()
    for rid, prompt, n, max_tokens in (("a", "a", 1, 1), ("b", "b", 4, 30)):
        params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=rid == "b")
        llm.add_request(tok.encode(prompt + ":"), params, request_id=rid, multi_turn=True)
        driver.add(rid, n, Problem(prompt, "0"))
    finished = set()
    while len(finished) < 2:
        finished |= {o.request_id for o in llm.step()}
        driver.advance(llm)
    (a,), b = driver.pop("a"), driver.pop("b")
    during = llm.core.trace[seen["start"][0]:seen["end"][0]]
    # B decoded while A's tool slept (a tool run on the decode loop leaves none; how many depends on the machine)
    assert sum(r.kind == "decode" for r in during) >= 1
    assert all(r.b_act <= 4 for r in during)                 # ... and A was never in a step: it was parked
    assert seen["start"][1] == seen["end"][1] == 1           # A's record: its 1-token turn, no observation yet
    assert [s[0] for s in a.segments] == ["model", "observation", "model"] and a.reward == 1.0
    assert a.tokens[1:4] == tok.encode("=ok") and all(t.turns == 3 for t in b)
    assert box.counts["tool_calls"] == 1 and box.counts["tool_errors"] == 0


def _resolve(out):
    while isinstance(out, Pending):
        result = out.poll()
        if result is None:
            out.wait(0.05)
        else:
            out = result
    return out


def test_raising_garbage_and_hanging_tools_are_counted_and_the_next_call_works():
    release = threading.Event()

    def boom():
        raise RuntimeError("tool crashed")

    tools = [make_tool(boom, _schema("boom")), make_tool(lambda: object(), _schema("junk")),
             make_tool(lambda: release.wait(), _schema("hang")), make_tool(echo_tool, echo_tool.tool_schema)]
    box = ToolBox(tools, CompactFormat(), lambda *a: 0.0, timeout_s=0.2)
    env = box(Problem("q", "0"))
    try:
        got = [_resolve(env.step(ModelTurn(i, [], call, "stop")))
               for i, call in enumerate(["boom()", "junk()", "hang()", "echo(hi)"])]
    finally:
        release.set()
    assert got == ["=error", "=error", "=error", "=hi"]
    assert box.counts["tool_calls"] == 4 and box.counts["tool_errors"] == 2 and box.counts["tool_timeouts"] == 1
