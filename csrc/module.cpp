// rlengine._C: the Python module that loads the CPU ops (the CUDA kernels are rlengine._C_cuda).
// Ops register themselves with TORCH_LIBRARY_FRAGMENT(rlengine, ...) in their own source
// files and are called as torch.ops.rlengine.<name>; this file only owns the library.
#include <torch/extension.h>

TORCH_LIBRARY(rlengine, m) {}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rlengine C++ ops; call them through torch.ops.rlengine.*";
}
