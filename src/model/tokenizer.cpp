// Byte-level BPE as GPT-2, Llama 3, Qwen2/3 and SmolLM2 use it, matching HF `tokenizers`:
//   1. added tokens are matched first (leftmost, then longest), the text between them is plain;
//   2. plain text is split into pre-tokens by a sequence of regex splits (PCRE2, UTF + UCP);
//   3. every pre-token is mapped byte -> printable unicode char (GPT-2's table) and merged by
//      BPE rank.
// Invalid UTF-8: HF cannot take it at all (its input is a Rust &str; a Python str with lone
// surrogates is refused). spin keeps every input byte: each maximal valid run is pre-tokenized
// normally and each invalid byte becomes its own pre-token (a single byte token), so
// decode(encode(bytes)) == bytes holds for any input.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "base/error.h"
#include "base/mapped_file.h"
#include "model/gguf.h"

namespace spin {
namespace {

using json = nlohmann::json;

// Split patterns, as HF tokenizers and llama.cpp spell them.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// HF's Digits pre-tokenizer (Rust char::is_numeric == general category N).
constexpr const char* kDigitPattern = R"(\p{N})";
constexpr const char* kDigitRunPattern = R"(\p{N}+)";

// Stored words longer than this are not cached (they are rare and would bloat the cache).
constexpr size_t kMaxCachedWordBytes = 128;
constexpr size_t kMaxCacheEntries = 1 << 17;
// Bounds on what a tokenizer file may declare, so a corrupt file cannot ask for huge tables.
constexpr int64_t kMaxVocab = 1 << 24;

// GPT-2's reversible byte <-> unicode table: printable Latin-1 bytes map to themselves, the
// rest to U+0100 upward in byte order.
struct ByteTable {
  std::array<std::string, 256> byte_to_utf8;
  std::unordered_map<uint32_t, uint8_t> codepoint_to_byte;
  ByteTable() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = printable ? b : next++;
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      byte_to_utf8[b] = s;
      codepoint_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if the bytes there are not one
// (overlong forms, surrogates and code points above U+10FFFF are invalid).
size_t utf8_sequence_length(std::string_view s, size_t i) {
  auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  uint8_t c = byte(i);
  if (c < 0x80) return 1;
  size_t len;
  uint32_t min_cp;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    len = 2, min_cp = 0x80, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, min_cp = 0x800, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, min_cp = 0x10000, cp = c & 0x07;
  } else {
    return 0;
  }
  if (s.size() - i < len) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

// At s[i], which starts no valid sequence: the length of the maximal prefix of a well-formed
// sequence there (at least 1) and the length the lead byte asks for (0 if it is no lead byte).
std::pair<size_t, size_t> utf8_maximal_prefix(std::string_view s, size_t i) {
  auto c = static_cast<uint8_t>(s[i]);
  uint8_t lo = 0x80;
  uint8_t hi = 0xBF;
  size_t need;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return {1, 0};
  }
  size_t prefix = 1;
  while (prefix < need && i + prefix < s.size()) {
    auto b = static_cast<uint8_t>(s[i + prefix]);
    bool ok = prefix == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) break;
    ++prefix;
  }
  return {prefix, need};
}

// Decodes one code point of a string known to be valid UTF-8; advances i.
uint32_t next_codepoint(std::string_view s, size_t& i) {
  size_t len = utf8_sequence_length(s, i);
  SPIN_CHECK(len != 0, "invalid UTF-8 in tokenizer vocabulary entry");
  auto c = static_cast<uint8_t>(s[i]);
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

// Rust's char::is_whitespace (the Unicode White_Space property), used by lstrip/rstrip.
bool is_unicode_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// HF tokenizers matches with Oniguruma, whose Unicode \s is [\t\n\v\f\r\x85\p{Z}]; PCRE2's
// (UCP) also takes U+180E. Spelling the class out makes both engines agree. A \S inside a
// bracket class cannot be spelled out and is left to PCRE2.
std::string onig_whitespace_classes(std::string_view pattern) {
  constexpr std::string_view kSpace = R"(\t\n\x0B\f\r\x{85}\p{Z})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char e = pattern[++i];
      if (e == 's') {
        out += in_class ? std::string(kSpace) : "[" + std::string(kSpace) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kSpace) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

// A compiled PCRE2 pattern (UTF + UCP, JIT when available). Matching never checks UTF-8:
// callers only pass valid runs.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal)
      : pattern_(literal ? pattern : onig_whitespace_classes(pattern)) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(), options,
                          &error, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      fail("tokenizer split regex does not compile at offset {}: {} (pattern: {})", offset,
           reinterpret_cast<const char*>(message), pattern);
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // Appends to `out` the pieces of `text` (offset by `base`): every match and every non-empty
  // gap between matches (HF's Split with behavior "Isolated").
  void split(std::string_view text, size_t base, pcre2_match_data* match,
             std::vector<std::pair<size_t, size_t>>& out) const {
    size_t start = 0;
    size_t gap_start = 0;
    while (start < text.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                           PCRE2_NO_UTF_CHECK, match, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof(message));
        fail("tokenizer split regex failed: {}", reinterpret_cast<const char*>(message));
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
      size_t match_begin = ovector[0];
      size_t match_end = ovector[1];
      if (match_end == match_begin) {
        // An empty match splits nothing; step over one character and search again.
        start = match_begin + std::max<size_t>(1, utf8_sequence_length(text, match_begin));
        continue;
      }
      if (match_begin > gap_start) out.emplace_back(base + gap_start, match_begin - gap_start);
      out.emplace_back(base + match_begin, match_end - match_begin);
      gap_start = start = match_end;
    }
    if (gap_start < text.size()) out.emplace_back(base + gap_start, text.size() - gap_start);
  }

 private:
  std::string pattern_;
  pcre2_code* code_ = nullptr;
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
};

// Byte trie over added-token contents: leftmost-longest matching like HF's aho-corasick.
class AddedTokenTrie {
 public:
  void insert(const std::string& content, int32_t index) {
    int32_t node = 0;
    for (unsigned char c : content) {
      auto it = nodes_[node].children.find(c);
      if (it == nodes_[node].children.end()) {
        nodes_.push_back({});
        it = nodes_[node].children.emplace(c, static_cast<int32_t>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    nodes_[node].token = index;
  }
  // The longest token (index into the added list, and its length) starting at text[i] among
  // those `accept` allows; {-1, 0} if none.
  template <typename Accept>
  std::pair<int32_t, size_t> longest_at(std::string_view text, size_t i, Accept accept) const {
    std::pair<int32_t, size_t> best{-1, 0};
    int32_t node = 0;
    for (size_t k = i; k < text.size(); ++k) {
      auto it = nodes_[node].children.find(static_cast<unsigned char>(text[k]));
      if (it == nodes_[node].children.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0 && accept(nodes_[node].token)) best = {nodes_[node].token, k + 1 - i};
    }
    return best;
  }
  bool empty() const { return nodes_.size() == 1; }

 private:
  struct Node {
    std::unordered_map<unsigned char, int32_t> children;
    int32_t token = -1;
  };
  std::vector<Node> nodes_{1};
};

// The pieces a JSON pre_tokenizer or a GGUF `tokenizer.ggml.pre` name turn into.
std::vector<std::shared_ptr<const Regex>> split_steps_for_gguf_pre(const std::string& pre,
                                                                    bool& ignore_merges) {
  std::vector<std::shared_ptr<const Regex>> steps;
  ignore_merges = false;
  if (pre == "gpt2" || pre == "default") {
    steps.push_back(std::make_shared<Regex>(kGpt2Pattern, false));
  } else if (pre == "smollm") {
    // SmolLM2's tokenizer.json: Sequence[Digits(individual_digits=true), ByteLevel(use_regex)].
    steps.push_back(std::make_shared<Regex>(kDigitPattern, false));
    steps.push_back(std::make_shared<Regex>(kGpt2Pattern, false));
  } else if (pre == "llama-bpe" || pre == "llama3") {
    steps.push_back(std::make_shared<Regex>(kLlama3Pattern, false));
    ignore_merges = true;  // Llama 3's tokenizer.json sets model.ignore_merges
  } else if (pre == "qwen2") {
    steps.push_back(std::make_shared<Regex>(kQwen2Pattern, false));
  } else {
    fail("unsupported tokenizer.ggml.pre '{}' (supported: gpt2, default, smollm, llama-bpe, "
         "llama3, qwen2)",
         pre);
  }
  return steps;
}

void add_json_pre_tokenizer(const json& pre, std::vector<std::shared_ptr<const Regex>>& steps) {
  if (pre.is_null()) return;
  std::string type = pre.value("type", "");
  if (type == "Sequence") {
    for (const auto& child : pre.at("pretokenizers")) add_json_pre_tokenizer(child, steps);
  } else if (type == "ByteLevel") {
    SPIN_CHECK(!pre.value("add_prefix_space", false),
               "tokenizer.json: ByteLevel pre_tokenizer with add_prefix_space=true is not supported");
    if (pre.value("use_regex", true)) steps.push_back(std::make_shared<Regex>(kGpt2Pattern, false));
  } else if (type == "Digits") {
    steps.push_back(std::make_shared<Regex>(
        pre.value("individual_digits", false) ? kDigitPattern : kDigitRunPattern, false));
  } else if (type == "Split") {
    std::string behavior = pre.value("behavior", "");
    SPIN_CHECK(behavior == "Isolated",
               "tokenizer.json: Split pre_tokenizer behavior '{}' is not supported (only Isolated)",
               behavior);
    SPIN_CHECK(!pre.value("invert", false),
               "tokenizer.json: Split pre_tokenizer with invert=true is not supported");
    const json& pattern = pre.at("pattern");
    if (pattern.contains("Regex")) {
      steps.push_back(std::make_shared<Regex>(pattern.at("Regex").get<std::string>(), false));
    } else if (pattern.contains("String")) {
      steps.push_back(std::make_shared<Regex>(pattern.at("String").get<std::string>(), true));
    } else {
      fail("tokenizer.json: Split pre_tokenizer pattern is neither Regex nor String");
    }
  } else {
    fail("tokenizer.json: pre_tokenizer type '{}' is not supported (supported: ByteLevel, Split, "
         "Digits, Sequence of those)",
         type);
  }
}

// tokenizer_config.json writes a token either as a string or as {"content": "..."}.
std::string config_token_content(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content")) return value.at("content").get<std::string>();
  return {};
}

}  // namespace

struct Tokenizer::Impl {
  std::vector<std::string> texts;   // vocabulary string per id
  std::vector<std::string> bytes;   // decoded bytes per id
  std::vector<uint8_t> special;     // per id: an added token with special=true
  std::unordered_map<std::string, int32_t> text_to_id;
  std::array<int32_t, 256> byte_token{};  // id of the single-byte token, -1 if absent
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  bool ignore_merges = false;
  std::vector<std::shared_ptr<const Regex>> split_steps;
  std::vector<AddedToken> added;
  AddedTokenTrie added_trie;

  int32_t bos = -1;
  int32_t eos = -1;
  bool add_bos = false;
  std::vector<int32_t> stops;
  std::string chat_template;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> word_cache;

  void set_vocab_size(int64_t n) {
    SPIN_CHECK(n > 0 && n <= kMaxVocab, "tokenizer vocabulary size {} is out of range (1..{})", n,
               kMaxVocab);
    texts.assign(static_cast<size_t>(n), {});
    special.assign(static_cast<size_t>(n), 0);
  }

  void set_token(int64_t id, std::string text) {
    SPIN_CHECK(id >= 0 && id < static_cast<int64_t>(texts.size()), "token id {} is out of range",
               id);
    text_to_id.emplace(text, static_cast<int32_t>(id));
    texts[static_cast<size_t>(id)] = std::move(text);
  }

  void add_merge(std::string_view left, std::string_view right, int32_t rank) {
    auto l = text_to_id.find(std::string(left));
    auto r = text_to_id.find(std::string(right));
    SPIN_CHECK(l != text_to_id.end() && r != text_to_id.end(),
               "tokenizer merge '{} {}' names a token that is not in the vocabulary", left, right);
    auto merged = text_to_id.find(std::string(left) + std::string(right));
    SPIN_CHECK(merged != text_to_id.end(),
               "tokenizer merge '{} {}' produces a token that is not in the vocabulary", left,
               right);
    uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(l->second)) << 32) |
                   static_cast<uint32_t>(r->second);
    merges[key] = {rank, merged->second};  // a repeated merge keeps its last rank, as HF does
  }

