// `spin tokenize`: text -> token ids (and ids -> text), reading only the tokenizer of a model.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/token_ids.h"
#include "model/tokenizer.h"

namespace spin::cli {
namespace {

using json = nlohmann::json;

struct TokenizeArgs {
  std::string model;
  std::string text;
  std::string file;
  std::string decode;
  std::string jsonl_in;
  std::string decode_jsonl;
  std::string chat_json;
  bool json_output = false;
  bool no_special = false;
};

// Opens an input file; pipes and devices such as /dev/stdin are fine.
std::ifstream open_input(const std::string& path) {
  // On Linux an ifstream opens a directory without error and then reads nothing.
  std::error_code ec;
  SPIN_CHECK(!std::filesystem::is_directory(path, ec), "'{}' is a directory, not a file", path);
  std::ifstream in(path, std::ios::binary);
  SPIN_CHECK(in, "cannot open '{}'", path);
  return in;
}

std::string read_file(const std::string& path) {
  std::ifstream in = open_input(path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void print_ids(const std::vector<int32_t>& ids, bool as_json) {
  if (as_json) {
    std::cout << json(ids).dump() << "\n";
    return;
  }
  for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
  std::cout << "\n";
}

// Each line of `path` is a JSON value; calls fn on it (1-based line number for messages).
template <typename Fn>
void for_each_json_line(const std::string& path, Fn fn) {
  std::ifstream in = open_input(path);
  std::string line;
  for (size_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    json value;
    try {
      value = json::parse(line);
    } catch (const json::exception& e) {
      fail("{}:{}: not JSON: {}", path, number, e.what());
    }
    fn(value, number);
  }
}

void run(const TokenizeArgs& args) {
  Tokenizer tokenizer = Tokenizer::from_model_path(args.model);
  bool parse_special = !args.no_special;
  if (!args.chat_json.empty()) {
    json doc;
    try {
      doc = json::parse(read_file(args.chat_json));
    } catch (const json::exception& e) {
      fail("{}: not JSON: {}", args.chat_json, e.what());
    }
    SPIN_CHECK(doc.is_array(), "{}: expected a JSON array of messages", args.chat_json);
    std::vector<ChatMessage> messages;
    for (const json& m : doc) {
      SPIN_CHECK(m.is_object() && m.contains("role") && m.contains("content") &&
                     m.at("role").is_string() && m.at("content").is_string(),
                 "{}: each message needs string 'role' and 'content'", args.chat_json);
      messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    }
    std::string prompt = ChatTemplate::detect(tokenizer.chat_template(), tokenizer).apply(messages, true);
    if (args.json_output) {
      std::cout << json(prompt).dump() << "\n";
    } else {
      std::cout << prompt;
    }
    return;
  }
  if (!args.decode.empty()) {
    std::cout << tokenizer.decode(parse_token_ids(args.decode, "--decode"));
    std::cout.flush();
    return;
  }
  if (!args.jsonl_in.empty()) {
    for_each_json_line(args.jsonl_in, [&](const json& value, size_t number) {
      SPIN_CHECK(value.is_string(), "{}:{}: expected a JSON string", args.jsonl_in, number);
      std::cout << json(tokenizer.encode(value.get_ref<const std::string&>(), parse_special)).dump()
                << "\n";
    });
    return;
  }
  if (!args.decode_jsonl.empty()) {
    for_each_json_line(args.decode_jsonl, [&](const json& value, size_t number) {
      SPIN_CHECK(value.is_array(), "{}:{}: expected a JSON array of ids", args.decode_jsonl, number);
      std::vector<int32_t> ids;
      for (const json& id : value) {
        SPIN_CHECK(id.is_number_integer(), "{}:{}: ids must be integers", args.decode_jsonl, number);
        int64_t v = id.get<int64_t>();
        SPIN_CHECK(v >= 0 && v <= INT32_MAX, "{}:{}: id {} out of range", args.decode_jsonl, number, v);
        ids.push_back(static_cast<int32_t>(v));
      }
      // Bytes that are not UTF-8 come out as U+FFFD so each line stays a valid JSON string.
      std::cout << json(tokenizer.decode(ids)).dump(-1, ' ', true, json::error_handler_t::replace)
                << "\n";
    });
    return;
  }
  std::string text = args.file.empty() ? args.text : read_file(args.file);
  print_ids(tokenizer.encode(text, parse_special), args.json_output);
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Print the token ids of a text (or decode ids)");
  cmd->add_option("--model", args->model, "Model: .gguf file, tokenizer.json, or HF directory")
      ->required();
  cmd->add_option("--text", args->text, "Text to tokenize");
  cmd->add_option("--file", args->file, "File whose whole content is tokenized");
  cmd->add_option("--decode", args->decode, "Comma-separated token ids to turn back into text");
  cmd->add_option("--jsonl-in", args->jsonl_in,
                  "File of JSON strings, one a line: prints one JSON array of ids per line");
  cmd->add_option("--decode-jsonl", args->decode_jsonl,
                  "File of JSON id arrays, one a line: prints one JSON string per line");
  cmd->add_option("--chat-json", args->chat_json,
                  "File with a JSON array of {role, content}: prints the prompt the model's chat "
                  "template renders (with the assistant header at the end)");
  cmd->add_flag("--json", args->json_output, "Print the ids as a JSON array");
  cmd->add_flag("--no-special", args->no_special,
                "Treat special-token text (e.g. <|im_start|>) as plain text");
  cmd->callback([args, cmd] {
    size_t sources = 0;
    for (const char* name : {"--text", "--file", "--decode", "--jsonl-in", "--decode-jsonl", "--chat-json"})
      sources += cmd->count(name) > 0 ? 1 : 0;
    SPIN_CHECK(sources == 1,
               "give exactly one of --text, --file, --decode, --jsonl-in, --decode-jsonl, --chat-json");
    run(*args);
  });
}

}  // namespace spin::cli
