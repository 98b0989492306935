"""The benchmark harness lives in rlengine.benchmarks.harness (installed with the package); this name keeps
`from bench import harness` working in a checkout: it is the same module object."""

import sys

from rlengine.benchmarks import harness

sys.modules[__name__] = harness