  void add_added_token(AddedToken token) {
    SPIN_CHECK(!token.content.empty(), "added token {} has empty content", token.id);
    if (token.special) special[static_cast<size_t>(token.id)] = 1;
    added_trie.insert(token.content, static_cast<int32_t>(added.size()));
    added.push_back(std::move(token));
  }

  // Everything derived from the tables once they are filled.
  void finish() {
    const ByteTable& table = byte_table();
    for (int b = 0; b < 256; ++b) {
      auto it = text_to_id.find(table.byte_to_utf8[b]);
      byte_token[b] = it == text_to_id.end() ? -1 : it->second;
    }
    bytes.resize(texts.size());
    for (size_t id = 0; id < texts.size(); ++id) {
      const std::string& text = texts[id];
      std::string decoded;
      bool all_mapped = true;
      size_t i = 0;
      while (i < text.size()) {
        size_t len = utf8_sequence_length(text, i);
        if (len == 0) {
          all_mapped = false;
          break;
        }
        uint32_t cp = next_codepoint(text, i);
        auto it = table.codepoint_to_byte.find(cp);
        if (it == table.codepoint_to_byte.end()) {
          all_mapped = false;
          break;
        }
        decoded.push_back(static_cast<char>(it->second));
      }
      // HF's ByteLevel decoder keeps a token's own UTF-8 when any char is outside the table.
      bytes[id] = all_mapped ? std::move(decoded) : text;
    }
    for (const AddedToken& token : added) bytes[static_cast<size_t>(token.id)] = token.content;

    SPIN_CHECK(bos < static_cast<int32_t>(texts.size()), "bos token id {} is out of range", bos);
    SPIN_CHECK(eos < static_cast<int32_t>(texts.size()), "eos token id {} is out of range", eos);
    if (eos >= 0) stops.push_back(eos);
    for (const char* name :
         {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>"}) {
      auto it = text_to_id.find(name);
      if (it != text_to_id.end() && std::find(stops.begin(), stops.end(), it->second) == stops.end())
        stops.push_back(it->second);
    }
  }

  // BPE of one pre-token (raw bytes); appends ids.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const {
    bool cacheable = word.size() <= kMaxCachedWordBytes;
    if (cacheable) {
      std::lock_guard lock(cache_mutex);
      auto it = word_cache.find(std::string(word));
      if (it != word_cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = merge_word(word);
    out.insert(out.end(), ids.begin(), ids.end());
    if (cacheable) {
      std::lock_guard lock(cache_mutex);
      if (word_cache.size() >= kMaxCacheEntries) word_cache.clear();
      word_cache.emplace(std::string(word), std::move(ids));
    }
  }

  std::vector<int32_t> merge_word(std::string_view word) const {
    if (ignore_merges) {
      std::string mapped;
      for (unsigned char c : word) mapped += byte_table().byte_to_utf8[c];
      auto it = text_to_id.find(mapped);
      if (it != text_to_id.end()) return {it->second};
    }
    struct Symbol {
      int32_t id;
      int32_t prev;
      int32_t next;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    for (unsigned char c : word) {
      int32_t id = byte_token[c];
      if (id < 0) continue;  // no token for this byte and no unk token: HF drops it too
      int32_t index = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, index - 1, index + 1});
    }
    if (symbols.empty()) return {};
    symbols.back().next = -1;

    struct Candidate {
      int32_t rank;
      int32_t pos;
      int32_t merged;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    auto lookup = [&](int32_t left, int32_t right) -> const std::pair<int32_t, int32_t>* {
      uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
                     static_cast<uint32_t>(right);
      auto it = merges.find(key);
      return it == merges.end() ? nullptr : &it->second;
    };
    auto consider = [&](int32_t pos) {
      int32_t next = symbols[static_cast<size_t>(pos)].next;
      if (next < 0) return;
      if (auto* m = lookup(symbols[static_cast<size_t>(pos)].id, symbols[static_cast<size_t>(next)].id))
        queue.push({m->first, pos, m->second});
    };
    for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(symbols.size()); ++pos) consider(pos);

    std::vector<uint8_t> dead(symbols.size(), 0);
    while (!queue.empty()) {
      Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[static_cast<size_t>(top.pos)];
      if (dead[static_cast<size_t>(top.pos)] || left.next < 0) continue;
      Symbol& right = symbols[static_cast<size_t>(left.next)];
      // Stale if either side changed since the candidate was queued.
      auto* m = lookup(left.id, right.id);
      if (m == nullptr || m->second != top.merged || m->first != top.rank) continue;
      left.id = top.merged;
      dead[static_cast<size_t>(left.next)] = 1;
      left.next = right.next;
      if (left.next >= 0) symbols[static_cast<size_t>(left.next)].prev = top.pos;
      if (left.prev >= 0) consider(left.prev);
      consider(top.pos);
    }
    std::vector<int32_t> ids;
    for (int32_t pos = 0; pos >= 0; pos = symbols[static_cast<size_t>(pos)].next)
      ids.push_back(symbols[static_cast<size_t>(pos)].id);
    return ids;
  }

  // Plain text (no added tokens): pre-tokenize and BPE each piece.
  void encode_plain(std::string_view text, pcre2_match_data* match, std::vector<int32_t>& out) const {
    std::vector<std::pair<size_t, size_t>> pieces, next_pieces;
    size_t i = 0;
    while (i < text.size()) {
      size_t run_end = i;
      while (run_end < text.size()) {
        size_t len = utf8_sequence_length(text, run_end);
        if (len == 0) break;
        run_end += len;
      }
      if (run_end > i) {
        pieces.clear();
        pieces.emplace_back(i, run_end - i);
        for (const auto& step : split_steps) {
          next_pieces.clear();
          for (auto [begin, size] : pieces) step->split(text.substr(begin, size), begin, match, next_pieces);
          pieces.swap(next_pieces);
        }
        for (auto [begin, size] : pieces) encode_word(text.substr(begin, size), out);
      }
      if (run_end < text.size()) encode_word(text.substr(run_end, 1), out);  // an invalid byte
      i = run_end + (run_end < text.size() ? 1 : 0);
    }
  }

  std::vector<int32_t> encode(std::string_view text, bool parse_special) const {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    pcre2_match_data* match = nullptr;
    // Only the whole-match offsets are read, so one pair suffices for every pattern.
    if (!split_steps.empty()) match = pcre2_match_data_create(1, nullptr);
    struct MatchDataFree {
      void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
    };
    std::unique_ptr<pcre2_match_data, MatchDataFree> match_owner(match);

    auto accept = [&](int32_t index) { return parse_special || !added[static_cast<size_t>(index)].special; };
    size_t plain_start = 0;
    size_t i = 0;
    while (i < text.size()) {
      auto [index, length] = added_trie.empty() ? std::pair<int32_t, size_t>{-1, 0}
                                                : added_trie.longest_at(text, i, accept);
      if (index < 0) {
        ++i;
        continue;
      }
      const AddedToken& token = added[static_cast<size_t>(index)];
      size_t begin = i;
      size_t end = i + length;
      if (token.lstrip) begin = strip_whitespace_left(text, plain_start, begin);
      if (token.rstrip) end = strip_whitespace_right(text, end);
      encode_plain(text.substr(plain_start, begin - plain_start), match, out);
      out.push_back(token.id);
      plain_start = i = end;
    }
    encode_plain(text.substr(plain_start), match, out);
    return out;
  }

  // lstrip: the token swallows whitespace before it (down to `floor`).
  static size_t strip_whitespace_left(std::string_view text, size_t floor, size_t pos) {
    while (pos > floor) {
      size_t start = pos - 1;
      while (start > floor && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
      size_t len = utf8_sequence_length(text, start);
      if (len != pos - start) break;
      size_t k = start;
      if (!is_unicode_whitespace(next_codepoint(text, k))) break;
      pos = start;
    }
    return pos;
  }
  static size_t strip_whitespace_right(std::string_view text, size_t pos) {
    while (pos < text.size()) {
      size_t len = utf8_sequence_length(text, pos);
      if (len == 0) break;
      size_t k = pos;
      if (!is_unicode_whitespace(next_codepoint(text, k))) break;
      pos += len;
    }
    return pos;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_gguf(const GgufFile& gguf) {
  auto impl = std::make_unique<Impl>();
  const std::string where = gguf.name();
  const GgufValue* model = gguf.find("tokenizer.ggml.model");
  SPIN_CHECK(model != nullptr, "{}: no tokenizer in GGUF metadata (tokenizer.ggml.model missing)",
             where);
  SPIN_CHECK(model->as_string() == "gpt2",
             "{}: tokenizer.ggml.model '{}' is not supported (only 'gpt2', byte-level BPE)", where,
             model->as_string());
  const GgufValue* tokens_value = gguf.find("tokenizer.ggml.tokens");
  SPIN_CHECK(tokens_value != nullptr, "{}: tokenizer.ggml.tokens missing", where);
  const GgufArray& tokens = tokens_value->as_array();
  impl->set_vocab_size(static_cast<int64_t>(tokens.size()));
  for (size_t id = 0; id < tokens.size(); ++id) impl->set_token(static_cast<int64_t>(id), tokens[id].as_string());

  const GgufValue* merges_value = gguf.find("tokenizer.ggml.merges");
  SPIN_CHECK(merges_value != nullptr, "{}: tokenizer.ggml.merges missing (needed for BPE)", where);
  const GgufArray& merges = merges_value->as_array();
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& merge = merges[rank].as_string();
    size_t space = merge.find(' ', 1);
    SPIN_CHECK(space != std::string::npos, "{}: tokenizer merge {} '{}' is not 'left right'", where,
               rank, merge);
    impl->add_merge(std::string_view(merge).substr(0, space), std::string_view(merge).substr(space + 1),
                    static_cast<int32_t>(rank));
  }

  if (const GgufValue* types_value = gguf.find("tokenizer.ggml.token_type")) {
    const GgufArray& types = types_value->as_array();
    SPIN_CHECK(types.size() == tokens.size(),
               "{}: tokenizer.ggml.token_type has {} entries for {} tokens", where, types.size(),
               tokens.size());
    for (size_t id = 0; id < types.size(); ++id) {
      int64_t type = types[id].as_int();
      // 3 = control (special), 4 = user-defined: both are matched in text as added tokens.
      if (type == 3 || type == 4) {
        impl->add_added_token({tokens[id].as_string(), static_cast<int32_t>(id), type == 3, false, false});
      }
    }
  }

  // llama.cpp treats a missing pre-tokenizer name as "default".
  const GgufValue* pre = gguf.find("tokenizer.ggml.pre");
  impl->split_steps = split_steps_for_gguf_pre(pre ? pre->as_string() : "default", impl->ignore_merges);

  auto optional_id = [&](const char* key) -> int32_t {
    const GgufValue* v = gguf.find(key);
    if (v == nullptr) return -1;
    int64_t id = v->as_int();
    SPIN_CHECK(id >= 0 && id < static_cast<int64_t>(tokens.size()), "{}: {} = {} is out of range",
               where, key, id);
    return static_cast<int32_t>(id);
  };
  impl->bos = optional_id("tokenizer.ggml.bos_token_id");
  impl->eos = optional_id("tokenizer.ggml.eos_token_id");
  if (const GgufValue* v = gguf.find("tokenizer.ggml.add_bos_token")) impl->add_bos = v->as_bool();
  if (const GgufValue* v = gguf.find("tokenizer.chat_template")) impl->chat_template = v->as_string();
  impl->finish();
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_model_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SPIN_CHECK(fs::exists(path, ec), "model path '{}' does not exist", path);
  if (fs::is_directory(path, ec)) {
    fs::path json_path = fs::path(path) / "tokenizer.json";
    SPIN_CHECK(fs::exists(json_path, ec), "model directory '{}' has no tokenizer.json", path);
    return from_json_file(json_path.string());
  }
  if (fs::path(path).extension() == ".json") return from_json_file(path);
  return from_gguf(GgufFile(path));
}

Tokenizer Tokenizer::from_json_file(const std::string& path) {
  std::string config_text;
  std::filesystem::path config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) config_text = read_text_file(config_path.string());
  try {
    return from_json_string(read_text_file(path), config_text);
  } catch (const Error& e) {
    fail("{}: {}", path, e.what());
  }
}

Tokenizer Tokenizer::from_json_string(const std::string& tokenizer_json, const std::string& config_json) {
  auto impl = std::make_unique<Impl>();
  try {
    json doc = json::parse(tokenizer_json);
    const json& model = doc.at("model");
    std::string type = model.value("type", "BPE");
    SPIN_CHECK(type == "BPE", "model type '{}' is not supported (only byte-level BPE)", type);
    SPIN_CHECK(model.value("dropout", json()).is_null(), "BPE dropout is not supported");
    SPIN_CHECK(!model.value("byte_fallback", false), "BPE byte_fallback is not supported");
    SPIN_CHECK(model.value("continuing_subword_prefix", json()).is_null() &&
                   model.value("end_of_word_suffix", json()).is_null(),
               "BPE continuing_subword_prefix / end_of_word_suffix are not supported");
    const json& normalizer = doc.value("normalizer", json());
    if (!normalizer.is_null()) {
      std::string type = normalizer.value("type", "?");
      // Qwen2/3 declare NFC. spin does not normalize: text already in NFC (nearly all text)
      // tokenizes exactly as HF does; decomposed input may differ.
      SPIN_CHECK(type == "NFC", "normalizer '{}' is not supported (only none or NFC)", type);
      spdlog::debug("tokenizer.json declares an NFC normalizer; input is used as given");
    }
    const json& decoder = doc.value("decoder", json());
    SPIN_CHECK(decoder.is_null() || decoder.value("type", "") == "ByteLevel",
               "decoder '{}' is not supported (only ByteLevel)", decoder.value("type", "?"));
    SPIN_CHECK(model.contains("merges"), "BPE model has no merges");
    impl->ignore_merges = model.value("ignore_merges", false);

    const json& vocab = model.at("vocab");
    const json& added = doc.value("added_tokens", json::array());
    int64_t max_id = -1;
    for (const auto& [text, id] : vocab.items()) max_id = std::max<int64_t>(max_id, id.get<int64_t>());
    for (const auto& token : added) max_id = std::max<int64_t>(max_id, token.at("id").get<int64_t>());
    impl->set_vocab_size(max_id + 1);
    std::vector<uint8_t> seen(static_cast<size_t>(max_id + 1), 0);
    for (const auto& [text, id_value] : vocab.items()) {
      int64_t id = id_value.get<int64_t>();
      SPIN_CHECK(id >= 0, "negative token id {}", id);
      SPIN_CHECK(!seen[static_cast<size_t>(id)], "token id {} appears twice in the vocabulary", id);
      seen[static_cast<size_t>(id)] = 1;
      impl->set_token(id, text);
    }
    int32_t rank = 0;
    for (const auto& merge : model.at("merges")) {
      if (merge.is_string()) {
        const std::string& s = merge.get_ref<const std::string&>();
        size_t space = s.find(' ', 1);
        SPIN_CHECK(space != std::string::npos, "merge {} '{}' is not 'left right'", rank, s);
        impl->add_merge(std::string_view(s).substr(0, space), std::string_view(s).substr(space + 1), rank);
      } else {
        SPIN_CHECK(merge.is_array() && merge.size() == 2, "merge {} is not a pair", rank);
        impl->add_merge(merge[0].get<std::string>(), merge[1].get<std::string>(), rank);
      }
      ++rank;
    }
    for (const auto& token : added) {
      int64_t id = token.at("id").get<int64_t>();
      SPIN_CHECK(id >= 0, "negative added token id {}", id);
      std::string content = token.at("content").get<std::string>();
      SPIN_CHECK(!token.value("single_word", false),
                 "added token '{}' with single_word=true is not supported", content);
      if (!seen[static_cast<size_t>(id)]) impl->set_token(id, content);
      impl->add_added_token({content, static_cast<int32_t>(id), token.value("special", false),
                             token.value("lstrip", false), token.value("rstrip", false)});
    }
    add_json_pre_tokenizer(doc.value("pre_tokenizer", json()), impl->split_steps);

    // BOS that a TemplateProcessing post-processor puts first (Llama 3 does this).
    const json& post = doc.value("post_processor", json());
    auto template_bos = [&]() -> std::string {
      auto find_template = [](const json& p) -> const json* {
        if (p.is_object() && p.value("type", "") == "TemplateProcessing") return &p;
        if (p.is_object() && p.value("type", "") == "Sequence")
          for (const auto& child : p.at("processors"))
            if (child.value("type", "") == "TemplateProcessing") return &child;
        return nullptr;
      };
      const json* t = find_template(post);
      if (t == nullptr || !t->contains("single") || t->at("single").empty()) return {};
      const json& first = t->at("single").at(0);
      if (!first.contains("SpecialToken")) return {};
      return first.at("SpecialToken").at("id").get<std::string>();
    }();
    if (!template_bos.empty()) {
      impl->bos = impl->text_to_id.count(template_bos) ? impl->text_to_id.at(template_bos) : -1;
      impl->add_bos = impl->bos >= 0;
    }

    if (!config_json.empty()) {
      json config = json::parse(config_json);
      auto id_of = [&](const json& value) -> int32_t {
        std::string content = config_token_content(value);
        auto it = impl->text_to_id.find(content);
        return it == impl->text_to_id.end() ? -1 : it->second;
      };
      if (config.contains("bos_token")) impl->bos = id_of(config.at("bos_token"));
      if (config.contains("eos_token")) impl->eos = id_of(config.at("eos_token"));
      if (config.contains("add_bos_token") && config.at("add_bos_token").is_boolean())
        impl->add_bos = config.at("add_bos_token").get<bool>() && impl->bos >= 0;
      if (config.contains("chat_template")) {
        const json& t = config.at("chat_template");
        if (t.is_string()) {
          impl->chat_template = t.get<std::string>();
        } else if (t.is_array()) {
          // Named templates: use the one called "default".
          for (const auto& entry : t)
            if (entry.value("name", "") == "default") impl->chat_template = entry.value("template", "");
        }
      }
    }
  } catch (const json::exception& e) {
    fail("malformed tokenizer JSON: {}", e.what());
  }
  impl->finish();
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  return impl_->encode(text, parse_special);
}

std::vector<int32_t> Tokenizer::encode_prompt(std::string_view text, bool parse_special) const {
  std::vector<int32_t> ids = impl_->encode(text, parse_special);
  if (impl_->add_bos && impl_->bos >= 0 && (ids.empty() || ids.front() != impl_->bos))
    ids.insert(ids.begin(), impl_->bos);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  SPIN_CHECK(id >= 0 && id < vocab_size(), "token id {} is out of range (vocabulary has {})", id,
             vocab_size());
  return impl_->bytes[static_cast<size_t>(id)];
}

const std::string& Tokenizer::token_text(int32_t id) const {
  SPIN_CHECK(id >= 0 && id < vocab_size(), "token id {} is out of range (vocabulary has {})", id,
             vocab_size());
  return impl_->texts[static_cast<size_t>(id)];
}

int32_t Tokenizer::token_id(std::string_view vocab_text) const {
  auto it = impl_->text_to_id.find(std::string(vocab_text));
  return it == impl_->text_to_id.end() ? -1 : it->second;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->texts.size()); }
int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }
bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->special[static_cast<size_t>(id)] != 0;
}
const std::vector<int32_t>& Tokenizer::stop_ids() const { return impl_->stops; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_->token_bytes(id);
  // Emit every complete character; hold back a sequence cut short by the end of the buffer;
  // replace each maximal ill-formed subpart with U+FFFD (as Python's errors="replace" does).
  std::string out;
  size_t i = 0;
  size_t copied = 0;  // pending_[copied, i) is valid text not yet copied to out
  while (i < pending_.size()) {
    if (size_t len = utf8_sequence_length(pending_, i); len > 0) {
      i += len;
      continue;
    }
    auto [prefix, need] = utf8_maximal_prefix(pending_, i);
    if (need > 0 && prefix < need && i + prefix == pending_.size()) break;
    out.append(pending_, copied, i - copied);
    out += "\xEF\xBF\xBD";
    i += prefix;
    copied = i;
  }
  out.append(pending_, copied, i - copied);
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  if (!pending_.empty()) out = "\xEF\xBF\xBD";
  pending_.clear();
  return out;
}

}  // namespace spin
