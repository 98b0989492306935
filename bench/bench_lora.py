"""Script form of rlengine.benchmarks.micro.lora; see its docstring for what it measures and its options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
from rlengine.benchmarks.micro.lora import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
