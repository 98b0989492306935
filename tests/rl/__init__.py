"""Tests of rlengine/rl: formulas, learner, rollouts, rewards, checkpoints, trainer, several ranks."""
