// `dense-offload`: all KV in the host tier; every page of a layer is fetched at each step and
// dropped after the layer's attention, so the device holds one layer's KV at a time (plus the
// always-resident pages). The budget does not apply.
#include "sparse/algorithm.h"

namespace spin::sparse {
namespace {

class DenseOffloadAlgorithm final : public SparseAlgorithm {
 public:
  AlgorithmTraits traits() const override { return {.placement = Placement::Stream}; }
  void select(const SelectQuery& query, kv::LayerSelection& out, StepBudget&) override {
    select_all(query, out);
  }
};

}  // namespace

void register_dense_offload(AlgorithmRegistry& registry) {
  registry.add("dense-offload",
               [](const AlgorithmContext&) { return std::make_unique<DenseOffloadAlgorithm>(); });
}

}  // namespace spin::sparse
