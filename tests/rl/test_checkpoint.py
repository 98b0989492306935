"""Run checkpoints: round trips (fp32 masters, optimizer, KL reference, weights) and crash safety.

The crash tests run saves in a fresh interpreter (one forked process per case) that SIGKILL
themselves at each stage of save_checkpoint (or part-way through deleting a directory) and then check that the run
directory resumes to the old or the new checkpoint as that stage implies: never a missing
or half-written one.
"""

import copy
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from rlengine.model.factory import build_model
from rlengine.rl.trainer.checkpoint import STAGES, latest_checkpoint, load_checkpoint, save_checkpoint
from rlengine.rl.algo.value import ValueModel


def _tiny(seed: int, dtype=torch.float32):
    return build_model("tiny", dtype=dtype, device="cpu", moe_impl="ref", seed=seed)


def _adam_stepped(params: list[torch.Tensor], *, masters: bool, seed: int):
    """(AdamW, fp32 masters or None) after one step on random grads, rounded masters written back."""
    master_params = [p.detach().float().clone() for p in params] if masters else None
    trained = master_params or params
    opt = torch.optim.AdamW(trained, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for t in trained:
        t.grad = torch.randn(t.shape, generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if masters:
        with torch.no_grad():
            for p, m in zip(params, master_params):
                p.copy_(m)
    return opt, master_params


def _learner(model, *, masters: bool, seed: int, critic: bool = False) -> types.SimpleNamespace:
    """A stub learner after one optimizer step (so there is Adam state); ref = the model before it."""
    ref = copy.deepcopy(model).requires_grad_(False)
    opt, master_params = _adam_stepped(list(model.parameters()), masters=masters, seed=seed)
    learner = types.SimpleNamespace(opt=opt, master_params=master_params, ref=ref, critic=None, critic_opt=None,
                                    critic_master_params=None)
    if critic:
        learner.critic = ValueModel(model)
        learner.critic_opt, learner.critic_master_params = _adam_stepped(
            list(learner.critic.parameters()), masters=masters, seed=seed + 100)
    return learner


def _assert_same_tensors(got, want):
    got, want = list(got), list(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _assert_same_optimizer(got: torch.optim.Optimizer, want: torch.optim.Optimizer):
    g, w = got.state_dict(), want.state_dict()
    assert g["param_groups"] == json.loads(json.dumps(w["param_groups"]))  # JSON turns betas into a list
    assert g["state"].keys() == w["state"].keys() and len(w["state"]) > 0
    for i in w["state"]:
        for k in w["state"][i]:
            assert torch.equal(g["state"][i][k], w["state"][i][k]), (i, k)


def test_round_trip_fp32_restores_weights_optimizer_and_ref(tmp_path):
    model = _tiny(seed=0)
    learner = _learner(model, masters=False, seed=0)
    save_checkpoint(tmp_path, 3, model=model, learner=learner, state={"update": 3})

    model2 = _tiny(seed=1)
    learner2 = _learner(model2, masters=False, seed=1)
    state = load_checkpoint(latest_checkpoint(tmp_path), model=model2, learner=learner2)
    assert state == {"update": 3}
    _assert_same_tensors(model2.parameters(), model.parameters())
    _assert_same_optimizer(learner2.opt, learner.opt)
    _assert_same_tensors(learner2.ref.parameters(), learner.ref.parameters())
    # the reference is the saved one, not a copy of the resumed policy; tied weights stay tied
    assert not torch.equal(learner2.ref.lm_head.weight, model2.lm_head.weight)
    assert learner2.ref.lm_head.weight is learner2.ref.model.embed_tokens.weight


def test_round_trip_bf16_with_fp32_masters_restores_masters_not_rounded_weights(tmp_path):
    model = _tiny(seed=0, dtype=torch.bfloat16)
    learner = _learner(model, masters=True, seed=0, critic=True)
    params, critic_params = list(model.parameters()), list(learner.critic.parameters())
    # After the AdamW step every master sits off the bf16 grid (by less than an ulp), so masters
    # re-derived from the bf16 weights would differ from the saved ones.
    for p, m in zip(params + critic_params, learner.master_params + learner.critic_master_params):
        assert torch.equal(m.to(torch.bfloat16), p) and not torch.equal(m, p.float())
    save_checkpoint(tmp_path, 5, model=model, learner=learner, state={"update": 5})

    model2 = _tiny(seed=1, dtype=torch.bfloat16)
    learner2 = _learner(model2, masters=True, seed=1, critic=True)
    masters2 = list(learner2.master_params)
    load_checkpoint(latest_checkpoint(tmp_path), model=model2, learner=learner2)
    assert all(a is b for a, b in zip(learner2.master_params, masters2))  # restored in place
    for module, masters, want_masters, want_params in (
            (model2, learner2.master_params, learner.master_params, params),
            (learner2.critic, learner2.critic_master_params, learner.critic_master_params, critic_params)):
        _assert_same_tensors(masters, want_masters)
        for p, m in zip(module.parameters(), masters):
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
        _assert_same_tensors(module.parameters(), want_params)
    _assert_same_optimizer(learner2.opt, learner.opt)
    _assert_same_optimizer(learner2.critic_opt, learner.critic_opt)
    _assert_same_tensors(learner2.ref.parameters(), learner.ref.parameters())


def test_checkpoint_without_masters_or_ref_still_loads(tmp_path):
    """The layout before masters and ref were saved: masters come from the weights, ref is kept."""
    model = _tiny(seed=0)
    old = _learner(model, masters=False, seed=0)
    old.master_params = old.ref = None
    save_checkpoint(tmp_path, 40, model=model, learner=old, state={"update": 40})
    assert (tmp_path / "checkpoints" / "latest").read_text() == "update-000040"

    model2 = _tiny(seed=1)
    learner2 = _learner(model2, masters=True, seed=1)
    ref_before = [p.clone() for p in learner2.ref.parameters()]
    assert load_checkpoint(latest_checkpoint(tmp_path), model=model2, learner=learner2) == {"update": 40}
    _assert_same_tensors(model2.parameters(), model.parameters())
    _assert_same_tensors(learner2.master_params, model.parameters())
    _assert_same_tensors(learner2.ref.parameters(), ref_before)


def test_saving_an_update_again_replaces_it_and_cleans_up(tmp_path):
    model = _tiny(seed=0)
    learner = _learner(model, masters=False, seed=0)
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 1, model=model, learner=learner, state={"v": 0})
    (root / ".tmp-update-000002").mkdir()  # left by a crashed save
    first = save_checkpoint(tmp_path, 2, model=model, learner=learner, state={"v": 1})
    second = save_checkpoint(tmp_path, 2, model=model, learner=learner, state={"v": 2})
    # the stale .tmp- twin keeps the first save off the plain name; cleaning it up frees the name again
    assert (first.name, second.name) == ("update-000002.1", "update-000002")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "update-000001", "update-000002"]
    assert load_checkpoint(latest_checkpoint(tmp_path), model=model, learner=learner) == {"v": 2}


# ---- crash safety --------------------------------------------------------------------------------
# One interpreter imports torch once, then forks a process per case, which saves update 1
# (weights from seed 1), then update 2 ("next") or update 1 again ("again") with weights from
# seed 2, SIGKILLing itself at `stage`: a stage of save_checkpoint, or "rmtree" = part-way
# through the first directory removal. Prints {case: killed} as JSON.
_CHILD = r"""
import json, os, shutil, signal, sys, traceback, types
from pathlib import Path
import torch
torch.set_num_threads(1)  # no worker threads in a process that forks
from rlengine.model.factory import build_model
from rlengine.rl.trainer.checkpoint import save_checkpoint

root, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
ref = build_model("tiny", dtype=torch.float32, device="cpu", moe_impl="ref", seed=0).requires_grad_(False)
real_rmtree = shutil.rmtree

def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)

def rmtree_partly(path, *args, **kwargs):
    files = [p for p in Path(path).rglob("*") if p.is_file()] if Path(path).is_dir() else []
    if not files:
        return real_rmtree(path, *args, **kwargs)
    files[0].unlink()
    die()

def save(run_dir, update, seed, on_stage=None):
    model = build_model("tiny", dtype=torch.float32, device="cpu", moe_impl="ref", seed=seed)
    masters = [p.detach().clone() for p in model.parameters()]
    learner = types.SimpleNamespace(opt=torch.optim.AdamW(masters), critic=None, critic_opt=None,
                                    master_params=masters, ref=ref)
    save_checkpoint(run_dir, update, model=model, learner=learner, state={"update": update, "seed": seed},
                    on_stage=on_stage)

def run_case(run_dir, scenario, stage):
    save(run_dir, 1, seed=1)
    hook = None
    if stage == "rmtree":
        shutil.rmtree = rmtree_partly
    else:
        hook = lambda s: die() if s == stage else None
    save(run_dir, 2 if scenario == "next" else 1, seed=2, on_stage=hook)

save(root / "warm-up", 1, seed=1)  # lazy imports (safetensors, torch.optim) once, not in every fork
real_rmtree(root / "warm-up")
killed = {}
for scenario, stage in cases:
    pid = os.fork()
    if pid == 0:
        try:
            run_case(root / f"{scenario}-{stage}", scenario, stage)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    killed[f"{scenario}-{stage}"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
print(json.dumps(killed))
"""

_CASES = [
    *[("next", s) for s in STAGES],   # update 1, then update 2
    *[("again", s) for s in STAGES],  # update 1 saved twice (the end-of-run save of the last update)
    ("again", "rmtree"),              # killed while deleting the superseded update-000001
]
# stage -> which save the run resumes from after the kill
_SURVIVOR = {"partial": "old", "written": "old", "before-pointer": "old", "after-pointer": "new", "rmtree": "new"}


@pytest.fixture(scope="module")
def crashed_runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("crashes")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), json.dumps(_CASES)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash child forks a process per case")
@pytest.mark.parametrize("scenario,stage", _CASES)
def test_crash_during_save_leaves_a_loadable_checkpoint(crashed_runs, scenario, stage):
    root, killed = crashed_runs
    run_dir = root / f"{scenario}-{stage}"
    assert killed[run_dir.name], "the save ran to completion: the crash point was never reached"

    model, ref = _tiny(seed=99), _tiny(seed=99).requires_grad_(False)
    masters = [p.detach().clone() for p in model.parameters()]
    learner = types.SimpleNamespace(opt=torch.optim.AdamW(masters), critic=None, critic_opt=None,
                                    master_params=masters, ref=ref)
    state = load_checkpoint(latest_checkpoint(run_dir), model=model, learner=learner)
    new_update = 2 if scenario == "next" else 1
    want = {"update": 1, "seed": 1} if _SURVIVOR[stage] == "old" else {"update": new_update, "seed": 2}
    assert state == want
    _assert_same_tensors(model.parameters(), _tiny(seed=want["seed"]).parameters())
    _assert_same_tensors(masters, _tiny(seed=want["seed"]).parameters())
    _assert_same_tensors(ref.parameters(), _tiny(seed=0).parameters())

    # The next save of the same update succeeds and removes what the crash left behind.
    save_checkpoint(run_dir, new_update, model=model, learner=learner, state={"update": new_update})
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert [n.split(".")[0] for n in names] == ["latest", *sorted({"update-000001", f"update-{new_update:06d}"})]
    assert load_checkpoint(latest_checkpoint(run_dir), model=model, learner=learner) == {"update": new_update}
