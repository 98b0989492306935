#!/usr/bin/env bash
# Compile-check the CUDA extension's sources (setup.py's rlengine._C_cuda) against the installed torch's
# headers, on machines without a GPU or a CUDA build of torch (setup.py builds them only when torch has
# CUDA): every csrc/cuda/*.cu with nvcc for sm_90a (H100/H200), every csrc/cuda/*.cpp (the module file) with the host
# compiler. Object files go to a temporary folder and are thrown away; exit status 1 if any source fails.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || { echo "nvcc not found: nothing to check"; exit 1; }
inc=$(python3 -c "from torch.utils import cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A CPU wheel of torch lacks this one generated header of its CUDA build; its content there is this line.
mkdir -p "$tmp/inc/c10/cuda/impl"
[ -f "$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))")/include/c10/cuda/impl/cuda_cmake_macros.h" ] ||
  echo "#define C10_CUDA_BUILD_SHARED_LIBS" > "$tmp/inc/c10/cuda/impl/cuda_cmake_macros.h"
inc="$inc -I$tmp/inc"
status=0
for src in csrc/cuda/*.cu; do
  if nvcc -c "$src" -o "$tmp/$(basename "$src").o" $inc -std=c++17 -O2 -Xcompiler -fPIC \
      -D_GLIBCXX_USE_CXX11_ABI="$abi" --expt-relaxed-constexpr -arch=sm_90a -w; then
    echo "ok   $src"
  else
    echo "FAIL $src"; status=1
  fi
done
pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
for src in csrc/cuda/*.cpp; do
  [ -e "$src" ] || continue
  if c++ -fsyntax-only "$src" $inc -I"$pyinc" -std=c++17 -D_GLIBCXX_USE_CXX11_ABI="$abi" \
      -DTORCH_EXTENSION_NAME=_C_cuda -w; then
    echo "ok   $src"
  else
    echo "FAIL $src"; status=1
  fi
done
exit $status
