"""Golden values from verl 0.9.1 itself for rlengine's advantage estimators and policy losses.

    python tools/verl_golden.py [--out tests/rl/fixtures/verl_core_algos.json] [--scratch DIR]

Installs verl==0.9.1, omegaconf and antlr4-python3-runtime==4.9.3 (omegaconf's parser) WITHOUT their
dependencies into a scratch directory (pip install --no-deps --target), then imports
verl/trainer/ppo/core_algos.py with three modules it imports at module level but never uses in these
functions stubbed in sys.modules: ray, tensordict and codetiming (an empty module whose attributes are
placeholders). torch and numpy are this environment's. Each estimator and loss runs on fixed random
float64 inputs (seeded; masked observation tokens inside responses, right padding, an all-equal group,
a tie at the top, G = 1, responses of length 1); the losses also give d loss / d log_prob. Rollout
correction (verl/trainer/ppo/rollout_corr_helper.py: IS weights, rejection masks, off-policy metrics)
runs on learner / engine log-probs with padding, lag and extreme ratios, and the per-token sum of
squared probabilities (verl/utils/torch_functional.py) on tempered logits, and remax with the per-prompt
greedy rewards its trainer repeats over each prompt's samples. The fixture
(JSON, floats written with repr precision) holds the inputs, the verl settings and the outputs;
tests/rl/test_verl_parity.py, test_rollout_correction.py, test_token_baseline.py, test_gdpo.py and
test_remax.py compare rlengine against it. clip_cov draws its tokens at random
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


def correction_inputs(gen):
    """Learner and engine log-probs [B, L] with padding, a row with no trained token, observation holes,
    policy lag (rows whose engine log-probs trail by 0.3 to 0.6 nats), rounding-size gaps and extreme
    ratios past verl's +-20 clamp."""
    mask = _rows([9, 6, 0, 4, 9, 1, 7, 3], {0: [(3, 5)], 6: [(2, 3)]}, 9)
    learner = (torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 0.95 + 0.02).log()
    gap = 1e-3 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    gap[3] += 0.3 + 0.3 * torch.rand(9, generator=gen, dtype=torch.float64)   # lag: the engine's older policy
    gap[4] -= 0.5 * torch.rand(9, generator=gen, dtype=torch.float64)
    gap[1, 2], gap[6, 4], gap[7, 0] = 25.0, -23.0, 3.0                       # extreme ratios
    return learner, learner - gap, mask


CORRECTION_CASES = [  # (rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold)
    ("token", 2.0, False, None, None), ("sequence", 2.0, False, None, None),
    ("token", "0.5_2.0", False, None, None), ("sequence", "0.2_5.0", True, None, None),
    ("token", 1.5, True, None, None), ("sequence", 3.0, True, None, None),
    (None, None, False, "token_k1", "0.8_1.25"), (None, None, False, "token_k1", "1.5"),
    (None, None, False, "token_k2", "0.02"), (None, None, False, "token_k3", "0.05"),
    (None, None, False, "seq_sum_k1", "0.5_2.0"), (None, None, False, "seq_sum_k2", "0.1"),
    (None, None, False, "seq_sum_k3", "0.2"), (None, None, False, "seq_mean_k1", "1.2"),
    (None, None, False, "seq_mean_k2", "0.01"), (None, None, False, "seq_mean_k3", "0.04"),
    (None, None, False, "seq_max_k2", "0.05"), (None, None, False, "seq_max_k3", "0.1"),
    ("token", 2.0, False, "token_k1,seq_max_k3", "0.7_1.4,0.2"),
    ("sequence", "0.5_4.0", True, "seq_mean_k3,token_k2,seq_sum_k1", "0.08,0.3,0.4_3.0"),
]


def run_rollout_correction(gen):
    """verl's compute_rollout_correction_and_rejection_mask, step by step (its last step wraps the weights
    in a DataProto, whose tensordict is stubbed here): IS weights, rejection mask, off-policy metrics."""
    import verl.trainer.ppo.rollout_corr_helper as rc
    learner, engine, mask = correction_inputs(gen)
    out = []
    for level, is_thr, norm, rs, rs_thr in CORRECTION_CASES:
        metrics, weights, new_mask = {}, None, mask.clone()
        log_ratio = learner - engine
        if level is not None:
            weights, m = rc.compute_rollout_correction_weights(log_ratio, mask, rollout_is=level,
                                                               rollout_is_threshold=is_thr,
                                                               rollout_is_batch_normalize=norm)
            metrics.update(m)
        if rs is not None:
            new_mask, m = rc.compute_rollout_rejection_mask(log_ratio, mask, rollout_rs=rs, rollout_rs_threshold=rs_thr)
            metrics.update(m)
        metrics.update(rc.compute_offpolicy_metrics(learner, engine, mask))
        out.append({"rollout_is": level, "rollout_is_threshold": is_thr, "rollout_is_batch_normalize": norm,
                    "rollout_rs": rs, "rollout_rs_threshold": rs_thr,
                    "weights": None if weights is None else weights.tolist(), "mask": new_mask.tolist(),
                    "metrics": {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}})
    return {"learner_logp": learner.tolist(), "engine_logp": engine.tolist(), "mask": mask.tolist(), "cases": out}


