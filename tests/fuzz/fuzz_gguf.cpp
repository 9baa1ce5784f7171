// libFuzzer target for the GGUF reader: parse, read metadata through the typed accessors,
// dequantize the tensors (bounded work) and map the file to model weights when it is small.
#include <cstddef>
#include <cstdint>

#include "base/error.h"
#include "model/gguf.h"
#include "model/loader.h"

namespace {

constexpr uint64_t kMaxElements = uint64_t{1} << 20;

void touch(const spin::GgufValue& v) {
  using Kind = spin::GgufValue::Kind;
  try {
    switch (v.kind) {
      case Kind::UInt: case Kind::Int: (void)v.as_int(); (void)v.as_float(); break;
      case Kind::Float: (void)v.as_float(); break;
      case Kind::Bool: (void)v.as_bool(); break;
      case Kind::String: (void)v.as_string().size(); break;
      case Kind::Array:
        for (const spin::GgufValue& e : v.as_array()) touch(e);
        break;
    }
  } catch (const spin::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const spin::GgufFile f = spin::GgufFile::from_memory(data, size, "fuzz.gguf");
    for (const auto& [key, value] : f.metadata()) touch(value);
    uint64_t elements = 0;
    for (const spin::GgufTensorInfo& t : f.tensors()) {
      if (t.n_elements > kMaxElements - elements) return 0;
      elements += t.n_elements;
      (void)f.dequantize(t);
    }
    (void)spin::load_gguf_weights(f);
  } catch (const spin::Error&) {
  }
  return 0;
}
