"""Script form of rlengine.benchmarks.micro.decode_profile (`rlengine bench decode_profile` from an installed package): where a
CPU decode step's time goes per B_act and dtype, next to transformers and the linear floor; see its docstring."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
from rlengine.benchmarks.micro.decode_profile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
