// rlengine._C_cuda: the Python module that loads the CUDA kernels of csrc/cuda/*.cu. Each .cu file
// registers its kernels with TORCH_LIBRARY_IMPL(rlengine, CUDA, ...) for ops whose schemas the CPU
// extension (rlengine._C) defines, so rlengine/_ext.py imports _C first. Built as its own extension
// (setup.py) so that a CUDA compile failure never takes the CPU ops with it.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rlengine CUDA kernels; call them through torch.ops.rlengine.*";
}
