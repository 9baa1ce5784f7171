#include "server/openai_api.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "base/error.h"

namespace spin::server {

using nlohmann::json;
using ojson = nlohmann::ordered_json;  // responses keep their field order

ojson error_body(const std::string& message, const std::string& type, const std::string& param,
                const std::string& code) {
  return ojson{{"error",
               {{"message", message},
                {"type", type},
                {"param", param.empty() ? ojson(nullptr) : ojson(param)},
                {"code", code.empty() ? ojson(nullptr) : ojson(code)}}}};
}

void bad_request(const std::string& param, const std::string& message) {
  throw ApiError(400, "invalid_request_error", message, param);
}

ErrorReply error_reply(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const ApiError& e) {
    return {e.status, e.type, e.what(), e.param, e.code};
  } catch (const InvalidRequest& e) {
    return {400, "invalid_request_error", e.what(), {}, {}};
  } catch (const EngineUnavailable& e) {
    return {503, "service_unavailable", e.what(), {}, {}};
  } catch (const std::bad_alloc&) {
    return {503, "service_unavailable", "out of memory", {}, {}};
  } catch (const std::exception& e) {
    return {500, "server_error", e.what(), {}, {}};
  } catch (...) {
    return {500, "server_error", "unknown error", {}, {}};
  }
}

namespace {

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number with a fraction";
    default: return "an integer";
  }
}

// Field readers: absent or null gives nothing; a wrong type is a 400 naming the field.
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> get_number(const json& body, const char* name, const std::string& prefix = {}) {
  const std::string param = prefix + name;
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad_request(param, fmt::format("'{}' must be a number, got {}", param, type_name(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x)) bad_request(param, fmt::format("'{}' must be finite", param));
  return x;
}

std::optional<int64_t> get_int(const json& body, const char* name, const std::string& prefix = {}) {
  const std::string param = prefix + name;
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      bad_request(param, fmt::format("'{}' is too large: {}", param, u));
    }
    return static_cast<int64_t>(u);
  }
  if (!v->is_number_integer()) {
    bad_request(param, fmt::format("'{}' must be an integer, got {}", param, type_name(*v)));
  }
  return v->get<int64_t>();
}

std::optional<bool> get_bool(const json& body, const char* name, const std::string& prefix = {}) {
  const std::string param = prefix + name;
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad_request(param, fmt::format("'{}' must be a boolean, got {}", param, type_name(*v)));
  return v->get<bool>();
}

std::optional<std::string> get_string(const json& body, const char* name, const std::string& prefix = {}) {
  const std::string param = prefix + name;
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) bad_request(param, fmt::format("'{}' must be a string, got {}", param, type_name(*v)));
  return v->get<std::string>();
}

// Token ids a request may name: ids past the tokenizer's vocabulary (padding rows of the model's)
// have no text.
int64_t sampleable_vocab(const ApiContext& ctx) {
  return ctx.tokenizer ? std::min<int64_t>(ctx.tokenizer->vocab_size(), ctx.vocab_size) : ctx.vocab_size;
}

// Tokenizes prompt text; text the tokenizer refuses is the client's to fix.
std::vector<int32_t> encode_text(const ApiContext& ctx, const std::string& text, const std::string& param) {
  if (!ctx.tokenizer) bad_request(param, "this model has no tokenizer: send the prompt as token ids");
  try {
    return ctx.tokenizer->encode_prompt(text, true);
  } catch (const Error& e) {
    bad_request(param, fmt::format("the prompt cannot be tokenized: {}", e.what()));
  }
}

