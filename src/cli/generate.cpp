// `spin generate`: one prompt in, streamed text out, then a one-line speed summary. The prompt is
// one request of an Engine stepped on this thread, so sampling, stop ids and stop strings are the
// server's.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/npy.h"
#include "cli/token_ids.h"
#include "engine/engine.h"
#include "engine/generator.h"
#include "kernels/cpu/ops.h"
#include "model/transformer.h"
#include "model/loader.h"

namespace spin::cli {

namespace {

struct GenerateArgs {
  LoadOptions load;
  std::string prompt;
  std::string prompt_ids;
  bool chat = false;
  std::string system;
  int64_t max_tokens = 128;
  std::vector<std::string> stop;  // stop strings (not included in the output)
  bool ignore_eos = false;
  int64_t prefill_chunk = 512;    // tokens per prefill step
  int64_t max_context = 0;        // 0 = the model's trained context length
  float temperature = 0.8f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  std::optional<uint64_t> seed;
  int threads = 0;
  std::string logits_out;
  std::string ids_out;
};

std::vector<int32_t> build_prompt(const GenerateArgs& a, const Tokenizer* tokenizer) {
  if (!a.prompt_ids.empty()) return parse_token_ids(a.prompt_ids, "--prompt-ids");
  SPIN_CHECK(tokenizer != nullptr,
             "this model has no tokenizer (dummy weights): pass --prompt-ids instead of --prompt");
  std::string text = a.prompt;
  if (a.chat) {
    std::vector<ChatMessage> messages;
    if (!a.system.empty()) messages.push_back({"system", a.system});
    messages.push_back({"user", a.prompt});
    text = ChatTemplate::detect(tokenizer->chat_template(), *tokenizer).apply(messages, true);
  }
  return tokenizer->encode_prompt(text);
}

void run_generate(const GenerateArgs& a) {
  SPIN_CHECK(a.prompt.empty() != a.prompt_ids.empty(), "give exactly one of --prompt and --prompt-ids");
  SPIN_CHECK(!(a.chat && !a.prompt_ids.empty()), "--chat needs --prompt (text), not --prompt-ids");
  cpu::set_num_threads(a.threads);
  const auto t_load = std::chrono::steady_clock::now();
  LoadedModel model = load_model(a.load);
  std::fprintf(stderr, "[spin] loaded %s: %.1fM parameters in %.2f s\n", model.name.c_str(),
               model.weights.config.parameter_count() / 1e6,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  const Tokenizer* tokenizer = model.tokenizer.get();
  const std::vector<int32_t> prompt = build_prompt(a, tokenizer);

  SPIN_CHECK(a.stop.empty() || tokenizer, "--stop needs a model with a tokenizer");
  SPIN_CHECK(!prompt.empty(), "the prompt is empty");
  SPIN_CHECK(a.max_tokens >= 0, "max tokens must be >= 0, got {}", a.max_tokens);
  SPIN_CHECK(a.prefill_chunk > 0, "prefill chunk must be positive, got {}", a.prefill_chunk);
  const ModelConfig& config = model.weights.config;
  SPIN_CHECK(a.max_context <= config.max_position, "max context {} is longer than the model's context length {}",
             a.max_context, config.max_position);
  const int64_t context = a.max_context > 0 ? a.max_context : config.max_position;
  const auto n_prompt = static_cast<int64_t>(prompt.size());
  SPIN_CHECK(n_prompt < context || (n_prompt == context && a.max_tokens == 0),
             "the prompt has {} tokens but the context length is {}", n_prompt, context);

  Transformer transformer(model.weights);
  if (!a.logits_out.empty()) {
    write_npy(a.logits_out, prompt_logits(transformer, prompt, a.prefill_chunk), {n_prompt, config.vocab_size});
  }

  using clock = std::chrono::steady_clock;
  std::vector<int32_t> output_ids;
  std::string finish_reason = "length";
  bool any_text = false;
  double prefill_seconds = 0.0, decode_seconds = 0.0;
  int64_t decode_steps = 0;
  const int64_t max_new = std::min(a.max_tokens, context - n_prompt);
  if (max_new > 0) {
    EngineConfig engine_config;
    engine_config.max_num_seqs = 1;
    engine_config.max_num_batched_tokens = a.prefill_chunk;
    engine_config.max_model_len = context;
    Engine engine(transformer, tokenizer, engine_config);
    RequestParams params;
    params.max_tokens = max_new;
    params.sampling = SamplingParams{a.temperature, a.top_k, a.top_p, a.min_p, a.seed};
    params.stop = a.stop;
    params.ignore_eos = a.ignore_eos;
    const auto t_start = clock::now();
    std::optional<clock::time_point> t_first;
    engine.add_request(prompt, params, [&](const RequestOutput& out) {
      if (!t_first && !out.token_ids.empty()) t_first = clock::now();
      output_ids.insert(output_ids.end(), out.token_ids.begin(), out.token_ids.end() - (out.stop_token ? 1 : 0));
      if (!out.text.empty()) {
        std::fwrite(out.text.data(), 1, out.text.size(), stdout);
        std::fflush(stdout);
        any_text = true;
      }
      if (out.finished) finish_reason = out.finish_reason;
    });
    while (engine.has_work()) {
      const bool decoding = t_first.has_value();  // a step after the first token feeds one back
      engine.step();
      decode_steps += decoding;
    }
    const auto t_end = clock::now();
    prefill_seconds = std::chrono::duration<double>(t_first.value_or(t_end) - t_start).count();
    decode_seconds = std::chrono::duration<double>(t_end - t_first.value_or(t_end)).count();
  }
  if (any_text) std::fputc('\n', stdout);

  if (!a.ids_out.empty()) {
    std::ofstream out(a.ids_out);
    SPIN_CHECK(out.good(), "cannot write '{}'", a.ids_out);
    out << nlohmann::json{{"prompt_ids", prompt}, {"output_ids", output_ids}, {"finish_reason", finish_reason}}.dump()
        << "\n";
  }
  const double prefill_tps = prefill_seconds > 0 ? n_prompt / prefill_seconds : 0.0;
  const double decode_tps = decode_seconds > 0 ? decode_steps / decode_seconds : 0.0;
  std::fprintf(stderr,
               "[spin] prompt %lld tokens | prefill %.1f tok/s | decode %.1f tok/s | %zu tokens "
               "generated (%s)\n",
               static_cast<long long>(n_prompt), prefill_tps, decode_tps, output_ids.size(), finish_reason.c_str());
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from one prompt, streaming it");
  cmd->add_option("-m,--model", args->load.model, ".gguf file, HF directory, or preset name")
      ->required();
  cmd->add_option("--load-format", args->load.load_format, "auto | gguf | safetensors | dummy")
      ->check(CLI::IsMember({"auto", "gguf", "safetensors", "dummy"}));
  cmd->add_option("-p,--prompt", args->prompt, "prompt text");
  cmd->add_option("--prompt-ids", args->prompt_ids, "prompt as comma-separated token ids");
  cmd->add_flag("--chat", args->chat, "wrap the prompt in the model's chat template");
  cmd->add_option("--system", args->system, "system message (with --chat)");
  cmd->add_option("-n,--max-tokens", args->max_tokens, "tokens to generate")
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "0 = off")->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "1 = off")->capture_default_str();
  cmd->add_option("--min-p", args->min_p, "0 = off")->capture_default_str();
  cmd->add_option("--seed", args->seed, "sampling seed (default: random)");
  cmd->add_option("--stop", args->stop, "stop string (repeatable)");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "keep generating past end-of-sequence tokens");
  cmd->add_option("--prefill-chunk", args->prefill_chunk, "prompt tokens per prefill step")
      ->capture_default_str();
  cmd->add_option("--max-context", args->max_context, "context length (default: the model's)");
  cmd->add_option("-t,--threads", args->threads, "CPU threads (default: all cores)");
  cmd->add_option("--logits-out", args->logits_out, "write the logits of every prompt position (.npy)");
  cmd->add_option("--ids-out", args->ids_out, "write prompt and output token ids (JSON)");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace spin::cli
