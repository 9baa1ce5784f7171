#include "model/gemm_tuning.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <charconv>
#include <cmath>
#include <fstream>
#include <system_error>

#include "base/error.h"
#include "base/mapped_file.h"

namespace spin {

namespace {

using nlohmann::json;

constexpr const char* kFormat = "spin-gemm-tuning/1";

std::string algo_hex(const std::array<uint64_t, 8>& algo) {
  std::string out;
  for (uint64_t word : algo) out += fmt::format("{:016x}", word);
  return out;
}

// One entry of a table; `where` names it in errors.
class EntryReader {
 public:
  EntryReader(const json& entry, std::string where) : entry_(entry), where_(std::move(where)) {
    SPIN_CHECK(entry.is_object(), "{}: not an object", where_);
  }

  int64_t positive(const char* key) const {
    const json& v = field(key);
    SPIN_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, "{}: '{}' must be a positive integer", where_, key);
    return v.get<int64_t>();
  }

  double microseconds(const char* key) const {
    const json& v = field(key);
    SPIN_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
               "{}: '{}' must be a non-negative number of microseconds", where_, key);
    return v.get<double>();
  }

  bool float_output() const {
    const json& v = field("output");
    SPIN_CHECK(v.is_string() && (v == "bf16" || v == "f32"), "{}: 'output' must be \"bf16\" or \"f32\"", where_);
    return v == "f32";
  }

  std::array<uint64_t, 8> algo() const {
    const json& v = field("algo");
    constexpr size_t kDigits = 8 * 16;
    SPIN_CHECK(v.is_string() && v.get_ref<const std::string&>().size() == kDigits,
               "{}: 'algo' must be {} hex digits (cuBLASLt's 64-byte algorithm)", where_, kDigits);
    const char* hex = v.get_ref<const std::string&>().data();
    std::array<uint64_t, 8> words{};
    for (size_t i = 0; i < words.size(); ++i) {
      const char* end = hex + (i + 1) * 16;
      // 16 hex digits always fit; parsing stops at the first character that is not one.
      const char* stop = std::from_chars(hex + i * 16, end, words[i], 16).ptr;
      SPIN_CHECK(stop == end, "{}: 'algo' has '{}', not a hex digit", where_, *stop);
    }
    return words;
  }

 private:
  const json& field(const char* key) const {
    const auto it = entry_.find(key);
    SPIN_CHECK(it != entry_.end(), "{}: missing '{}'", where_, key);
    return *it;
  }

  const json& entry_;
  std::string where_;
};

}  // namespace

GemmTuningTable GemmTuningTable::load(const std::filesystem::path& path, const std::string& hardware) {
  GemmTuningTable table;
  table.path_ = path;
  table.hardware_ = hardware;
  const std::string where = fmt::format("GEMM tuning file {}", path.string());
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return table;
  SPIN_CHECK(std::filesystem::is_regular_file(path, ec), "{}: not a regular file", where);
  const std::string text = read_text_file(path.string());
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return table;  // e.g. made by mktemp

  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {  // a syntax error, or a number too large for a double
    fail("{}: not valid JSON ({})", where, e.what());
  }
  SPIN_CHECK(root.is_object() && root.value("format", json()) == kFormat,
             "{}: not a spin GEMM tuning file (expected \"format\": \"{}\")", where, kFormat);
  const auto tables = root.find("tables");
  SPIN_CHECK(tables != root.end() && tables->is_array(), "{}: 'tables' must be an array", where);
  bool seen = false;
  for (size_t t = 0; t < tables->size(); ++t) {
    const json& section = (*tables)[t];
    const std::string table_where = fmt::format("{}, table {}", where, t);
    SPIN_CHECK(section.is_object() && section.contains("hardware") && section["hardware"].is_string(),
               "{}: needs a 'hardware' string", table_where);
    SPIN_CHECK(section.contains("choices") && section["choices"].is_array(), "{}: 'choices' must be an array",
               table_where);
    if (section["hardware"] != hardware) {
      table.other_tables_.push_back(section.dump());
      continue;
    }
    SPIN_CHECK(!seen, "{}: two tables for hardware '{}'", where, hardware);
    seen = true;
    const json& choices = section["choices"];
    for (size_t i = 0; i < choices.size(); ++i) {
      const EntryReader entry(choices[i], fmt::format("{}, choice {}", table_where, i));
      const GemmShape shape{entry.positive("rows"), entry.positive("out"), entry.positive("in"), entry.float_output()};
      const GemmChoice choice{entry.algo(), entry.microseconds("us"), entry.microseconds("heuristic_us")};
      SPIN_CHECK(table.choices_.emplace(shape, choice).second, "{}, choice {}: a second choice for the same shape",
                 table_where, i);
    }
  }
  return table;
}

const GemmChoice* GemmTuningTable::find(const GemmShape& shape) const {
  const auto it = choices_.find(shape);
  return it == choices_.end() ? nullptr : &it->second;
}

void GemmTuningTable::put(const GemmShape& shape, const GemmChoice& choice) { choices_[shape] = choice; }

void GemmTuningTable::save() const {
  // Readable, and finer than the timing; a time too large to scale is written as it is.
  const auto hundredths = [](double us) { return us < 1e12 ? std::round(us * 100) / 100 : us; };
  json choices = json::array();
  for (const auto& [shape, choice] : choices_) {
    choices.push_back({{"rows", shape.rows},
                       {"out", shape.out_features},
                       {"in", shape.in_features},
                       {"output", shape.float_output ? "f32" : "bf16"},
                       {"algo", algo_hex(choice.algo)},
                       {"us", hundredths(choice.time_us)},
                       {"heuristic_us", hundredths(choice.heuristic_us)}});
  }
  json tables = json::array();
  for (const std::string& other : other_tables_) tables.push_back(json::parse(other));
  tables.push_back({{"hardware", hardware_}, {"choices", std::move(choices)}});
  const json root{{"format", kFormat}, {"tables", std::move(tables)}};

  std::filesystem::path tmp = path_;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    SPIN_CHECK(out, "GEMM tuning file {}: cannot write {}", path_.string(), tmp.string());
    out << root.dump(1) << '\n';
    out.close();
    SPIN_CHECK(out, "GEMM tuning file {}: writing {} failed", path_.string(), tmp.string());
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    fail("GEMM tuning file {}: cannot replace it: {}", path_.string(), why);
  }
}

}  // namespace spin
