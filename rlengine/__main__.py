"""`python -m rlengine ...` (what torchrun starts on each rank: torchrun -m rlengine train ...)."""

import sys

from rlengine.cli import main

sys.exit(main())
