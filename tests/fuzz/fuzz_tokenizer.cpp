// libFuzzer target: the fuzz input is text for three small byte-level BPE tokenizers (GPT-2,
// Llama-3 and Qwen2 split rules, built once from in-memory tokenizer.json documents). Each must
// encode any bytes, decode them back exactly, and stream-decode to whole UTF-8 characters.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.h"
#include "model/tokenizer.h"

namespace {

using json = nlohmann::json;

std::string byte_char(int b) {
  bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      n += ((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255)) ? 0 : 1;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

std::string tokenizer_json(const json& pre_tokenizer, bool ignore_merges) {
  json vocab = json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = next++;
  json merges = json::array();
  auto merge = [&](const std::string& l, const std::string& r) {
    if (vocab.contains(l + r) || !vocab.contains(l) || !vocab.contains(r)) return;
    merges.push_back(l + " " + r);
    vocab[l + r] = next++;
  };
  const std::string space = byte_char(' ');
  for (const char* pair : {"th", "he", "in", "er", "an", "re", "on", "at", "es", "or", "te", "st"})
    merge(std::string(1, pair[0]), std::string(1, pair[1]));
  merge("th", "e");
  merge(space, "the");
  merge(space, "a");
  merge(space, space);
  merge(space + space, space + space);
  merge("1", "2");
  merge("12", "3");
  merge(byte_char(0xE4), byte_char(0xB8));  // the first two bytes of many CJK characters
  merge(byte_char(0xF0), byte_char(0x9F));  // the first two bytes of most emoji
  json added = json::array();
  for (const char* content : {"<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|im"}) {
    added.push_back({{"id", next++}, {"content", content}, {"special", true}});
  }
  added.push_back({{"id", next++}, {"content", "user"}, {"special", false}});
  return json{{"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", pre_tokenizer},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model",
               {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", ignore_merges}}}}
      .dump();
}

json split(const char* pattern) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
}

std::vector<std::unique_ptr<spin::Tokenizer>> make_tokenizers() {
  std::vector<std::unique_ptr<spin::Tokenizer>> out;
  json gpt2 = {{"type", "Sequence"},
               {"pretokenizers",
                {{{"type", "Digits"}, {"individual_digits", true}},
                 {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}};
  const char* llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const char* qwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  out.push_back(std::make_unique<spin::Tokenizer>(spin::Tokenizer::from_json_string(tokenizer_json(gpt2, false))));
  out.push_back(std::make_unique<spin::Tokenizer>(spin::Tokenizer::from_json_string(tokenizer_json(split(llama3), true))));
  out.push_back(std::make_unique<spin::Tokenizer>(spin::Tokenizer::from_json_string(tokenizer_json(split(qwen2), false))));
  return out;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<uint8_t>(s[i]);
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || s.size() - i < len) return false;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
    }
    static const uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto tokenizers = make_tokenizers();
  if (size == 0) return 0;
  const spin::Tokenizer& tok = *tokenizers[data[0] % tokenizers.size()];
  bool parse_special = (data[0] & 0x80) == 0;
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    std::vector<int32_t> ids = tok.encode(text, parse_special);
    if (tok.decode(ids) != text) std::abort();
    spin::StreamDecoder stream(tok);
    std::string streamed;
    for (int32_t id : ids) {
      std::string piece = stream.push(id);
      if (!valid_utf8(piece)) std::abort();
      streamed += piece;
    }
    streamed += stream.flush();
    if (valid_utf8(text) && streamed != text) std::abort();
  } catch (const spin::Error&) {
  }
  return 0;
}
