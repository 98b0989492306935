"""Golden values from verl 0.9.1 itself for rlengine's advantage estimators and policy losses.

    python tools/verl_golden.py [--out tests/rl/fixtures/verl_core_algos.json] [--scratch DIR]

Installs verl==0.9.1, omegaconf and antlr4-python3-runtime==4.9.3 (omegaconf's parser) WITHOUT their
dependencies into a scratch directory (pip install --no-deps --target), then imports
verl/trainer/ppo/core_algos.py with three modules it imports at module level but never uses in these
functions stubbed in sys.modules: ray, tensordict and codetiming (an empty module whose attributes are
placeholders). torch and numpy are this environment's. Each estimator and loss runs on fixed random
float64 inputs (seeded; masked observation tokens inside responses, right padding, an all-equal group,
a tie at the top, G = 1, responses of length 1); the losses also give d loss / d log_prob. The fixture
(JSON, floats written with repr precision) holds the inputs, the verl settings and the outputs;
tests/rl/test_verl_parity.py compares rlengine against it. clip_cov draws its tokens at random
(torch.randperm) only among more candidates than it keeps; its cases keep every candidate, so the
values do not depend on the draw.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

VERL = "verl==0.9.1"
STUBBED = ("ray", "tensordict", "codetiming")


class _Placeholder(types.ModuleType):
    """A stand-in module: any attribute is another placeholder, usable in type annotations."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Placeholder("call")

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __getitem__(self, key):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def load_core_algos(scratch: Path):
    if not (scratch / "verl").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(scratch),
                        VERL, "omegaconf", "antlr4-python3-runtime==4.9.3"], check=True)
    sys.path.insert(0, str(scratch))
    sys.meta_path.insert(0, _StubFinder())
    from omegaconf import OmegaConf

    import verl.trainer.ppo.core_algos as core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig
    return core_algos, ActorConfig, PolicyLossConfig, OmegaConf


def _rows(lengths, obs, T):
    """[B, T] response mask: row b has lengths[b] positions, with observation spans obs[b] zeroed."""
    mask = torch.zeros(len(lengths), T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
        for lo, hi in obs.get(b, ()):
            mask[b, lo:hi] = 0.0
    return mask


def estimator_cases(gen):
    """(name, mask [B, T], index [B], scores [B]) for the estimator inputs."""
    cases = []
    lengths = [5, 3, 7, 7, 2, 6, 4, 7, 1, 5, 3, 6]
    mask = _rows(lengths, {2: [(2, 4)], 7: [(1, 3)], 11: [(3, 5)]}, 8)
    scores = torch.rand(12, generator=gen, dtype=torch.float64)
    scores[4:8] = 0.75                       # group 1: all equal
    scores[9], scores[10] = scores[11], scores[11]  # group 2: a tie at the top
    scores[11] = scores[9]
    scores[8] = scores[9] - 0.2
    scores[1] = scores[8] = 0.0              # zero scores: gpg's alpha = B / (non-zero scores) != 1
    cases.append(("mixed", mask, [0] * 4 + [1] * 4 + [2] * 4, scores))
    cases.append(("g1", _rows([4, 2, 6], {2: [(1, 2)]}, 6), [0, 1, 2], torch.rand(3, generator=gen, dtype=torch.float64)))
    cases.append(("len1", _rows([1] * 6, {}, 1), [0, 0, 0, 1, 1, 1], torch.rand(6, generator=gen, dtype=torch.float64)))
    return cases


def token_rewards(mask, scores, gen, dense: bool):
    """The outcome score on each row's last model token (plus random per-token rewards when dense)."""
    r = torch.zeros_like(mask)
    for b in range(mask.shape[0]):
        valid = mask[b].nonzero().flatten()
        if len(valid):
            r[b, valid[-1]] = scores[b]
    if dense:
        r = r + 0.1 * torch.randn(mask.shape, generator=gen, dtype=torch.float64) * mask
    return r


def run_estimators(ca, OmegaConf, gen):
    out = []
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": True, "gamma": 0.9})
    for case, mask, index, scores in estimator_cases(gen):
        for name in ("rloo", "grpo_passk", "gpg", "opo", "reinforce_plus_plus_baseline", "reinforce_plus_plus",
                     "optimal_token_baseline"):
            if name == "grpo_passk" and case == "g1":
                continue  # verl raises: Pass@k needs G >= 2
            rewards = token_rewards(mask, scores, gen, dense=name == "reinforce_plus_plus")
            extra, kw = {}, {}
            if name == "optimal_token_baseline":
                pi = torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 0.9 + 0.05
                extra = {"old_log_probs": pi.log(), "sum_pi_squared": pi.square() + (1 - pi.square()) * 0.3}
            fn = ca.get_adv_estimator_fn(name)
            idx = __import__("numpy").array(index)
            adv, _ = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=idx, config=cfg,
                        **extra, **kw)
            out.append({"estimator": name, "case": case, "rewards": rewards.tolist(), "mask": mask.tolist(),
                        "index": index, "gamma": 0.9, "normalize_std": True,
                        **{k: v.tolist() for k, v in extra.items()}, "advantages": adv.tolist()})
    return out


