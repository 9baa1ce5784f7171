// Tokenizer unit tests on small hand-built vocabularies (expected ids worked out by hand from
// the BPE rules), streaming decode across UTF-8 boundaries, chat templates and error cases.
// Agreement with HF tokenizers on a real vocabulary is tested in tests/python/test_tokenizer.py.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

namespace spin {
namespace {

using json = nlohmann::json;

// GPT-2's byte -> char table, written out here independently of the tokenizer.
std::string byte_char(int b) {
  bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      bool p = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
      n += p ? 0 : 1;
    }
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

// Ids 0..255 are the byte tokens (id == byte value); merges follow; then added tokens.
struct SmallVocab {
  json vocab = json::object();
  json merges = json::array();
  json added = json::array();
  int next_id = 256;
  SmallVocab() {
    for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  }
  int merge(const std::string& left, const std::string& right) {
    merges.push_back(left + " " + right);
    vocab[left + right] = next_id;
    return next_id++;
  }
  int add(const std::string& content, bool special) {
    added.push_back({{"id", next_id}, {"content", content}, {"special", special},
                     {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}});
    return next_id++;
  }
  json doc(json pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                 {"use_regex", true}}) const {
    return {{"added_tokens", added},
            {"normalizer", nullptr},
            {"pre_tokenizer", pre_tokenizer},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  }
};

TEST(Tokenizer, MergesApplyInRankOrder) {
  SmallVocab v;
  int bc = v.merge("b", "c");   // rank 0
  int ab = v.merge("a", "b");   // rank 1: loses to "b c" inside "abc"
  int abc = v.merge("a", "bc");  // rank 2
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{abc}));
  EXPECT_EQ(tok.encode("bcx"), (std::vector<int32_t>{bc, 'x'}));
  // "ab" alone merges by rank 1; a space starts a new GPT-2 pre-token ("Ġ" + "c").
  EXPECT_EQ(tok.encode("ab c"), (std::vector<int32_t>{ab, ' ', 'c'}));
}

TEST(Tokenizer, PreTokensAreMergedSeparately) {
  SmallVocab v;
  int ab = v.merge("a", "b");
  int space_a = v.merge(byte_char(' '), "a");
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  // GPT-2 split: "ab", " a", "b" ... " ab" would be one pre-token; merges "Ġ a" (rank 1) and
  // "a b" (rank 0) compete inside it and "a b" wins.
  EXPECT_EQ(tok.encode("ab ab"), (std::vector<int32_t>{ab, ' ', ab}));
  EXPECT_EQ(tok.encode(" a"), (std::vector<int32_t>{space_a}));
  // Digits split from letters; '!' run is its own piece.
  EXPECT_EQ(tok.encode("a1!!"), (std::vector<int32_t>{'a', '1', '!', '!'}));
}

TEST(Tokenizer, AddedTokensLongestMatchAndParseSpecial) {
  SmallVocab v;
  int short_tok = v.add("<x>", true);
  int long_tok = v.add("<x>y", true);
  int plain = v.add("zz", false);
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  EXPECT_EQ(tok.encode("<x>y<x>"), (std::vector<int32_t>{long_tok, short_tok}));
  EXPECT_EQ(tok.encode("azzb"), (std::vector<int32_t>{'a', plain, 'b'}));
  // Without parse_special, special tokens are plain text but non-special added ones still match.
  EXPECT_EQ(tok.encode("<x>zz", false), (std::vector<int32_t>{'<', 'x', '>', plain}));
  EXPECT_TRUE(tok.is_special(short_tok));
  EXPECT_FALSE(tok.is_special(plain));
  EXPECT_EQ(tok.decode(tok.encode("q<x>yzz")), "q<x>yzz");
}

TEST(Tokenizer, InvalidUtf8BecomesByteTokens) {
  SmallVocab v;
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  std::string bad = "a\xff\xe2\x82" "b\xed\xa0\x80";
  std::vector<int32_t> expected;
  for (unsigned char c : bad) expected.push_back(c);
  EXPECT_EQ(tok.encode(bad), expected);
  EXPECT_EQ(tok.decode(tok.encode(bad)), bad);
}

