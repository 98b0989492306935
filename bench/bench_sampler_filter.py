"""Script form of rlengine.benchmarks.micro.sampler_filter (`rlengine bench sampler_filter` from an installed package); see its
docstring for what it measures and its options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
from rlengine.benchmarks.micro.sampler_filter import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
