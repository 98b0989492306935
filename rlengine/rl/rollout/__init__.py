"""Generation for RL: the rollout collector (collector.py: prompts -> engine -> scored groups, dynamic
sampling, async partial rollouts, the prompt sampler) and held-out evaluation (evaluation.py:
named eval sets, mean@k, pass@k), both on the engine that shares the learner's weights."""
