// libFuzzer target: OpenAI request bodies through server/openai_api's parse_request. The first
// input byte picks the endpoint (completions or chat) and whether the model has a tokenizer; the
// rest is the body. Parsing must either succeed with a request the engine can take (prompt within
// the context, max_tokens within the room left) or throw ApiError with a 4xx status; any other
// exception, or a crash, is a bug (the server would answer 500 or die).
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "model/tokenizer.h"
#include "server/openai_api.h"

namespace {

using json = nlohmann::json;

// A byte-level BPE vocabulary: the 256 byte symbols (GPT-2's byte-to-character map) and ChatML's
// special tokens.
std::string tokenizer_json() {
  json vocab = json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    int cp = b;
    if (!printable) {
      int n = 0;
      for (int x = 0; x < b; ++x) n += ((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255)) ? 0 : 1;
      cp = 256 + n;
    }
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[s] = next++;
  }
  json added = json::array();
  for (const char* content : {"<|im_start|>", "<|im_end|>"}) {
    added.push_back({{"id", next++}, {"content", content}, {"special", true}});
  }
  return json{{"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}}
      .dump();
}

struct Contexts {
  spin::Tokenizer tokenizer = spin::Tokenizer::from_json_string(tokenizer_json());
  spin::ChatTemplate chat = spin::ChatTemplate::detect("{{ '<|im_start|>' + message['role'] }}", tokenizer);
  spin::server::ApiContext with_tokenizer;
  spin::server::ApiContext ids_only;
  Contexts() {
    for (auto* ctx : {&with_tokenizer, &ids_only}) {
      ctx->model_name = "fuzz-model";
      ctx->max_model_len = 64;
      ctx->algorithms = {"dense", "quest"};
    }
    with_tokenizer.tokenizer = &tokenizer;
    with_tokenizer.chat_template = &chat;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Contexts contexts;
  if (size == 0) return 0;
  const auto endpoint = (data[0] & 1) ? spin::server::Endpoint::ChatCompletions : spin::server::Endpoint::Completions;
  const spin::server::ApiContext& ctx = (data[0] & 2) ? contexts.ids_only : contexts.with_tokenizer;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    const spin::server::ParsedRequest r = spin::server::parse_request(endpoint, body, ctx);
    const auto prompts = static_cast<int64_t>(r.prompts.size());
    if (prompts < 1 || r.n < 1 || r.n > spin::server::kMaxChoices ||
        prompts * r.n > spin::server::kMaxRequestChoices) {
      std::fprintf(stderr, "accepted an impossible request: %lld prompts, n %lld\n", static_cast<long long>(prompts),
                   static_cast<long long>(r.n));
      std::abort();
    }
    for (const spin::server::ParsedPrompt& p : r.prompts) {
      const auto n_prompt = static_cast<int64_t>(p.ids.size());
      if (n_prompt < 1 || n_prompt >= ctx.max_model_len || p.max_tokens < 1 ||
          n_prompt + p.max_tokens > ctx.max_model_len) {
        std::fprintf(stderr, "accepted an impossible prompt: %lld tokens, max_tokens %lld\n",
                     static_cast<long long>(n_prompt), static_cast<long long>(p.max_tokens));
        std::abort();
      }
    }
  } catch (const spin::server::ApiError& e) {
    if (e.status < 400 || e.status >= 500) {
      std::fprintf(stderr, "ApiError with status %d: %s\n", e.status, e.what());
      std::abort();
    }
  }
  return 0;
}
