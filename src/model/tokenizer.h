#pragma once
// Byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM2) read from GGUF metadata or tokenizer.json.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spin {

class GgufFile;

class Tokenizer {
 public:
  static Tokenizer from_gguf(const GgufFile& gguf);
  // tokenizer.json; tokenizer_config.json beside it (if present) supplies the chat template and
  // the bos/eos tokens.
  static Tokenizer from_json_file(const std::string& path);
  // A .gguf file (reads only its metadata), a tokenizer.json, or a directory holding one.
  static Tokenizer from_model_path(const std::string& path);
  // The same from in-memory JSON texts (config_json may be empty); used by the fuzzer and tests.
  static Tokenizer from_json_string(const std::string& tokenizer_json,
                                    const std::string& config_json = {});

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // parse_special: text that spells an added/special token (e.g. "<|im_start|>") becomes that
  // token; otherwise it is encoded as plain text. Never adds BOS (see add_bos()).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // encode() plus BOS in front when add_bos() and the text does not already start with it
  // (a chat template such as Llama 3's renders <|begin_of_text|> itself).
  std::vector<int32_t> encode_prompt(std::string_view text, bool parse_special = true) const;
  // Concatenated bytes of the tokens (may end inside a UTF-8 sequence; see StreamDecoder).
  std::string decode(std::span<const int32_t> ids) const;
  // The raw bytes one token stands for.
  std::string token_bytes(int32_t id) const;
  // The token's vocabulary string as stored (e.g. "Ġthe", "<|im_end|>").
  const std::string& token_text(int32_t id) const;
  int32_t token_id(std::string_view vocab_text) const;  // -1 if absent

  int32_t vocab_size() const;
  int32_t bos_id() const;    // -1 if none
  int32_t eos_id() const;    // -1 if none
  bool add_bos() const;      // the model expects BOS prepended to a prompt
  bool is_special(int32_t id) const;
  // Tokens that end generation: eos plus the end-of-turn tokens of the chat format
  // (<|im_end|>, <|eot_id|>, <|end_of_text|>, ...) that exist in the vocabulary.
  const std::vector<int32_t>& stop_ids() const;
  // The jinja chat template source from the model files, empty if none.
  const std::string& chat_template() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a token stream into text that only ever contains whole UTF-8 characters: bytes of a
// character split across tokens are held back until it is complete.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  std::string push(int32_t id);
  // Whatever is still held back (an incomplete sequence at the end is returned as U+FFFD).
  std::string flush();

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// The chat formats spin renders natively, chosen from the model's template source.
class ChatTemplate {
 public:
  enum class Format { ChatML, Llama3 };
  // Recognises the family from the jinja source (and the tokenizer's vocabulary); throws
  // spin::Error naming the problem for an unknown or empty template.
  static ChatTemplate detect(const std::string& jinja_source, const Tokenizer& tokenizer);
  // llama3_system_preamble: Llama 3.1+ templates always open with a system block that starts
  // with "Cutting Knowledge Date: ...\nToday Date: ...\n\n"; empty for Llama 3.0.
  explicit ChatTemplate(Format format, std::string default_system = {},
                        std::string llama3_system_preamble = {})
      : format_(format),
        default_system_(std::move(default_system)),
        llama3_system_preamble_(std::move(llama3_system_preamble)) {}

  // The system prompt the template inserts when the conversation has none (ChatML family).
  const std::string& default_system() const { return default_system_; }
  const std::string& llama3_system_preamble() const { return llama3_system_preamble_; }

  Format format() const { return format_; }
  // Renders the conversation; with add_generation_prompt, ends with the assistant header.
  // Llama 3: the text starts with "<|begin_of_text|>" as the jinja template renders it, so
  // encode it with parse_special and use Tokenizer::encode_prompt (which then adds no second
  // BOS). Message content is trimmed of surrounding whitespace, as Llama 3's template does.
  std::string apply(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

 private:
  Format format_;
  std::string default_system_;  // system prompt the template inserts when none is given
  std::string llama3_system_preamble_;
};

}  // namespace spin
