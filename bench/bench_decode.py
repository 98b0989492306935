"""Decode throughput per active batch, side by side with transformers: `rlengine bench decode` from the repo.

    python bench/bench_decode.py --model qwen3-30m --dtype float32 --batches 1,32
"""

import sys

from rlengine.benchmarks.decode import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
