#include "kernels/cuda/module_loading.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>

#include "base/error.h"
#include "kernels/cuda/driver_entry_point.h"

namespace spin::cuda {

void request_eager_module_loading() { setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0); }

bool module_loading_is_eager() {
  const auto get_mode = driver_entry_point<CUresult (*)(CUmoduleLoadingMode*)>("cuModuleGetLoadingMode");
  SPIN_CHECK(get_mode != nullptr, "cannot query the CUDA module loading mode (no cuModuleGetLoadingMode)");
  CUmoduleLoadingMode mode{};
  const CUresult result = get_mode(&mode);
  SPIN_CHECK(result == CUDA_SUCCESS, "cuModuleGetLoadingMode failed (CUresult {})", static_cast<int>(result));
  return mode == CU_MODULE_EAGER_LOADING;
}

}  // namespace spin::cuda
