// `spin generate`: one prompt in, streamed text out, then a one-line speed summary.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/backend.h"
#include "cli/commands.h"
#include "cli/npy.h"
#include "cli/token_ids.h"
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
  GenerationParams gen;
  float temperature = 0.8f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  std::optional<uint64_t> seed;
  int threads = 0;
  std::string logits_out;
  std::string ids_out;
  // Whether each flag was given (an empty value is then an error, not a missing flag).
  bool prompt_given = false;
  bool prompt_ids_given = false;
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

// Fails now, before the model loads and generates, when `path` cannot be written. Opening to append
// leaves an existing file as it is until the output is written.
void check_writable(const std::string& path, const char* flag) {
  SPIN_CHECK(std::ofstream(path, std::ios::binary | std::ios::app).good(), "{}: cannot write '{}'", flag, path);
}

void run_generate(const GenerateArgs& a) {
  SPIN_CHECK(a.prompt_given != a.prompt_ids_given, "give exactly one of --prompt and --prompt-ids");
  SPIN_CHECK(!a.prompt_given || !a.prompt.empty(), "--prompt is empty");
  SPIN_CHECK(!a.prompt_ids_given || !a.prompt_ids.empty(), "--prompt-ids is empty");
  SPIN_CHECK(!(a.chat && a.prompt_ids_given), "--chat needs --prompt (text), not --prompt-ids");
  SPIN_CHECK(a.system.empty() || a.chat, "--system needs --chat (it is a chat message)");
  SPIN_CHECK(a.ids_out.empty() || a.ids_out != a.logits_out, "--ids-out and --logits-out name the same file");
  GenerationParams params = a.gen;
  params.sampling = SamplingParams{.temperature = a.temperature,
                                   .top_k = a.top_k,
                                   .top_p = a.top_p,
                                   .min_p = a.min_p,
                                   .seed = a.seed,
                                   .repetition_penalty = a.repetition_penalty,
                                   .frequency_penalty = a.frequency_penalty,
                                   .presence_penalty = a.presence_penalty};
  params.sampling.validate();
  if (!a.ids_out.empty()) check_writable(a.ids_out, "--ids-out");
  if (!a.logits_out.empty()) check_writable(a.logits_out, "--logits-out");
  cpu::set_num_threads(a.threads);
  const auto t_load = std::chrono::steady_clock::now();
  LoadedModel model = load_model(a.load);
  std::fprintf(stderr, "[spin] loaded %s: %.1fM parameters in %.2f s\n", model.name.c_str(),
               model.weights.config.parameter_count() / 1e6,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  const Tokenizer* tokenizer = model.tokenizer.get();
  const std::vector<int32_t> prompt = build_prompt(a, tokenizer);

  SPIN_CHECK(a.gen.stop.empty() || tokenizer, "--stop needs a model with a tokenizer");

  const int64_t context = a.gen.max_context > 0 ? a.gen.max_context : model.weights.config.max_position;
  const auto room = context - static_cast<int64_t>(prompt.size());
  if (room >= 0 && a.gen.max_tokens > room)
    std::fprintf(stderr, "[spin] note: --max-tokens %lld does not fit the context of %lld tokens after a %zu-token prompt: "
                 "at most %lld tokens will be generated\n",
                 static_cast<long long>(a.gen.max_tokens), static_cast<long long>(context), prompt.size(),
                 static_cast<long long>(room));

  Transformer transformer(model.weights);
  std::vector<float> prompt_logits;
  GenerationResult r = generate(
      transformer, tokenizer, prompt, params,
      [](std::string_view text) {
        std::fwrite(text.data(), 1, text.size(), stdout);
        std::fflush(stdout);
      },
      a.logits_out.empty() ? nullptr : &prompt_logits);
  if (!r.text.empty()) std::fputc('\n', stdout);

  if (!a.logits_out.empty()) {
    write_npy(a.logits_out, prompt_logits,
              {static_cast<int64_t>(prompt.size()), model.weights.config.vocab_size});
  }
  if (!a.ids_out.empty()) {
    std::ofstream out(a.ids_out);
    out << nlohmann::json{{"prompt_ids", prompt}, {"output_ids", r.output_ids},
                          {"finish_reason", r.finish_reason}}.dump()
        << "\n";
    SPIN_CHECK(out.flush().good(), "--ids-out: cannot write '{}'", a.ids_out);
  }
  const double prefill_tps = r.prefill_seconds > 0 ? r.prompt_tokens / r.prefill_seconds : 0.0;
  const double decode_tps = r.decode_seconds > 0 ? r.decode_steps / r.decode_seconds : 0.0;
  std::fprintf(stderr,
               "[spin] prompt %lld tokens | prefill %.1f tok/s | decode %.1f tok/s | %zu tokens "
               "generated (%s)\n",
               static_cast<long long>(r.prompt_tokens), prefill_tps, decode_tps,
               r.output_ids.size(), r.finish_reason.c_str());
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from one prompt, streaming it");
  add_model_options(*cmd, args->load);
  CLI::Option* prompt = cmd->add_option("-p,--prompt", args->prompt, "prompt text");
  CLI::Option* prompt_ids = cmd->add_option("--prompt-ids", args->prompt_ids, "prompt as comma-separated token ids");
  cmd->add_flag("--chat", args->chat, "wrap the prompt in the model's chat template");
  cmd->add_option("--system", args->system, "system message (with --chat)");
  cmd->add_option("-n,--max-tokens", args->gen.max_tokens, "tokens to generate")
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "0 = off")->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "1 = off")->capture_default_str();
  cmd->add_option("--min-p", args->min_p, "0 = off")->capture_default_str();
  cmd->add_option("--repetition-penalty", args->repetition_penalty,
                  "divides positive logits (multiplies negative ones) of prompt and output tokens; 1 = off")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", args->frequency_penalty, "subtracted per occurrence in the output; 0 = off")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", args->presence_penalty, "subtracted once per token in the output; 0 = off")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "sampling seed (default: random)");
  cmd->add_option("--stop", args->gen.stop, "stop string (repeatable)");
  cmd->add_flag("--ignore-eos", args->gen.ignore_eos, "keep generating past end-of-sequence tokens");
  cmd->add_option("--prefill-chunk", args->gen.prefill_chunk, "prompt tokens per prefill step")
      ->capture_default_str();
  cmd->add_option("--max-context", args->gen.max_context, "context length (default: the model's)");
  cmd->add_option("-t,--threads", args->threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 4096));
  cmd->add_option("--logits-out", args->logits_out, "write the logits of every prompt position (.npy)");
  cmd->add_option("--ids-out", args->ids_out, "write prompt and output token ids (JSON)");
  cmd->callback([args, prompt, prompt_ids] {
    args->prompt_given = prompt->count() > 0;
    args->prompt_ids_given = prompt_ids->count() > 0;
    run_generate(*args);
  });
}

}  // namespace spin::cli
