"""What the job learns from and how it is scored: built-in tasks and JSONL data (tasks.py),
reward functions and plugins (rewards.py), the reward worker pool (reward_pool.py), per-batch
scoring with bounded failures (scoring.py), prompt encoding and fit checks (prompts.py) and the
supervised format warm start (warmstart.py)."""
