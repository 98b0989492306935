"""Multi-turn environments: the API a user implements (api.py) and the driver that runs it against the
engine's resident trajectories (driver.py); tools (tools.py), their call formats (tool_calls.py) and the tool
environment (tool_env.py, its calls off the decode loop: pending.py); the job's wiring (build.py)."""

from rlengine.rl.env.api import End, Environment, EnvError, ModelTurn, Observation, as_action, load_environment
from rlengine.rl.env.driver import Trajectory, TrajectoryDriver, TrajectoryLimits

__all__ = ["End", "Environment", "EnvError", "ModelTurn", "Observation", "Trajectory", "TrajectoryDriver",
           "TrajectoryLimits", "as_action", "load_environment"]