LOSS_SETTINGS = {  # verl settings per loss; clip ranges read as each loss reads them
    "vanilla": {}, "gspo": {}, "sapo": {}, "cispo": {}, "geo_mean": {}, "gpg": {},
    "dro": {"dro_beta": 0.3},
    "dppo_tv": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.04, "clip_ratio_c": 2.0},
    "dppo_kl": {"clip_ratio_low": 0.02, "clip_ratio_high": 0.01, "clip_ratio_c": 2.0},
    "clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.3, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1},
}


def loss_cases(gen):
    cases = []
    for case, lengths, obs, T, seq_adv in (("mixed", [6, 3, 8, 1, 5, 0], {2: [(2, 5)], 4: [(1, 2)]}, 8, False),
                                            ("seq_adv", [4, 7, 2, 5], {1: [(3, 5)]}, 7, True),
                                            ("len1", [1, 1, 1, 1], {}, 1, False)):
        mask = _rows(lengths, obs, T)
        old = (torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 0.9 + 0.05).log()
        logp = (old + 0.6 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
        if seq_adv:
            adv = torch.randn(len(lengths), 1, generator=gen, dtype=torch.float64).expand(-1, T).clone()
        else:
            adv = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
        if case == "mixed":  # a token with A < 0 and ratio 4.5: verl's always-on dual-clip (c = 3) takes it
            old[0, 0], logp[0, 0], adv[0, 0] = torch.tensor(0.1).log(), torch.tensor(0.45).log(), -1.3
        if case == "len1":  # log-ratio 11.4, A < 0 on a one-token sequence: GSPO's clamp at 10 takes it
            old[1, 0], logp[1, 0], adv[1, 0] = torch.tensor(1e-5).log(), torch.tensor(0.9).log(), -0.7
        cases.append((case, mask, old, logp, adv * mask))
    return cases


def run_losses(ca, ActorConfig, PolicyLossConfig, gen):
    out = []
    for case, mask, old, logp, adv in loss_cases(gen):
        for name, settings in LOSS_SETTINGS.items():
            actor = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0,
                     "tau_neg": 1.05}
            actor.update({k: v for k, v in settings.items() if k in actor})
            pl = {k: v for k, v in settings.items() if k not in actor}
            cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                              policy_loss=PolicyLossConfig(loss_mode=name, **pl), **actor)
            if name == "clip_cov":
                torch.manual_seed(0)
            lp = logp.clone().requires_grad_(True)
            loss, _ = ca.get_policy_loss_fn(name)(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                                                  loss_agg_mode="token-mean", config=cfg)
            (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
            grad = torch.zeros_like(lp) if grad is None else grad
            out.append({"loss": name, "case": case, "settings": {**actor, **pl}, "mask": mask.tolist(),
                        "old_logp": old.tolist(), "logp": logp.tolist(), "advantages": adv.tolist(),
                        "value": float(loss.detach()), "grad": grad.tolist()})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/rl/fixtures/verl_core_algos.json")
    parser.add_argument("--scratch", default="", help="install directory (default: a fresh temporary one)")
    args = parser.parse_args()
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="verl-golden-"))
    ca, ActorConfig, PolicyLossConfig, OmegaConf = load_core_algos(scratch)
    gen = torch.Generator().manual_seed(20250911)
    fixture = {"verl": VERL, "stubbed_modules": list(STUBBED), "torch": torch.__version__,
               "estimators": run_estimators(ca, OmegaConf, gen),
               "losses": run_losses(ca, ActorConfig, PolicyLossConfig, gen)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(fixture['estimators'])} estimator cases, {len(fixture['losses'])} loss cases "
          f"from {VERL}")


if __name__ == "__main__":
    main()
