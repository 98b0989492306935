"""PNG plots of the measurement outputs: the script form of rlengine.plots.measurements (see its
docstring for the kinds); `rlengine plot --kind KIND FILE.json` is the same from an installed package.

  python tools/plots.py decode bench/results/decode.json -o decode.png
"""

import sys

from rlengine.plots.measurements import (PLOTS, main, plot_asymmetry, plot_decode, plot_serving,
                                         plot_sweep, plot_time_to_target)

__all__ = ["PLOTS", "main", "plot_asymmetry", "plot_decode", "plot_serving", "plot_sweep", "plot_time_to_target"]

if __name__ == "__main__":
    sys.exit(main())
