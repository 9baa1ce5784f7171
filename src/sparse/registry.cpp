#include <algorithm>

#include "base/error.h"
#include "sparse/algorithm.h"

// The built-in algorithms, one line each. An explicit list rather than static registrars in the
// algorithms' files: spin_sparse is a static library, and the linker drops object files that
// nothing references, registrars included.
#define SPIN_BUILTIN_SPARSE_ALGORITHMS(X) \
  X(dense)                                \
  X(dense_offload)                        \
  X(quest)                                \
  X(shadowkv)                             \
  X(retroinfer)                           \
  X(seer)

namespace spin::sparse {

#define SPIN_DECLARE_REGISTER(name) void register_##name(AlgorithmRegistry& registry);
SPIN_BUILTIN_SPARSE_ALGORITHMS(SPIN_DECLARE_REGISTER)
#undef SPIN_DECLARE_REGISTER

AlgorithmRegistry& AlgorithmRegistry::global() {
  static AlgorithmRegistry registry = [] {
    AlgorithmRegistry r;
#define SPIN_CALL_REGISTER(name) register_##name(r);
    SPIN_BUILTIN_SPARSE_ALGORITHMS(SPIN_CALL_REGISTER)
#undef SPIN_CALL_REGISTER
    return r;
  }();
  return registry;
}

void AlgorithmRegistry::add(const std::string& name, AlgorithmFactory factory) {
  SPIN_CHECK(!name.empty() && factory, "sparse algorithm registration needs a name and a factory");
  SPIN_CHECK(!contains(name), "sparse algorithm '{}' is registered twice", name);
  entries_.emplace_back(name, std::move(factory));
}

bool AlgorithmRegistry::contains(const std::string& name) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const auto& e) { return e.first == name; });
}

std::vector<std::string> AlgorithmRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.first);
  std::sort(out.begin(), out.end());
  return out;
}

std::unique_ptr<SparseAlgorithm> AlgorithmRegistry::create(const std::string& name,
                                                           const AlgorithmContext& context) const {
  for (const auto& e : entries_) {
    if (e.first == name) return e.second(context);
  }
  std::string known;
  for (const std::string& n : names()) known += (known.empty() ? "" : ", ") + n;
  fail("unknown sparse algorithm '{}' (registered: {})", name, known);
}

}  // namespace spin::sparse