std::vector<int32_t> token_id_array(const json& array, const char* param) {
  std::vector<int32_t> ids;
  ids.reserve(array.size());
  for (const json& x : array) {
    if (!x.is_number_integer()) bad_request(param, fmt::format("'{}' token ids must be integers", param));
    const int64_t id = x.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      bad_request(param, fmt::format("'{}' has token id {} outside the vocabulary", param, id));
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// "prompt": a string, an array of token ids, or an array of either (one prompt each). With `echo`
// each keeps its text: a string as sent, token ids decoded (when there is a tokenizer).
std::vector<ParsedPrompt> completion_prompts(const json& body, const ApiContext& ctx, bool echo) {
  const json* p = field(body, "prompt");
  if (!p) bad_request("prompt", "'prompt' is required");
  const auto text = [&](const json& prompt, const std::string& param) {
    const std::string& s = prompt.get_ref<const std::string&>();
    return ParsedPrompt{encode_text(ctx, s, param), 0, echo ? s : ""};
  };
  const auto ids = [&](const json& prompt, const std::string& param) {
    ParsedPrompt parsed{token_id_array(prompt, param.c_str()), 0, ""};
    if (echo && ctx.tokenizer) parsed.echo = ctx.tokenizer->decode(parsed.ids);
    return parsed;
  };
  if (p->is_string()) return {text(*p, "prompt")};
  if (!p->is_array()) bad_request("prompt", fmt::format("'prompt' must be a string or an array, got {}", type_name(*p)));
  if (p->empty()) bad_request("prompt", "'prompt' is empty");
  if ((*p)[0].is_number_integer()) return {ids(*p, "prompt")};
  std::vector<ParsedPrompt> prompts;
  for (size_t k = 0; k < p->size(); ++k) {
    const json& one = (*p)[k];
    const std::string param = fmt::format("prompt[{}]", k);
    if (one.is_string()) {
      prompts.push_back(text(one, param));
    } else if (one.is_array()) {
      prompts.push_back(ids(one, param));
    } else {
      bad_request("prompt", fmt::format("'prompt' elements must be strings or token-id arrays, got {}", type_name(one)));
    }
  }
  return prompts;
}

std::string message_content(const json& content, size_t index) {
  const std::string param = fmt::format("messages[{}].content", index);
  if (content.is_null()) return {};
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad_request(param, fmt::format("'{}' must be a string or an array of text parts", param));
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      bad_request(param, fmt::format("'{}' parts must be {{\"type\": \"text\", \"text\": \"...\"}} (other part types are not supported)", param));
    }
    text += part["text"].get<std::string>();
  }
  return text;
}

std::vector<int32_t> chat_prompt(const json& body, const ApiContext& ctx) {
  if (!ctx.tokenizer || !ctx.chat_template) {
    bad_request("messages", "this model has no chat template: use /v1/completions");
  }
  const json* m = field(body, "messages");
  if (!m) bad_request("messages", "'messages' is required");
  if (!m->is_array()) bad_request("messages", fmt::format("'messages' must be an array, got {}", type_name(*m)));
  if (m->empty()) bad_request("messages", "'messages' is empty");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!msg.is_object()) bad_request(param, fmt::format("'{}' must be an object", param));
    auto role = msg.find("role");
    if (role == msg.end() || !role->is_string()) bad_request(param + ".role", fmt::format("'{}.role' must be a string", param));
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";
    if (r != "system" && r != "user" && r != "assistant") {
      bad_request(param + ".role", fmt::format("'{}.role' must be system, user or assistant, got '{}'", param, r));
    }
    auto content = msg.find("content");
    messages.push_back({r, message_content(content == msg.end() ? json() : *content, i)});
  }
  std::string rendered;
  try {
    rendered = ctx.chat_template->apply(messages, true);
  } catch (const Error& e) {
    bad_request("messages", fmt::format("the messages do not fit the chat template: {}", e.what()));
  }
  return encode_text(ctx, rendered, "messages");
}

std::vector<std::string> stop_strings(const json& body) {
  const json* s = field(body, "stop");
  if (!s) return {};
  if (s->is_string()) return {s->get<std::string>()};
  if (!s->is_array()) bad_request("stop", fmt::format("'stop' must be a string or an array of strings, got {}", type_name(*s)));
  std::vector<std::string> out;
  for (const json& x : *s) {
    if (!x.is_string()) bad_request("stop", "'stop' must be a string or an array of strings");
    if (!x.get<std::string>().empty()) out.push_back(x.get<std::string>());
  }
  return out;
}

void refuse_unsupported(const json& body, Endpoint endpoint) {
  if (auto b = get_int(body, "best_of"); b && *b != 1) {
    bad_request("best_of", "best_of is not supported");
  }
  if (auto echo = get_bool(body, "echo"); echo && *echo && endpoint == Endpoint::ChatCompletions) {
    bad_request("echo", "'echo' is for /v1/completions");
  }
  if (field(body, "suffix")) bad_request("suffix", "'suffix' is not supported");
  if (endpoint == Endpoint::ChatCompletions) {
    if (field(body, "tools") && !body["tools"].empty()) bad_request("tools", "tools are not supported");
    if (const json* rf = field(body, "response_format")) {
      if (!rf->is_object() || rf->value("type", json()) != "text") {
        bad_request("response_format", "only response_format {\"type\": \"text\"} is supported");
      }
    }
  }
}

