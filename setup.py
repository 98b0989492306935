"""Build script: the Python packages plus two optional C++ extensions.

rlengine._C holds the CPU ops (csrc/*.cpp) and rlengine._C_cuda the CUDA kernels (csrc/cuda/*),
built only when torch has CUDA and nvcc is found. Ops register with TORCH_LIBRARY_FRAGMENT /
TORCH_LIBRARY_IMPL (torch.ops.rlengine.*), so each source file stands alone and no binding file
lists them. The two extensions build and fail separately: a bad .cu file costs the CUDA kernels,
never the CPU ops. A failed build prints the compiler's output, does not fail the install, and is
recorded in rlengine/_build_status.json, which rlengine/model/ext.py reads (the import warning and
`rlengine info` show it). Environment (read here only, never by library code):
  RLENGINE_REQUIRE_EXT=1  a failed or skipped extension build fails the install (tools/gpu_check.sh)
  RLENGINE_PORTABLE=1     no -march=native (e.g. for a wheel shared across CPUs)
"""

import glob
import json
import os
import sys
import tempfile
from pathlib import Path

from setuptools import find_packages, setup

packages = find_packages(include=["rlengine", "rlengine.*"]) + ["rlengine.kernels"]
package_dir = {"rlengine.kernels": "kernels"}
REQUIRE = os.environ.get("RLENGINE_REQUIRE_EXT") == "1"
STATUS_FILE = "_build_status.json"


def _fail(msg: str) -> None:
    print(f"rlengine setup: {msg}", file=sys.stderr)
    if REQUIRE:
        raise SystemExit(f"rlengine setup: RLENGINE_REQUIRE_EXT=1 and {msg}")


def _extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _fail("torch not importable at build time, skipping the C++ extensions")
        return [], {}
    cxx = ["-O3", "-fopenmp", "-std=c++17"]
    if not os.environ.get("RLENGINE_PORTABLE"):
        cxx.append("-march=native")
    exts = [cpp_extension.CppExtension("rlengine._C", sorted(glob.glob("csrc/*.cpp")), extra_compile_args=cxx,
                                       extra_link_args=["-fopenmp"])]
    skipped = {}
    if torch.version.cuda is None:
        skipped["rlengine._C_cuda"] = "torch is a CPU build"
    elif cpp_extension.CUDA_HOME is None:
        skipped["rlengine._C_cuda"] = "nvcc not found (set CUDA_HOME)"
        _fail("torch has CUDA but nvcc was not found: the CUDA extension is skipped")
    else:
        exts.append(cpp_extension.CUDAExtension(
            "rlengine._C_cuda", sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "--use_fast_math"]}))

    class BuildEachExtension(cpp_extension.BuildExtension):
        """Builds every extension on its own: a failure is printed, recorded, and fatal only with
        RLENGINE_REQUIRE_EXT=1."""

        def run(self):
            self._status = {name: {"ok": False, "skipped": why} for name, why in skipped.items()}
            super().run()
            if self.extensions:  # next to the built modules (the source package for inplace/editable builds)
                path = Path(self.get_ext_fullpath(self.extensions[0].name)).parent / STATUS_FILE
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(self._status, indent=2))

        def _built(self):  # before run() every extension is still expected
            status = getattr(self, "_status", None)
            return list(self.extensions) if status is None else [e for e in self.extensions
                                                                  if status.get(e.name, {}).get("ok")]

        def copy_extensions_to_source(self):  # inplace builds: copy only what was built
            everything, self.extensions = self.extensions, self._built()
            try:
                super().copy_extensions_to_source()
            finally:
                self.extensions = everything

        def get_outputs(self):  # wheels and editable installs: list only what was built
            everything, self.extensions = self.extensions, self._built()
            try:
                return super().get_outputs()
            finally:
                self.extensions = everything

        def get_output_mapping(self):
            everything, self.extensions = self.extensions, self._built()
            try:
                return super().get_output_mapping()
            finally:
                self.extensions = everything

        def build_extension(self, ext):
            # torch's ninja build writes the compiler's output straight to fd 1: capture it there
            with tempfile.TemporaryFile() as log:
                sys.stdout.flush()
                saved = os.dup(1)
                os.dup2(log.fileno(), 1)
                try:
                    super().build_extension(ext)
                    error = None
                except Exception as exc:  # noqa: BLE001 - compiler and linker failures arrive as several types
                    error = str(exc)
                finally:
                    sys.stdout.flush()
                    os.dup2(saved, 1)
                    os.close(saved)
                log.seek(0)
                output = log.read().decode(errors="replace")
            if error is None:
                sys.stdout.write(output)
                self._status[ext.name] = {"ok": True}
                return
            text = f"{output}\n{error}"
            print(f"rlengine setup: building {ext.name} failed; the compiler said:\n{text}", file=sys.stderr)
            self._status[ext.name] = {"ok": False, "error": text[-6000:]}
            _fail(f"building {ext.name} failed")

    return exts, {"build_ext": BuildEachExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(packages=packages, package_dir=package_dir, package_data={"rlengine": ["configs/*.toml", "configs/data/*.jsonl", "configs/data/*.jinja"]},
      ext_modules=ext_modules, cmdclass=cmdclass)
