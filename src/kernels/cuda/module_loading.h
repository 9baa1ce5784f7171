#pragma once
// How the CUDA driver loads this process's kernels. By default (CUDA_MODULE_LOADING=LAZY) a
// kernel's module is loaded at its first launch, and loading holds the context lock while it
// waits for the GPU's queued work to drain. With one thread per GPU in one process (tensor
// parallelism), a rank that launches a kernel for the first time can then wait behind another
// rank's NCCL all-reduce, which waits for this rank: a deadlock. Eager loading (every module
// loaded when the context is created) removes that first-launch wait, so tensor parallelism
// requires it. The mode is read once, when the driver initialises.

namespace spin::cuda {

// Sets CUDA_MODULE_LOADING=EAGER unless the environment sets it already. Takes effect only when
// called before the process's first CUDA call (not thread-safe: setenv).
void request_eager_module_loading();

// Whether the driver loads modules eagerly (cuModuleGetLoadingMode); initialises the driver.
bool module_loading_is_eager();

}  // namespace spin::cuda