// The "spin" extension object: per-request sparse attention and ignore_eos.
void parse_extension(const json& ext, const ApiContext& ctx, RequestParams& p) {
  if (!ext.is_object()) bad_request("spin", fmt::format("'spin' must be an object, got {}", type_name(ext)));
  static const std::vector<std::string> known = {"algorithm",     "budget",             "sink_tokens",
                                                 "window_tokens", "first_dense_layers", "ignore_eos"};
  for (const auto& [key, value] : ext.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      bad_request("spin." + key, fmt::format("unknown field 'spin.{}' (known: {})", key, fmt::join(known, ", ")));
    }
  }
  if (auto algorithm = get_string(ext, "algorithm", "spin.")) {
    if (std::find(ctx.algorithms.begin(), ctx.algorithms.end(), *algorithm) == ctx.algorithms.end()) {
      bad_request("spin.algorithm", fmt::format("unknown attention algorithm '{}' (known: {})", *algorithm,
                                                fmt::join(ctx.algorithms, ", ")));
    }
    p.attention.algorithm = *algorithm;
  }
  // "budget": tokens per KV head (an integer >= 1) or a fraction of the context (a number in (0, 1]).
  if (const json* budget = field(ext, "budget")) {
    if (budget->is_number_integer() || budget->is_number_unsigned()) {
      const int64_t tokens = *get_int(ext, "budget", "spin.");
      if (tokens < 1 || tokens > std::numeric_limits<uint32_t>::max()) {
        bad_request("spin.budget", fmt::format("'spin.budget' in tokens must be in 1..{}, got {}",
                                               std::numeric_limits<uint32_t>::max(), tokens));
      }
      p.attention.budget = tokens;
      p.attention.budget_fraction = 0.0;
    } else {
      const double fraction = *get_number(ext, "budget", "spin.");
      if (!(fraction > 0.0 && fraction <= 1.0)) {
        bad_request("spin.budget", fmt::format("'spin.budget' as a fraction of the context must be in (0, 1], got {}",
                                               fraction));
      }
      p.attention.budget_fraction = fraction;
    }
  }
  auto tokens_field = [&](const char* name, std::optional<int64_t>& out) {
    if (auto v = get_int(ext, name, "spin.")) {
      if (*v < 0 || *v > std::numeric_limits<int32_t>::max()) {
        bad_request(std::string("spin.") + name, fmt::format("'spin.{}' must be in 0..{}, got {}", name,
                                                             std::numeric_limits<int32_t>::max(), *v));
      }
      out = *v;
    }
  };
  tokens_field("sink_tokens", p.attention.sink_tokens);
  tokens_field("window_tokens", p.attention.window_tokens);
  tokens_field("first_dense_layers", p.attention.first_dense_layers);
  if (auto ignore = get_bool(ext, "ignore_eos", "spin.")) p.ignore_eos = *ignore;
  if (ctx.validate_attention) {
    try {
      ctx.validate_attention(p.attention);
    } catch (const Error& e) {
      bad_request("spin", fmt::format("the attention settings are refused: {}", e.what()));
    }
  }
}

}  // namespace