def run_sum_pi_squared(gen):
    """verl's calculate_sum_pi_squared_from_logits on tempered logits (its actor divides by the temperature
    first): the per-token input of optimal_token_baseline, which rlengine's learner computes itself."""
    import verl.utils.torch_functional as verl_F
    logits = 4.0 * torch.randn(7, 33, generator=gen, dtype=torch.float64)
    logits[2] = logits[2] * 8.0  # a peaked distribution: sum of squares near 1
    temperature = 0.7
    value = verl_F.calculate_sum_pi_squared_from_logits(logits.clone().div_(temperature))
    return {"logits": logits.tolist(), "temperature": temperature, "sum_pi_squared": value.tolist()}


def run_gdpo(ca, OmegaConf, gen):
    """verl's gdpo on two named reward components (the reward plugin's dict keys), weighted, on right-padded
    rows with observation holes; groups of 4 and groups of one."""
    import numpy as np
    out = []
    for case, lengths, index in (("groups", [5, 3, 7, 7, 2, 6, 4, 7], [0] * 4 + [1] * 4),
                                 ("g1", [4, 2, 6], [0, 1, 2])):
        mask = _rows(lengths, {2: [(2, 4)]}, 8)
        B = len(lengths)
        comps = {"accuracy": (torch.rand(B, generator=gen) > 0.5).double(),
                 "format": torch.rand(B, generator=gen, dtype=torch.float64)}
        comps["accuracy"][0], comps["accuracy"][1] = 1.0, 0.0  # no all-equal group (verl leaves a residue)
        if case == "groups":
            comps["accuracy"][4], comps["accuracy"][5] = 1.0, 0.0
        rewards = token_rewards(mask, comps["accuracy"] + comps["format"], gen, dense=False)
        cfg = OmegaConf.create({"gdpo_reward_keys": ["accuracy", "format"], "gdpo_reward_weights": [1.0, 0.5],
                                "norm_adv_by_std_in_grpo": True})
        P = 3
        batch = {"prompts": torch.zeros(B, P, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(B, P), _rows(lengths, {}, 8)], dim=1).long()}
        adv, _ = ca.compute_gdpo_outcome_advantage(
            token_level_rewards=rewards, response_mask=mask, index=np.array(index), norm_adv_by_std_in_grpo=True,
            config=cfg, non_tensor_batch={k: v.numpy() for k, v in comps.items()}, batch=batch)
        out.append({"estimator": "gdpo", "case": case, "mask": mask.tolist(), "index": index,
                    "components": {k: v.tolist() for k, v in comps.items()}, "keys": ["accuracy", "format"],
                    "weights": [1.0, 0.5], "advantages": adv.tolist()})
        if case == "groups":  # no component keys: verl falls back to the token rewards as the one component
            adv, _ = ca.compute_gdpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask,
                                                       index=np.array(index), norm_adv_by_std_in_grpo=True)
            out.append({"estimator": "gdpo", "case": "fallback", "mask": mask.tolist(), "index": index,
                        "rewards": rewards.tolist(), "keys": [], "weights": [], "advantages": adv.tolist()})
    return out


def run_remax(ca, gen):
    """verl's compute_remax_outcome_advantage: the reward-to-go minus reward_baselines [B] (the trainer scores
    one greedy response per prompt and repeats it over the prompt's samples), on rows with observation holes
    and padding; outcome rewards (groups of 4, groups of one) and dense per-token rewards."""
    out = []
    for case, lengths, index, dense in (("groups", [5, 3, 7, 7, 2, 6, 4, 7], [0] * 4 + [1] * 4, False),
                                        ("g1", [4, 1, 6], [0, 1, 2], False),
                                        ("dense", [6, 2, 7, 5], [0, 0, 1, 1], True)):
        mask = _rows(lengths, {2: [(2, 4)]}, 8)
        scores = torch.rand(len(lengths), generator=gen, dtype=torch.float64)
        rewards = token_rewards(mask, scores, gen, dense=dense)
        greedy = torch.rand(max(index) + 1, generator=gen, dtype=torch.float64)
        baselines = greedy[torch.tensor(index)]  # repeated over each prompt's samples, as ray_trainer does
        adv, returns = ca.get_adv_estimator_fn("remax")(token_level_rewards=rewards.clone(),
                                                        reward_baselines=baselines, response_mask=mask)
        out.append({"estimator": "remax", "case": case, "rewards": rewards.tolist(), "mask": mask.tolist(),
                    "index": index, "reward_baselines": baselines.tolist(), "advantages": adv.tolist(),
                    "returns": returns.tolist()})
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
               "losses": run_losses(ca, ActorConfig, PolicyLossConfig, gen),
               "rollout_correction": run_rollout_correction(gen), "sum_pi_squared": run_sum_pi_squared(gen),
               "gdpo": run_gdpo(ca, OmegaConf, gen), "remax": run_remax(ca, gen)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(fixture['estimators'])} estimator cases, {len(fixture['losses'])} loss cases, "
          f"{len(fixture['rollout_correction']['cases'])} rollout correction cases from {VERL}")


if __name__ == "__main__":
    main()
