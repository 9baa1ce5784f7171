#pragma once
// The OpenAI request/response shapes: parsing and validating request bodies into engine
// requests, and building response and stream-chunk bodies. No networking here.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/tokenizer.h"

namespace spin::server {

// A client-visible error: HTTP status plus the OpenAI error object's fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string message, std::string param = {},
           std::string code = {})
      : std::runtime_error(message), status(status), type(std::move(type)),
        param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string type;
  std::string param;
  std::string code;
};

// What an exception escaping a request handler becomes. The client's mistakes keep their status
// (ApiError; the engine's InvalidRequest is a 400), an engine that cannot take work is a 503, and
// anything else, spin::Error included, is the server's own failure: 500 server_error.
struct ErrorReply {
  int status = 500;
  std::string type;
  std::string message;
  std::string param;
  std::string code;
  bool server_fault() const { return status >= 500 && status != 503; }
};
ErrorReply error_reply(const std::exception_ptr& error);

// {"error": {"message", "type", "param", "code"}} (param/code null when empty).
nlohmann::ordered_json error_body(const std::string& message, const std::string& type,
                          const std::string& param = {}, const std::string& code = {});

// 400 invalid_request_error naming the parameter.
[[noreturn]] void bad_request(const std::string& param, const std::string& message);

enum class Endpoint { Completions, ChatCompletions };

constexpr int64_t kMaxChoices = 16;           // the most `n` one request may ask for
constexpr int64_t kMaxRequestChoices = 1024;  // the most prompts x `n` in one request
constexpr int64_t kMaxTopLogprobs = 20;  // the most alternatives per token

// One prompt of a request: its tokens and the tokens to generate for it (the default depends on
// its length).
struct ParsedPrompt {
  std::vector<int32_t> ids;
  int64_t max_tokens = 0;
  std::string echo;  // with 'echo': the prompt's text, as sent (token ids: decoded), before each completion
};

// What a completions or chat request asks for, validated.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::Completions;
  // One for chat; /v1/completions takes several. Choice k * n + j is prompt k's j-th.
  std::vector<ParsedPrompt> prompts;
  RequestParams params;  // every choice's, with each prompt's max_tokens
  bool max_tokens_given = false;
  int64_t n = 1;  // choices per prompt: n engine requests on it
  bool stream = false;
  bool include_usage = false;
  bool echo = false;  // completions: each choice's text starts with its prompt (logprobs too)
};

struct ApiContext {
  const Tokenizer* tokenizer = nullptr;      // null: prompts must be token ids, no chat
  const ChatTemplate* chat_template = nullptr;  // null: /v1/chat/completions refuses
  std::string model_name;
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;  // the model's: prompt token ids must be below it
  // Engine requests running and queued at once (--max-num-seqs, --max-waiting); each choice of
  // 'n' is one, so a larger 'n' could never be admitted. 0: no limit.
  int64_t max_running = 0;
  int64_t max_waiting = 0;
  std::vector<std::string> algorithms;
  AttentionSettings default_attention;  // the server's --sparse-algorithm / --sparse-budget
  // Throws spin::Error when the engine would refuse these settings (null: not checked here).
  std::function<void(const AttentionSettings&)> validate_attention;
};

// Parses the body text of a request; throws ApiError (400 for every mistake of the client, 404
// for another model's name).
ParsedRequest parse_request(Endpoint endpoint, const std::string& body, const ApiContext& ctx);

// Response bodies.
nlohmann::ordered_json usage_json(int64_t prompt_tokens, int64_t completion_tokens);
struct Choice {
  std::string text;
  std::string finish_reason;
  nlohmann::ordered_json logprobs;  // null unless asked for
};
nlohmann::ordered_json completion_body(Endpoint endpoint, const std::string& id, int64_t created,
                               const std::string& model, const std::vector<Choice>& choices,
                               int64_t prompt_tokens, int64_t completion_tokens);
// One stream chunk of choice `index` carrying `text` (chat: a content delta; role_only: the
// first chat chunk with the assistant role) and, when non-empty, a finish reason.
nlohmann::ordered_json chunk_body(Endpoint endpoint, const std::string& id, int64_t created,
                          const std::string& model, size_t index, const std::string& text,
                          const std::string& finish_reason, bool role_only = false,
                          const nlohmann::ordered_json& logprobs = nullptr);
// The logprobs object of a choice (chat: {"content": [...]}, completions: tokens,
// token_logprobs, top_logprobs, text_offset starting at text_offset).
nlohmann::ordered_json logprobs_json(Endpoint endpoint, const Tokenizer* tokenizer,
                             const std::vector<TokenLogprob>& entries, int64_t text_offset);
// With 'echo': the logprobs of a prompt of ids `prompt_ids` (its first token has none: null, as
// OpenAI's), entries for the rest, and offsets from 0 into the echoed text.
nlohmann::ordered_json echo_logprobs_json(const Tokenizer* tokenizer, std::span<const int32_t> prompt_ids,
                                          const std::vector<TokenLogprob>& entries);
// Completions' logprobs objects a and b as one (b's tokens after a's).
nlohmann::ordered_json join_logprobs(nlohmann::ordered_json a, const nlohmann::ordered_json& b);
// The final usage-only chunk of stream_options.include_usage.
nlohmann::ordered_json usage_chunk_body(Endpoint endpoint, const std::string& id, int64_t created,
                                const std::string& model, int64_t prompt_tokens,
                                int64_t completion_tokens);

}  // namespace spin::server
