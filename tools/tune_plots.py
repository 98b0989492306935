"""Figures of an `rlengine tune` / `rlengine report` result: the script form of rlengine.plots.tune.

  python tools/tune_plots.py OUT/report.json [-o OUT/figures]
"""

import sys

from rlengine.plots.tune import draw_all, main, plot_j, plot_q_vs_bgen

__all__ = ["draw_all", "main", "plot_j", "plot_q_vs_bgen"]

if __name__ == "__main__":
    sys.exit(main())
