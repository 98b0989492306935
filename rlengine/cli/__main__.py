"""`python -m rlengine.cli ...`: the same as `rlengine ...`."""

import sys

from rlengine.cli import main

sys.exit(main())
