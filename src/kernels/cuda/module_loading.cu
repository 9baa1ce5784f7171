#include "kernels/cuda/module_loading.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>

#include "base/error.h"

namespace spin::cuda {

void request_eager_module_loading() { setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0); }

bool module_loading_is_eager() {
  // Through the runtime's driver entry point: no link-time dependency on libcuda.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t status =
      cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &found);
  SPIN_CHECK(status == cudaSuccess && found == cudaDriverEntryPointSuccess && fn != nullptr,
             "cannot query the CUDA module loading mode: {}", cudaGetErrorString(status));
  CUmoduleLoadingMode mode{};
  const CUresult result = reinterpret_cast<CUresult (*)(CUmoduleLoadingMode*)>(fn)(&mode);
  SPIN_CHECK(result == CUDA_SUCCESS, "cuModuleGetLoadingMode failed (CUresult {})", static_cast<int>(result));
  return mode == CU_MODULE_EAGER_LOADING;
}

}  // namespace spin::cuda
