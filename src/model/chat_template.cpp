// Native rendering of the chat formats spin supports. The family is recognised from the jinja
// source; the only template-specific text taken from it is ChatML's default system prompt.
#include <ctime>
#include <string>

#include "base/error.h"
#include "model/tokenizer.h"

namespace spin {
namespace {

constexpr const char* kSupported =
    "supported: ChatML (<|im_start|>role ... <|im_end|>, e.g. SmolLM2, Qwen) and Llama 3 "
    "(<|start_header_id|>role<|end_header_id|> ... <|eot_id|>)";

// Jinja string-literal escapes that templates use.
std::string unescape_jinja(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      char c = s[++i];
      out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// A ChatML template that inserts a fixed system message spells it as one literal
// '<|im_start|>system\n<text><|im_end|>'. Returns <text>, or empty if there is none.
std::string extract_chatml_default_system(const std::string& source) {
  const std::string head = "<|im_start|>system";
  for (size_t at = source.find(head); at != std::string::npos; at = source.find(head, at + 1)) {
    size_t end = source.find("<|im_end|>", at);
    if (end == std::string::npos) break;
    std::string body = unescape_jinja(std::string_view(source).substr(at + head.size(), end - at - head.size()));
    if (body.size() < 2 || body[0] != '\n') continue;
    body.erase(0, 1);
    // Anything that leaves the literal (a quote, an expression, a tag) means it is not fixed text.
    if (body.find_first_of("'\"{}") != std::string::npos) continue;
    return body;
  }
  return {};
}

// Llama 3.1+ templates open with a system block holding a knowledge-cutoff line and today's
// date. The cutoff line is read from the source; the date is the template's fixed fallback
// literal (`date_string = "..."`) unless the template asks for strftime_now, which HF
// transformers supplies as the current date.
std::string extract_llama3_preamble(const std::string& source) {
  const std::string cutoff_key = "Cutting Knowledge Date:";
  size_t at = source.find(cutoff_key);
  if (at == std::string::npos) return {};
  size_t end = source.find_first_of("\\\n'\"", at);
  std::string cutoff = source.substr(at, end == std::string::npos ? std::string::npos : end - at);
  std::string date;
  bool uses_clock = source.find("strftime_now") != std::string::npos;
  const std::string date_key = "date_string = \"";
  size_t d = source.find(date_key);
  if (d != std::string::npos) {
    size_t close = source.find('"', d + date_key.size());
    if (close != std::string::npos) date = source.substr(d + date_key.size(), close - d - date_key.size());
  }
  if (uses_clock || date.empty()) {
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buffer[32];
    std::strftime(buffer, sizeof(buffer), "%d %b %Y", &local);
    date = buffer;
  }
  return cutoff + "\nToday Date: " + date + "\n\n";
}

std::string_view trim(std::string_view s) {
  const char* ws = " \t\n\r\v\f";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

void require_tokens(const Tokenizer& tokenizer, const char* family,
                    std::initializer_list<const char*> names) {
  for (const char* name : names) {
    SPIN_CHECK(tokenizer.token_id(name) >= 0,
               "chat template looks like {} but the vocabulary has no '{}' token", family, name);
  }
}

}  // namespace

ChatTemplate ChatTemplate::detect(const std::string& jinja_source, const Tokenizer& tokenizer) {
  SPIN_CHECK(!jinja_source.empty(), "unknown chat template: the model has none ({})", kSupported);
  if (jinja_source.find("<|start_header_id|>") != std::string::npos &&
      jinja_source.find("<|eot_id|>") != std::string::npos) {
    require_tokens(tokenizer, "Llama 3",
                   {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});
    return ChatTemplate(Format::Llama3, {}, extract_llama3_preamble(jinja_source));
  }
  if (jinja_source.find("<|im_start|>") != std::string::npos) {
    require_tokens(tokenizer, "ChatML", {"<|im_start|>", "<|im_end|>"});
    return ChatTemplate(Format::ChatML, extract_chatml_default_system(jinja_source));
  }
  std::string excerpt = jinja_source.substr(0, 80);
  fail("unknown chat template starting '{}' ({})", excerpt, kSupported);
}

std::string ChatTemplate::apply(std::span<const ChatMessage> messages,
                                bool add_generation_prompt) const {
  std::string out;
  if (format_ == Format::ChatML) {
    if (!messages.empty() && messages.front().role != "system" && !default_system_.empty())
      out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
    for (const ChatMessage& m : messages)
      out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
  out += "<|begin_of_text|>";
  if (!llama3_system_preamble_.empty()) {
    // Llama 3.1+: the system block is always there; a leading system message fills it.
    bool has_system = !messages.empty() && messages.front().role == "system";
    out += "<|start_header_id|>system<|end_header_id|>\n\n" + llama3_system_preamble_;
    if (has_system) out += trim(messages.front().content);
    out += "<|eot_id|>";
    if (has_system) messages = messages.subspan(1);
  }
  for (const ChatMessage& m : messages) {
    out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n";
    out += trim(m.content);
    out += "<|eot_id|>";
  }
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

}  // namespace spin