TEST(StreamDecoder, HoldsBackSplitCharacters) {
  SmallVocab v;
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600, one byte token per byte
  StreamDecoder dec(tok);
  EXPECT_EQ(dec.push('a'), "a");
  EXPECT_EQ(dec.push(0xF0), "");
  EXPECT_EQ(dec.push(0x9F), "");
  EXPECT_EQ(dec.push(0x98), "");
  EXPECT_EQ(dec.push(0x80), emoji);
  EXPECT_EQ(dec.push(0xC3), "");
  EXPECT_EQ(dec.push(0xA9), "\xC3\xA9");
  EXPECT_EQ(dec.flush(), "");
  // A stray continuation byte is replaced at once; a cut sequence becomes one U+FFFD at flush.
  EXPECT_EQ(dec.push(0x80), "\xEF\xBF\xBD");
  EXPECT_EQ(dec.push(0xE2), "");
  EXPECT_EQ(dec.push(0x82), "");
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");
  // An ill-formed prefix followed by ASCII: one U+FFFD for the prefix, then the letter.
  EXPECT_EQ(dec.push(0xE2), "");
  EXPECT_EQ(dec.push('z'), "\xEF\xBF\xBDz");
}

TEST(StreamDecoder, MatchesWholeDecodeOnMultiByteToken) {
  SmallVocab v;
  int half = v.merge(byte_char(0x9F), byte_char(0x98));  // a token holding the middle bytes
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  StreamDecoder dec(tok);
  std::string out;
  for (int32_t id : {0xF0, half, 0x80, int32_t{'!'}}) out += dec.push(id);
  out += dec.flush();
  EXPECT_EQ(out, "\xF0\x9F\x98\x80!");
}

