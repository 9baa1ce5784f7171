// `dense`: the vLLM-style baseline. Every page stays on the device tier and every page is
// attended; the budget does not apply.
#include "sparse/algorithm.h"

namespace spin::sparse {
namespace {

class DenseAlgorithm final : public SparseAlgorithm {
 public:
  AlgorithmTraits traits() const override { return {.placement = Placement::Device}; }
  void select(const SelectQuery& query, kv::LayerSelection& out, StepBudget&) override {
    select_all(query, out);
  }
};

}  // namespace

void register_dense(AlgorithmRegistry& registry) {
  registry.add("dense", [](const AlgorithmContext&) { return std::make_unique<DenseAlgorithm>(); });
}

}  // namespace spin::sparse
