"""rlengine's Triton kernels, installed as the package rlengine.kernels (setup.py maps this directory).

From the repository root this directory is also importable as a top-level `kernels`: the import name
of Hugging Face's `kernels` distribution, which transformers (>= 5.25) imports when it is installed.
Imported under that name, this module hands the name over to the installed distribution, so a
checkout never shadows it; without one it stays this empty package.
"""

import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.origin and os.path.abspath(_spec.origin) != os.path.abspath(__file__):
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module   # the import statement returns what sys.modules holds after this runs
        _spec.loader.exec_module(_module)
