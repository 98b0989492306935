"""The RL algorithm as math, on tensors and numbers: GRPO / GAE advantages (advantages.py), the
clipped policy loss, value loss and KL estimators (losses.py), DAPO over-long shaping
(overlong.py), LR schedules (schedule.py), AdamW over optional fp32 master weights (optim.py)
and the PPO critic's value head (value.py). Nothing here knows about engines, files or ranks."""