ParsedRequest parse_request(Endpoint endpoint, const std::string& body_text, const ApiContext& ctx) {
  json body = json::parse(body_text, nullptr, false);
  if (body.is_discarded()) bad_request("", "the request body is not valid JSON");
  if (!body.is_object()) bad_request("", "the request body must be a JSON object");

  if (auto model = get_string(body, "model"); model && *model != ctx.model_name) {
    throw ApiError(404, "not_found_error",
                   fmt::format("the model '{}' does not exist; this server serves '{}'", *model, ctx.model_name),
                   "model", "model_not_found");
  }
  refuse_unsupported(body, endpoint);

  ParsedRequest r;
  r.endpoint = endpoint;
  RequestParams& p = r.params;
  SamplingParams& s = p.sampling;
  if (auto t = get_number(body, "temperature")) {
    if (*t < 0 || *t > 2) bad_request("temperature", fmt::format("'temperature' must be in [0, 2], got {}", *t));
    s.temperature = static_cast<float>(*t);
  }
  if (auto x = get_number(body, "top_p")) {
    if (*x <= 0 || *x > 1) bad_request("top_p", fmt::format("'top_p' must be in (0, 1], got {}", *x));
    s.top_p = static_cast<float>(*x);
  }
  if (auto k = get_int(body, "top_k")) {
    if (*k < -1 || *k > std::numeric_limits<int32_t>::max()) {
      bad_request("top_k", fmt::format("'top_k' must be -1 or 0 (off) or positive, got {}", *k));
    }
    s.top_k = *k < 0 ? 0 : static_cast<int>(*k);
  }
  if (auto x = get_number(body, "min_p")) {
    if (*x < 0 || *x > 1) bad_request("min_p", fmt::format("'min_p' must be in [0, 1], got {}", *x));
    s.min_p = static_cast<float>(*x);
  }
  for (auto [name, value] : {std::pair{"presence_penalty", &s.presence_penalty},
                              std::pair{"frequency_penalty", &s.frequency_penalty}}) {
    if (auto x = get_number(body, name)) {
      if (*x < -2 || *x > 2) bad_request(name, fmt::format("'{}' must be in [-2, 2], got {}", name, *x));
      *value = static_cast<float>(*x);
    }
  }
  if (const json* bias = field(body, "logit_bias")) {
    const int64_t vocab = sampleable_vocab(ctx);
    if (!bias->is_object()) bad_request("logit_bias", fmt::format("'logit_bias' must be an object, got {}", type_name(*bias)));
    for (const auto& [key, value] : bias->items()) {
      int64_t id = -1;
      // Canonical ids only ("07" and "7" would bias token 7 twice): the key must print back as itself.
      if (std::from_chars(key.data(), key.data() + key.size(), id).ec != std::errc() || id < 0 || id >= vocab ||
          std::to_string(id) != key) {
        bad_request("logit_bias", fmt::format("'logit_bias' keys must be token ids in 0..{}, got '{}'", vocab - 1, key));
      }
      if (!value.is_number() || value.get<double>() < -100 || value.get<double>() > 100) {
        bad_request("logit_bias", fmt::format("'logit_bias' values must be numbers in [-100, 100], got {} for token {}",
                                              value.dump(), key));
      }
      s.logit_bias.emplace_back(static_cast<int32_t>(id), value.get<float>());
    }
  }
  // vLLM's extra parameter (not OpenAI's).
  if (auto x = get_number(body, "repetition_penalty")) {
    if (!(*x > 0 && *x <= 10))
      bad_request("repetition_penalty", fmt::format("'repetition_penalty' must be in (0, 10] (1: off), got {}", *x));
    s.repetition_penalty = static_cast<float>(*x);
  }
  if (auto seed = get_int(body, "seed")) s.seed = static_cast<uint64_t>(*seed);
  p.stop = stop_strings(body);
  if (auto ignore = get_bool(body, "ignore_eos")) p.ignore_eos = *ignore;

  std::optional<int64_t> max_tokens = get_int(body, "max_tokens");
  const char* max_param = "max_tokens";
  if (endpoint == Endpoint::ChatCompletions) {
    if (auto m = get_int(body, "max_completion_tokens")) {
      max_tokens = m;
      max_param = "max_completion_tokens";
    }
  }
  // 'echo' with max_tokens 0 scores the prompt alone (its logprobs), as OpenAI's legacy API did.
  r.echo = endpoint == Endpoint::Completions && get_bool(body, "echo").value_or(false);
  if (max_tokens && *max_tokens < (r.echo ? 0 : 1)) {
    bad_request(max_param, r.echo ? fmt::format("'{}' must be at least 0, got {}", max_param, *max_tokens)
                                  : fmt::format("'{}' must be at least 1 (0 only with 'echo'), got {}", max_param,
                                                *max_tokens));
  }

  // Completions: "logprobs": N alternatives. Chat: "logprobs": true and "top_logprobs": N.
  if (endpoint == Endpoint::Completions) {
    if (auto lp = get_int(body, "logprobs")) {
      if (*lp < 0 || *lp > kMaxTopLogprobs) {
        bad_request("logprobs", fmt::format("'logprobs' must be in 0..{}, got {}", kMaxTopLogprobs, *lp));
      }
      p.top_logprobs = static_cast<int>(*lp);
    }
  } else {
    const bool wanted = get_bool(body, "logprobs").value_or(false);
    if (auto top = get_int(body, "top_logprobs")) {
      if (!wanted) bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
      if (*top < 0 || *top > kMaxTopLogprobs) {
        bad_request("top_logprobs", fmt::format("'top_logprobs' must be in 0..{}, got {}", kMaxTopLogprobs, *top));
      }
      p.top_logprobs = static_cast<int>(*top);
    } else if (wanted) {
      p.top_logprobs = 0;
    }
  }
  if (auto n = get_int(body, "n")) {
    if (*n < 1 || *n > kMaxChoices) bad_request("n", fmt::format("'n' must be in 1..{}, got {}", kMaxChoices, *n));
    r.n = *n;
  }
  r.stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_request("stream_options", "'stream_options' must be an object");
    if (!r.stream) bad_request("stream_options", "'stream_options' is only allowed with stream: true");
    r.include_usage = get_bool(*so, "include_usage", "stream_options.").value_or(false);
  }

  p.attention = ctx.default_attention;
  if (const json* ext = field(body, "spin")) parse_extension(*ext, ctx, p);

  const bool chat = endpoint == Endpoint::ChatCompletions;
  std::vector<ParsedPrompt> prompts;
  if (chat) {
    prompts.push_back(ParsedPrompt{chat_prompt(body, ctx), 0, ""});
  } else {
    prompts = completion_prompts(body, ctx, r.echo);
  }
  // Each choice is one engine request: a request the server could never hold all of is refused.
  const int64_t choices = static_cast<int64_t>(prompts.size()) * r.n;
  const int64_t capacity = ctx.max_running + ctx.max_waiting;
  if (choices > kMaxRequestChoices || (capacity > 0 && choices > capacity)) {
    const int64_t most = capacity > 0 ? std::min<int64_t>(kMaxRequestChoices, capacity) : kMaxRequestChoices;
    bad_request(r.n > 1 ? "n" : "prompt",
                fmt::format("{} prompts x 'n' {} is {} choices, but this server takes at most {} in one request "
                            "({} running, {} waiting at once)",
                            prompts.size(), r.n, choices, most, ctx.max_running, ctx.max_waiting));
  }
  r.max_tokens_given = max_tokens.has_value();
  const int64_t vocab = sampleable_vocab(ctx);
  for (size_t k = 0; k < prompts.size(); ++k) {
    const std::string prompt_param = chat ? "messages" : prompts.size() > 1 ? fmt::format("prompt[{}]", k) : "prompt";
    ParsedPrompt& prompt = prompts[k];
    const int64_t n_prompt = static_cast<int64_t>(prompt.ids.size());
    if (n_prompt == 0) bad_request(prompt_param, "the prompt is empty");
    if (n_prompt >= ctx.max_model_len) {
      throw ApiError(400, "invalid_request_error",
                     fmt::format("the prompt has {} tokens but this model's context length is {} "
                                 "(the prompt must leave room for at least one generated token)",
                                 n_prompt, ctx.max_model_len),
                     prompt_param, "context_length_exceeded");
    }
    const int64_t room = ctx.max_model_len - n_prompt;
    if (max_tokens && *max_tokens > room) {
      throw ApiError(400, "invalid_request_error",
                     fmt::format("the prompt has {} tokens and {} is {}: {} in all, past this model's "
                                 "context length of {} tokens",
                                 n_prompt, max_param, *max_tokens, n_prompt + *max_tokens, ctx.max_model_len),
                     max_param, "context_length_exceeded");
    }
    for (int32_t id : prompt.ids) {
      if (id >= vocab) {
        bad_request(prompt_param, fmt::format("token id {} is outside the vocabulary (0..{})", id, vocab - 1));
      }
    }
    // Defaults: 16 for completions (as OpenAI's), the rest of the context for chat.
    prompt.max_tokens = max_tokens ? *max_tokens : (chat ? room : std::min<int64_t>(16, room));
    r.prompts.push_back(std::move(prompt));
  }
  // Echo with logprobs scores the prompt's tokens too; with max_tokens 0 the engine runs the
  // prefill for them alone.
  if (r.echo && (p.top_logprobs >= 0 || (max_tokens && *max_tokens == 0))) p.prompt_logprobs = std::max(p.top_logprobs, 0);
  return r;
}

