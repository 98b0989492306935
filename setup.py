"""Build script: the Python packages plus the optional C++ extension rlengine._C.

csrc/*.cpp hold CPU ops registered with TORCH_LIBRARY_FRAGMENT (torch.ops.rlengine.*), so
each source file stands alone and no central binding file lists them. csrc/cuda/*.cu join
the build only when torch has CUDA and nvcc is found. A failed extension build does not
fail the install: rlengine then falls back to its torch implementations and says so once
at import (rlengine/_ext.py).
Set RLENGINE_PORTABLE=1 to build without -march=native (e.g. for a wheel shared across CPUs).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

packages = find_packages(include=["rlengine", "rlengine.*"]) + ["rlengine.kernels"]
package_dir = {"rlengine.kernels": "kernels"}


def _extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("rlengine setup: torch not importable at build time, skipping the C++ extension", file=sys.stderr)
        return [], {}
    cxx = ["-O3", "-fopenmp", "-std=c++17"]
    if not os.environ.get("RLENGINE_PORTABLE"):
        cxx.append("-march=native")
    sources = sorted(glob.glob("csrc/*.cpp"))
    use_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if use_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        ext = cpp_extension.CUDAExtension(
            "rlengine._C", sources,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension("rlengine._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])

    class OptionalBuildExt(cpp_extension.BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - the extension is optional by design
                print(f"rlengine setup: C++ extension build failed ({exc}); "
                      "continuing with torch fallbacks", file=sys.stderr)

    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(packages=packages, package_dir=package_dir, package_data={"rlengine": ["configs/*.toml"]},
      ext_modules=ext_modules, cmdclass=cmdclass)
