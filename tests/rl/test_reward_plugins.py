"""Reward plugins (task.reward = "module:function") and the spawn-based reward pool.

A plugin module written into tmp_path (on sys.path) is loaded by name and scores, in this process
and in spawned workers; a bad spec is a ConfigError at config time. The pool hands results back in
submission order even when earlier calls finish later (negative control: the calls really do
finish out of order); a hanging call times out, is counted like an exception, its worker is
replaced, and a process with a hung worker still exits; raising calls follow
task.max_reward_error_frac. A short training run gives identical metrics with workers = 0 and 2.
"""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import rlengine

from rlengine.model.config import ConfigError
from rlengine.rl.config import load_job_config
from rlengine.rl.data import reward_pool
from rlengine.rl.data.reward_pool import InlineRunner, RewardPool, make_runner
from rlengine.rl.data.rewards import RewardCall, RewardError, resolve_reward
from rlengine.rl.data.scoring import RewardScorer
from rlengine.rl.trainer import Trainer

from tests.support.short_runs import without_timings

PLUGIN = textwrap.dedent('''
    import os
    import time


    def multi(completion, answer, prompt, extra):
        """Behaviour chosen per call by extra["mode"]."""
        mode = extra.get("mode", "score")
        if mode == "sleep":
            time.sleep(extra["sleep"])
            return {"score": float(extra["i"]), "t_done": time.time(), "pid": os.getpid()}
        if mode == "hang":
            time.sleep(1000)
        if mode == "raise":
            raise ValueError("plugin failure sentinel-4242")
        if mode == "exit":
            os._exit(7)
        return {"score": float(completion == answer), "length": len(completion)}


    def first_digit(completion, answer, prompt, extra):
        """The built-in first-digit task's exact reward, as a plugin (prompt is checked too)."""
        assert prompt.endswith(":") and extra == {}
        return float(completion.strip() == answer)


    def always_raises(completion, answer, prompt, extra):
        raise RuntimeError("plugin down sentinel-9090")


    NOT_CALLABLE = 3
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """Module name of the plugin file, importable here (sys.path) and in spawned children."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "rl_plugin_mod.py").write_text(PLUGIN)
    (root / "rl_plugin_broken.py").write_text("raise ImportError('broken on purpose')\n")
    (root / "rl_plugin_hangs.py").write_text("import time\ntime.sleep(1000)\ndef fn(c, a):\n    return 0.0\n")
    sys.path.insert(0, str(root))
    yield "rl_plugin_mod"
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def pool(plugin):
    """One 2-worker pool with a 1 s per-call timeout, shared by the pool tests (spawning costs ~2 s)."""
    p = RewardPool(f"{plugin}:multi", workers=2, timeout=1.0)
    yield p
    p.close()


def test_plugin_loads_by_name_and_scores(plugin):
    fn = resolve_reward(f"{plugin}:multi")
    assert fn("7", "7", "", {}) == {"score": 1.0, "length": 1}
    scorer = RewardScorer(fn, 0.0)
    assert scorer.score("7", "7") == 1.0 and scorer.score("x", "7") == 0.0
    assert scorer.component_means() == {"reward/length": 1.0}
    cfg = load_job_config(None, ["--task.reward", f"{plugin}:multi"])
    assert cfg.task.reward == f"{plugin}:multi"


@pytest.mark.parametrize("spec,match", [
    ("rl_plugin_nosuch:fn", "cannot import module 'rl_plugin_nosuch'"),   # module missing
    ("rl_plugin_broken:fn", "broken on purpose"),                         # module raises at import
    ("rl_plugin_mod:nosuch", "has no attribute 'nosuch'"),                 # attribute missing
    ("rl_plugin_mod:NOT_CALLABLE", "not a callable"),                      # not a function
    ("rl_plugin_mod:", "package.module:function"),                         # malformed
])
def test_bad_plugin_is_a_config_error_at_config_time(plugin, spec, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_job_config(None, ["--task.reward", spec])
    assert repr(spec) in str(info.value)


def _sleep_calls(sleeps):
    return [RewardCall("c", "a", "p", {"mode": "sleep", "sleep": s, "i": i}) for i, s in enumerate(sleeps)]


def test_pool_returns_results_in_submission_order(pool):
    import random

    rng = random.Random(0)
    sleeps = [0.25, 0.2, 0.15] + [rng.uniform(0.0, 0.1) for _ in range(9)]  # early calls are the slow ones
    calls = _sleep_calls(sleeps)
    tickets = [pool.submit(calls[0:3]), pool.submit(calls[3:7]), pool.submit(calls[7:])]
    outcomes = [o for t in tickets for o in pool.gather(t)]
    assert [o.error for o in outcomes] == [""] * 12
    assert [o.score for o in outcomes] == [float(i) for i in range(12)]
    # negative control: the calls finished in another order, on both workers
    finished = sorted(range(12), key=lambda i: outcomes[i].components["t_done"])
    assert finished != list(range(12))
    assert len({o.components["pid"] for o in outcomes}) == 2


def test_hanging_call_times_out_is_counted_and_worker_replaced(pool):
    calls = [RewardCall("7", "7", "", {}), RewardCall("", "", "", {"mode": "hang"}), RewardCall("1", "7", "", {})]
    t0 = time.monotonic()
    outcomes = pool.gather(pool.submit(calls))
    assert time.monotonic() - t0 < 8.0
    assert [o.score for o in outcomes] == [1.0, 0.0, 0.0]
    assert outcomes[1].error.startswith("RewardTimeout") and not outcomes[0].error and not outcomes[2].error
    assert pool.timeouts == 1
    scorer = RewardScorer(None, 0.5)
    assert [scorer.record(o) for o in outcomes] == [1.0, 0.0, 0.0] and scorer.errors == 1
    scorer.check("below the limit")
    with pytest.raises(RewardError, match="RewardTimeout"):
        strict = RewardScorer(None, 0.1)
        [strict.record(o) for o in outcomes]
        strict.check("above the limit")
    # the replacement worker serves later calls
    assert [o.score for o in pool.gather(pool.submit([RewardCall("5", "5", "", {})] * 4))] == [1.0] * 4


def test_raising_plugin_follows_the_error_limit(pool):
    calls = [RewardCall("7", "7", "", {"mode": "raise" if i in (3, 9) else "score"}) for i in range(100)]
    outcomes = pool.gather(pool.submit(calls))
    below = RewardScorer(None, 0.02)
    rewards = [below.record(o) for o in outcomes]
    assert below.errors == 2 and rewards.count(0.0) == 2 and rewards[3] == rewards[9] == 0.0
    below.check("rollout")  # 2% is not above 2%
    above = RewardScorer(None, 0.01)
    [above.record(o) for o in outcomes]
    with pytest.raises(RewardError, match="2 of 100") as info:
        above.check("rollout")
    assert "sentinel-4242" in str(info.value) and "Traceback" in str(info.value)


def test_dead_workers_are_replaced_idle_or_busy(pool):
    """A worker killed while idle (an OOM kill) is replaced at the next hand-over, not a BrokenPipeError out of
    submit(); one that dies during a call fails that call with its real exit code (not None: not yet reaped)."""
    import os
    import signal

    while not all(w.ready for w in pool._workers):  # both idle after importing (a death while importing is a
        pool._pump(0.05)                              # ConfigError, by design)
    for w in pool._workers:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.join(timeout=5)
    assert [o.score for o in pool.gather(pool.submit([RewardCall("5", "5", "", {})] * 3))] == [1.0] * 3
    outcomes = pool.gather(pool.submit([RewardCall("7", "7", "", {}), RewardCall("", "", "", {"mode": "exit"})]))
    assert outcomes[0].score == 1.0 and not outcomes[0].error
    assert outcomes[1].error.startswith("RewardWorkerDied") and "exited with code 7" in outcomes[1].error


def test_process_with_a_hung_worker_exits(plugin, tmp_path):
    """A worker stuck in time.sleep(1000) when the parent exits (never closed): the parent exits anyway."""
    script = tmp_path / "hang_exit.py"
    script.write_text(textwrap.dedent(f'''
        import sys
        sys.path[:0] = [{str(Path(sys.modules[plugin].__file__).parent)!r}, {str(Path(rlengine.__file__).parents[1])!r}]
        from rlengine.rl.data.reward_pool import RewardPool
        from rlengine.rl.data.rewards import RewardCall
        if __name__ == "__main__":
            pool = RewardPool("{plugin}:multi", workers=1, timeout=600.0)
            pool.submit([RewardCall("", "", "", {{"mode": "hang"}})])
            while pool._workers[0].call is None:   # wait until the call is running in the worker
                pool._pump(0.05)
            print(pool._workers[0].proc.pid, flush=True)
    '''))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 30
    pid = int(done.stdout.split()[-1])
    time.sleep(0.2)
    assert not _alive(pid), f"worker {pid} outlived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_pool_needs_an_importable_reward():
    with pytest.raises(ConfigError, match="cannot be imported in a worker"):
        make_runner(lambda c, a: 1.0, "", workers=2, timeout=1.0)
    assert isinstance(make_runner(lambda c, a: 1.0, "", workers=0, timeout=1.0), InlineRunner)


SMALL = ["--warmstart.steps", "5", "--train.updates", "3", "--train.prompts_per_step", "4", "--train.group_size",
         "4", "--eval.every", "2", "--task.num_eval", "8", "--task.num_train", "50", "--run.progress", "false"]


@pytest.mark.parametrize("mode", [[], ["--gen.b_gen", "48", "--gen.max_lag", "2", "--gen.max_tokens", "6"]],
                         ids=["coupled", "async"])
def test_workers_0_and_2_train_identically(plugin, tmp_path, mode):
    runs = {}
    for workers in (0, 2):
        cfg = load_job_config("grpo", SMALL + mode + ["--task.reward", f"{plugin}:first_digit", "--task.reward_workers",
                                                  str(workers), "--run.out_dir", str(tmp_path / f"w{workers}")])
        tr = Trainer(cfg)
        runs[workers] = [without_timings(r) for r in tr.run()]
        if workers:  # run() closed the pool: no worker process is left
            assert isinstance(tr.rewards, RewardPool) and tr.rewards._workers == []
    assert runs[0] == runs[2]
    assert any(r.get("reward_mean", 0) > 0 for r in runs[0])  # the plugin scored something


def test_trainer_closes_the_pool_when_rewards_fail(plugin, tmp_path):
    cfg = load_job_config("grpo", SMALL + ["--task.reward", f"{plugin}:always_raises", "--task.reward_workers", "1",
                                       "--run.out_dir", str(tmp_path / "fail")])
    tr = Trainer(cfg)
    procs = [w.proc for w in tr.rewards._workers]
    with pytest.raises(RewardError, match="sentinel-9090"):
        tr.run()
    assert tr.rewards._workers == [] and not any(p.is_alive() for p in procs)
    lines = (tmp_path / "fail" / "metrics.jsonl").read_text().splitlines()
    assert lines == []  # it stopped at the first evaluation (update 0), before any update


def test_a_module_that_hangs_at_import_is_a_config_error(plugin, monkeypatch):
    """Workers that never finish importing the reward stop the run with a ConfigError (killed), not a hang."""
    monkeypatch.setattr(reward_pool, "IMPORT_TIMEOUT_S", 1.5)
    pool = RewardPool("rl_plugin_hangs:fn", workers=1, timeout=1.0)
    procs = [w.proc for w in pool._workers]
    with pytest.raises(ConfigError, match="did not finish importing"):
        pool.gather(pool.submit([RewardCall("c", "a", "p", {})]))
    assert not any(p.is_alive() for p in procs)