TEST(ChatTemplate, ChatMLWithDefaultSystemFromSource) {
  SmallVocab v;
  v.add("<|im_start|>", true);
  v.add("<|im_end|>", true);
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  std::string source =
      "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
      "{{ '<|im_start|>system\\nDefault helper.<|im_end|>\\n' }}{% endif %}"
      "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}";
  ChatTemplate chat = ChatTemplate::detect(source, tok);
  EXPECT_EQ(chat.format(), ChatTemplate::Format::ChatML);
  EXPECT_EQ(chat.default_system(), "Default helper.");
  std::vector<ChatMessage> user_only{{"user", "Hi"}};
  EXPECT_EQ(chat.apply(user_only, true),
            "<|im_start|>system\nDefault helper.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  std::vector<ChatMessage> with_system{{"system", "S"}, {"user", "U"}};
  EXPECT_EQ(chat.apply(with_system, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
  // A template whose system text comes from the messages has no default.
  ChatTemplate plain = ChatTemplate::detect(
      "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>' }}", tok);
  EXPECT_EQ(plain.default_system(), "");
}

TEST(ChatTemplate, Llama3) {
  SmallVocab v;
  int bos = v.add("<|begin_of_text|>", true);
  v.add("<|start_header_id|>", true);
  v.add("<|end_header_id|>", true);
  int eot = v.add("<|eot_id|>", true);
  json config = {{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"},
                 {"add_bos_token", true}};
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump(), config.dump());
  ChatTemplate chat = ChatTemplate::detect(
      "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
      "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}",
      tok);
  EXPECT_EQ(chat.format(), ChatTemplate::Format::Llama3);
  std::vector<ChatMessage> messages{{"user", "  Hi \n"}};
  std::string prompt = chat.apply(messages, true);
  EXPECT_EQ(prompt,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  // BOS comes from the rendered text; encode_prompt adds no second one.
  std::vector<int32_t> ids = tok.encode_prompt(prompt);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], bos);
  EXPECT_NE(ids[1], bos);
  EXPECT_EQ(tok.encode_prompt("x"), (std::vector<int32_t>{bos, 'x'}));
  EXPECT_EQ(tok.stop_ids(), (std::vector<int32_t>{eot}));
}

TEST(ChatTemplate, UnknownTemplatesAreErrors) {
  SmallVocab v;
  v.add("<|im_start|>", true);
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  EXPECT_THROW(ChatTemplate::detect("", tok), Error);
  try {
    ChatTemplate::detect("[INST] {{ messages[0]['content'] }} [/INST]", tok);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown chat template"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("ChatML"), std::string::npos);
  }
  // ChatML source, but the vocabulary lacks <|im_end|>.
  EXPECT_THROW(ChatTemplate::detect("<|im_start|>{{ m }}<|im_end|>", tok), Error);
}

void expect_error_containing(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    FAIL() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, JsonErrors) {
  SmallVocab v;
  json doc = v.doc({{"type", "Metaspace"}});
  expect_error_containing([&] { Tokenizer::from_json_string(doc.dump()); }, "Metaspace");
  doc = v.doc();
  doc["model"].erase("merges");
  expect_error_containing([&] { Tokenizer::from_json_string(doc.dump()); }, "no merges");
  doc = v.doc();
  doc["model"]["merges"] = json::array({"a"});
  expect_error_containing([&] { Tokenizer::from_json_string(doc.dump()); }, "left right");
  expect_error_containing([&] { Tokenizer::from_json_string("{not json"); }, "malformed");
  doc = v.doc({{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}});
  expect_error_containing([&] { Tokenizer::from_json_string(doc.dump()); }, "does not compile");
  Tokenizer tok = Tokenizer::from_json_string(v.doc().dump());
  EXPECT_THROW(tok.decode(std::vector<int32_t>{-1}), Error);
  EXPECT_THROW(tok.token_text(1 << 20), Error);
}

// A GGUF v3 image with only tokenizer metadata (no tensors).
class GgufImage {
 public:
  void kv_string(const std::string& key, const std::string& value) {
    key_header(key, 8);
    str(value);
  }
  void kv_u32(const std::string& key, uint32_t value) {
    key_header(key, 4);
    pod(value);
  }
  void kv_strings(const std::string& key, const std::vector<std::string>& values) {
    key_header(key, 9);
    pod(uint32_t{8});
    pod(uint64_t{values.size()});
    for (const auto& s : values) str(s);
  }
  void kv_i32s(const std::string& key, const std::vector<int32_t>& values) {
    key_header(key, 9);
    pod(uint32_t{5});
    pod(uint64_t{values.size()});
    for (int32_t x : values) pod(x);
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out;
    auto put = [&](const void* p, size_t n) {
      out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    put("GGUF", 4);
    uint32_t version = 3;
    uint64_t n_tensors = 0;
    put(&version, 4);
    put(&n_tensors, 8);
    put(&n_kv_, 8);
    out.insert(out.end(), body_.begin(), body_.end());
    return out;
  }

 private:
  template <typename T>
  void pod(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    body_.insert(body_.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    pod(uint64_t{s.size()});
    body_.insert(body_.end(), s.begin(), s.end());
  }
  void key_header(const std::string& key, uint32_t type) {
    ++n_kv_;
    str(key);
    pod(type);
  }
  uint64_t n_kv_ = 0;
  std::vector<uint8_t> body_;
};

GgufImage gguf_tokenizer(const std::string& model, const std::string& pre, bool with_merges) {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int b = 0; b < 256; ++b) tokens.push_back(byte_char(b)), types.push_back(1);
  tokens.push_back("ab"), types.push_back(1);              // 256
  tokens.push_back("<|im_end|>"), types.push_back(3);      // 257, control
  tokens.push_back("<user>"), types.push_back(4);          // 258, user-defined
  GgufImage img;
  img.kv_string("tokenizer.ggml.model", model);
  img.kv_string("tokenizer.ggml.pre", pre);
  img.kv_strings("tokenizer.ggml.tokens", tokens);
  img.kv_i32s("tokenizer.ggml.token_type", types);
  if (with_merges) img.kv_strings("tokenizer.ggml.merges", {"a b"});
  img.kv_u32("tokenizer.ggml.eos_token_id", 257);
  return img;
}

TEST(Tokenizer, FromGgufMetadata) {
  std::vector<uint8_t> bytes = gguf_tokenizer("gpt2", "smollm", true).bytes();
  GgufFile gguf = GgufFile::from_memory(bytes.data(), bytes.size());
  Tokenizer tok = Tokenizer::from_gguf(gguf);
  EXPECT_EQ(tok.vocab_size(), 259);
  // smollm splits digits one by one; control and user-defined tokens are matched in text.
  EXPECT_EQ(tok.encode("ab12<|im_end|><user>"), (std::vector<int32_t>{256, '1', '2', 257, 258}));
  EXPECT_EQ(tok.encode("<|im_end|><user>", false).back(), 258);
  EXPECT_TRUE(tok.is_special(257));
  EXPECT_FALSE(tok.is_special(258));
  EXPECT_EQ(tok.eos_id(), 257);
  EXPECT_EQ(tok.stop_ids(), (std::vector<int32_t>{257}));
}

TEST(Tokenizer, GgufErrors) {
  auto load = [](const GgufImage& img) {
    std::vector<uint8_t> bytes = img.bytes();
    GgufFile gguf = GgufFile::from_memory(bytes.data(), bytes.size());
    Tokenizer::from_gguf(gguf);
  };
  expect_error_containing([&] { load(gguf_tokenizer("gpt2", "bogus-pre", true)); }, "bogus-pre");
  expect_error_containing([&] { load(gguf_tokenizer("llama", "default", true)); },
                          "tokenizer.ggml.model 'llama'");
  expect_error_containing([&] { load(gguf_tokenizer("gpt2", "default", false)); },
                          "tokenizer.ggml.merges missing");
}

}  // namespace
}  // namespace spin
