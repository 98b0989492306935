"""Script form of rlengine.benchmarks.job_ladder (`rlengine bench job_ladder` from an installed package); see its
docstring for what it measures and its options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
from rlengine.benchmarks.job_ladder import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