ojson usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return ojson{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

ojson completion_body(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                     const std::vector<Choice>& choices, int64_t prompt_tokens, int64_t completion_tokens) {
  ojson list = ojson::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    ojson choice{{"index", i}, {"logprobs", choices[i].logprobs}, {"finish_reason", choices[i].finish_reason}};
    if (endpoint == Endpoint::ChatCompletions) {
      choice["message"] = ojson{{"role", "assistant"}, {"content", choices[i].text}};
    } else {
      choice["text"] = choices[i].text;
    }
    list.push_back(std::move(choice));
  }
  return ojson{{"id", id},
              {"object", endpoint == Endpoint::ChatCompletions ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", std::move(list)},
              {"usage", usage_json(prompt_tokens, completion_tokens)}};
}

ojson chunk_body(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                size_t index, const std::string& text, const std::string& finish_reason, bool role_only,
                const ojson& logprobs) {
  ojson choice{{"index", index}, {"logprobs", logprobs},
              {"finish_reason", finish_reason.empty() ? ojson(nullptr) : ojson(finish_reason)}};
  if (endpoint == Endpoint::ChatCompletions) {
    ojson delta = ojson::object();
    if (role_only) {
      delta = ojson{{"role", "assistant"}, {"content", ""}};
    } else if (!text.empty()) {
      delta["content"] = text;
    }
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  return ojson{{"id", id},
              {"object", endpoint == Endpoint::ChatCompletions ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", ojson::array({choice})}};
}

namespace {

// A token as logprobs show it: its bytes, or <id> without a tokenizer.
std::string token_text(const Tokenizer* tokenizer, int32_t id) {
  return tokenizer ? tokenizer->token_bytes(id) : fmt::format("<{}>", id);
}

}  // namespace

ojson logprobs_json(Endpoint endpoint, const Tokenizer* tokenizer, const std::vector<TokenLogprob>& entries,
                   int64_t text_offset) {
  if (endpoint == Endpoint::ChatCompletions) {
    auto item = [&](int32_t id, float logprob) {
      const std::string b = token_text(tokenizer, id);
      std::vector<int> byte_values;
      for (unsigned char c : b) byte_values.push_back(c);
      return ojson{{"token", b}, {"logprob", logprob}, {"bytes", byte_values}};
    };
    ojson content = ojson::array();
    for (const TokenLogprob& e : entries) {
      ojson entry = item(e.id, e.logprob);
      entry["top_logprobs"] = ojson::array();
      for (const auto& [id, lp] : e.top) entry["top_logprobs"].push_back(item(id, lp));
      content.push_back(std::move(entry));
    }
    return ojson{{"content", std::move(content)}};
  }
  ojson tokens = ojson::array(), token_logprobs = ojson::array(), top = ojson::array(), offsets = ojson::array();
  for (const TokenLogprob& e : entries) {
    const std::string b = token_text(tokenizer, e.id);
    tokens.push_back(b);
    token_logprobs.push_back(e.logprob);
    ojson alternatives = ojson::object();
    for (const auto& [id, lp] : e.top) alternatives[token_text(tokenizer, id)] = lp;
    top.push_back(std::move(alternatives));
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(b.size());
  }
  return ojson{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top},
              {"text_offset", offsets}};
}

ojson echo_logprobs_json(const Tokenizer* tokenizer, std::span<const int32_t> prompt_ids,
                         const std::vector<TokenLogprob>& entries) {
  if (prompt_ids.empty()) return logprobs_json(Endpoint::Completions, tokenizer, entries, 0);
  const std::string first = token_text(tokenizer, prompt_ids[0]);
  const ojson head{{"tokens", ojson::array({first})},
                   {"token_logprobs", ojson::array({nullptr})},
                   {"top_logprobs", ojson::array({nullptr})},
                   {"text_offset", ojson::array({0})}};
  return join_logprobs(head, logprobs_json(Endpoint::Completions, tokenizer, entries,
                                           static_cast<int64_t>(first.size())));
}

ojson join_logprobs(ojson a, const ojson& b) {
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
    for (const ojson& x : b[key]) a[key].push_back(x);
  }
  return a;
}

ojson usage_chunk_body(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                      int64_t prompt_tokens, int64_t completion_tokens) {
  return ojson{{"id", id},
              {"object", endpoint == Endpoint::ChatCompletions ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", ojson::array()},
              {"usage", usage_json(prompt_tokens, completion_tokens)}};
}

}  // namespace spin::server
