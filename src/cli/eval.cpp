// `spin eval`: fidelity of sparse algorithms against dense attention on long prompts the command
// builds itself (needle-in-a-haystack at several depths, long-document continuation), and
// `spin eval --locality TRACE`: device-cache hit rate of recorded selections vs buffer size.
//
// Per prompt: one dense prefill (ContiguousAttention) whose K/V are captured and replayed into
// every algorithm's paged store (prefill is dense and exact for every algorithm), then dense
// greedy decode for --steps tokens. Each (algorithm, budget) decodes teacher-forced on dense's
// tokens, so steps align: top-1 agreement, KL(dense‖sparse) of the next-token distribution and
// the relative error of every layer's attention output. Needle prompts also get the greedy answer:
// equal to dense's while top-1 agrees, else a free-running greedy decode from the prompt.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "base/error.h"
#include "cli/commands.h"
#include "kernels/cpu/ops.h"
#include "kv/replacement_oracle.h"
#include "kv/selection_trace.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/transformer.h"
#include "sparse/paged_sparse_attention.h"

namespace spin::cli {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct EvalArgs {
  LoadOptions load;
  std::string algorithms = "quest,shadowkv,retroinfer,seer";
  std::string budgets = "1/16,1/8,1/4";
  int64_t context = 4096;
  int64_t steps = 32;
  std::string depths = "0.1,0.5,0.9";
  int64_t documents = 1;
  std::string out = "eval-out";
  std::string trace;
  std::string locality;
  int threads = 0;
  uint64_t seed = 1;
  std::string seer_gate;  // seer's trained gate (safetensors); empty: the training-free gate
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  for (char c : s) {
    if (c == sep) {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else if (c != ' ') {
      item += c;
    }
  }
  if (!item.empty()) out.push_back(item);
  return out;
}

double parse_fraction(const std::string& text) {
  double value = 0.0;
  const auto slash = text.find('/');
  try {
    size_t used = 0;
    if (slash == std::string::npos) {
      value = std::stod(text, &used);
      SPIN_CHECK(used == text.size(), "");
    } else {
      size_t used2 = 0;
      const double num = std::stod(text.substr(0, slash), &used);
      const double den = std::stod(text.substr(slash + 1), &used2);
      SPIN_CHECK(used == slash && used2 == text.size() - slash - 1 && den != 0.0, "");
      value = num / den;
    }
  } catch (const std::exception&) {
    fail("--budgets: '{}' is not a fraction like 1/8 or 0.125", text);
  }
  SPIN_CHECK(std::isfinite(value) && value > 0.0 && value <= 1.0,
             "--budgets: {} is outside (0, 1]", text);
  return value;
}

// ---------------------------------------------------------------- prompts

// Filler sentences from a seeded grammar: varied enough that no sentence predicts the needle.
class Filler {
 public:
  explicit Filler(uint64_t seed) : rng_(seed) {}
  std::string sentence() {
    static const char* subjects[] = {"The old farmer", "A young engineer", "The river", "Our neighbour",
                                     "The committee", "A quiet student", "The city council",
                                     "The blacksmith", "A travelling merchant", "The librarian"};
    static const char* verbs[] = {"walked past", "carefully studied", "painted", "talked about",
                                  "ignored", "repaired", "wrote a letter about", "measured",
                                  "photographed", "argued over"};
    static const char* objects[] = {"the wooden bridge", "a field of barley", "the harbour lights",
                                    "an unfinished map", "the stone tower", "the morning market",
                                    "a box of old tools", "the northern forest", "the village well",
                                    "a basket of apples"};
    static const char* tails[] = {"before the rain began", "on a cold Tuesday", "while the bells rang",
                                  "for most of the afternoon", "after a long journey",
                                  "without saying a word", "near the end of summer",
                                  "as the sun went down"};
    auto pick = [&](const auto& list) { return list[rng_() % std::size(list)]; };
    return std::string(" ") + pick(subjects) + " " + pick(verbs) + " " + pick(objects) + " " +
           pick(tails) + ".";
  }

 private:
  std::mt19937_64 rng_;
};

struct Prompt {
  std::string name;
  std::string kind;  // "needle" | "document"
  double depth = 0.0;
  std::string key;   // needle pass key
  std::vector<int32_t> tokens;
};

// Sentences encoded one by one and concatenated until `count` tokens.
std::vector<int32_t> filler_tokens(const Tokenizer& tok, Filler& filler, size_t count) {
  std::vector<int32_t> out;
  while (out.size() < count) {
    const std::vector<int32_t> s = tok.encode(filler.sentence(), false);
    out.insert(out.end(), s.begin(), s.end());
  }
  out.resize(count);
  return out;
}

Prompt needle_prompt(const Tokenizer& tok, int64_t context, double depth, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::string key = std::to_string(10000 + rng() % 90000);
  Filler filler(seed * 7919 + 1);
  std::vector<int32_t> head;
  if (tok.add_bos() && tok.bos_id() >= 0) head.push_back(tok.bos_id());
  const std::vector<int32_t> intro = tok.encode(
      "Read the following text. It hides a secret pass key; remember it.", false);
  const std::vector<int32_t> needle =
      tok.encode(" The secret pass key is " + key + ". Remember it: " + key + ".", false);
  const std::vector<int32_t> question =
      tok.encode("\nWhat is the secret pass key? The secret pass key is", false);
  const int64_t fixed = static_cast<int64_t>(head.size() + intro.size() + needle.size() + question.size());
  SPIN_CHECK(context > fixed + 64, "--context {} is too short for a needle prompt", context);
  const auto filler_count = static_cast<size_t>(context - fixed);
  const std::vector<int32_t> text = filler_tokens(tok, filler, filler_count);
  // Insert at the sentence boundary (a token ending in '.') nearest the depth.
  auto at = static_cast<size_t>(depth * static_cast<double>(filler_count));
  while (at > 0 && at < text.size() && tok.decode(std::span(&text[at - 1], 1)).back() != '.') --at;
  Prompt p{fmt::format("needle@{:.2f}", depth), "needle", depth, key, head};
  p.tokens.insert(p.tokens.end(), intro.begin(), intro.end());
  p.tokens.insert(p.tokens.end(), text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at));
  p.tokens.insert(p.tokens.end(), needle.begin(), needle.end());
  p.tokens.insert(p.tokens.end(), text.begin() + static_cast<std::ptrdiff_t>(at), text.end());
  p.tokens.insert(p.tokens.end(), question.begin(), question.end());
  return p;
}

// A long ledger whose entries reuse a few names and places, so that continuing it means looking
// back across the whole document.
Prompt document_prompt(const Tokenizer& tok, int64_t context, uint64_t seed, int index) {
  std::mt19937_64 rng(seed * 104729 + static_cast<uint64_t>(index));
  static const char* names[] = {"Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana"};
  static const char* places[] = {"the kitchen", "the garden", "the attic", "the cellar", "the garage",
                                 "the library", "the workshop", "the porch"};
  static const char* things[] = {"the red box", "a brass key", "the blue lamp", "an old radio",
                                 "the silver cup", "a paper kite", "the green chair", "a clay pot"};
  std::vector<int32_t> tokens;
  if (tok.add_bos() && tok.bos_id() >= 0) tokens.push_back(tok.bos_id());
  const std::vector<int32_t> title = tok.encode("Household ledger. Each entry records who moved what, and where.\n", false);
  tokens.insert(tokens.end(), title.begin(), title.end());
  for (int entry = 1; static_cast<int64_t>(tokens.size()) < context; ++entry) {
    auto pick = [&](const auto& list) { return list[rng() % std::size(list)]; };
    const std::string line = fmt::format("Entry {}: {} moved {} to {}.\n", entry, pick(names),
                                         pick(things), pick(places));
    const std::vector<int32_t> t = tok.encode(line, false);
    tokens.insert(tokens.end(), t.begin(), t.end());
  }
  tokens.resize(static_cast<size_t>(context));
  return Prompt{fmt::format("document{}", index), "document", 0.0, "", tokens};
}

// ---------------------------------------------------------------- attention wrappers

// Dense reference that keeps every prefill call's q/k/v/pre-RoPE keys (to replay into paged
// stores) and every decode call's output.
class CapturingDense final : public SequenceAttention {
 public:
  CapturingDense(const AttentionShape& shape, int64_t max_tokens)
      : dense_(shape, max_tokens), shape_(shape), layers_(static_cast<size_t>(shape.n_layers)) {}
  void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& t, float* out) override {
    dense_.forward(layer, pos0, n, t, out);
    const int64_t kw = shape_.n_kv_heads * shape_.head_dim;
    if (capturing_) {
      Layer& L = layers_[static_cast<size_t>(layer)];
      L.k.insert(L.k.end(), t.k, t.k + n * kw);
      L.v.insert(L.v.end(), t.v, t.v + n * kw);
      L.k_pre.insert(L.k_pre.end(), t.k_pre_rope, t.k_pre_rope + n * kw);
      rope_ = t.rope;
    } else {
      const int64_t qw = shape_.n_heads * shape_.head_dim;
      decode_out.insert(decode_out.end(), out, out + qw);
    }
  }
  int64_t length() const override { return dense_.length(); }
  void stop_capturing() { capturing_ = false; }
  // Replays the captured prefill (tokens [0, n)) into a paged store.
  void replay(sparse::PagedSparseAttention& paged, int64_t n, int64_t chunk) const {
    const int64_t kw = shape_.n_kv_heads * shape_.head_dim;
    for (int64_t p = 0; p < n; p += chunk) {
      const int64_t m = std::min(chunk, n - p);
      for (int64_t l = 0; l < shape_.n_layers; ++l) {
        const Layer& L = layers_[static_cast<size_t>(l)];
        paged.store_prefill(l, p, m,
                            {.q = nullptr, .k = &L.k[p * kw], .v = &L.v[p * kw],
                             .k_pre_rope = &L.k_pre[p * kw], .rope = rope_});
      }
    }
  }
  std::vector<float> decode_out;  // [step][layer][n_heads·hd]

 private:
  struct Layer {
    std::vector<float> k, v, k_pre;
  };
  ContiguousAttention dense_;
  AttentionShape shape_;
  std::vector<Layer> layers_;
  const RopeTable* rope_ = nullptr;
  bool capturing_ = true;
};

// Keeps every decode call's output of the wrapped attention.
class RecordingAttention final : public SequenceAttention {
 public:
  RecordingAttention(sparse::PagedSparseAttention& inner, int64_t width) : inner_(inner), width_(width) {}
  void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& t, float* out) override {
    inner_.forward(layer, pos0, n, t, out);
    if (n == 1) decode_out.insert(decode_out.end(), out, out + width_);
  }
  int64_t length() const override { return inner_.length(); }
  std::vector<float> decode_out;

 private:
  sparse::PagedSparseAttention& inner_;
  int64_t width_;
};

// ---------------------------------------------------------------- metrics

int32_t argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

// KL(p‖q) of the softmax distributions of two logit rows, in nats.
double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  auto log_z = [](std::span<const float> x) {
    const double m = *std::max_element(x.begin(), x.end());
    double s = 0.0;
    for (float v : x) s += std::exp(double{v} - m);
    return m + std::log(s);
  };
  const double zp = log_z(p_logits), zq = log_z(q_logits);
  double kl = 0.0;
  for (size_t i = 0; i < p_logits.size(); ++i) {
    const double lp = p_logits[i] - zp, lq = q_logits[i] - zq;
    kl += std::exp(lp) * (lp - lq);
  }
  return std::max(0.0, kl);
}

double rel_error(const float* a, const float* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool answer_has_key(const Tokenizer& tok, std::span<const int32_t> answer, const std::string& key) {
  return tok.decode(answer).find(key) != std::string::npos;
}

// ---------------------------------------------------------------- sessions

struct Store {
  kv::KvConfig config;
  std::unique_ptr<kv::HostPageMemory> memory;
  std::unique_ptr<kv::KvManager> kv;
  Store(const AttentionShape& shape, uint32_t max_context, uint32_t page_size) {
    config.layout = {static_cast<uint32_t>(shape.n_layers), static_cast<uint32_t>(shape.n_kv_heads),
                     static_cast<uint32_t>(shape.head_dim), page_size};
    const uint32_t pages = config.layout.pages_for_tokens(max_context) * config.layout.streams();
    config.device_pages = pages;
    config.host_pages = pages;
    config.max_context = max_context;
    memory = std::make_unique<kv::HostPageMemory>(config.layout, pages, pages);
    kv = std::make_unique<kv::KvManager>(config, *memory);
  }
};

sparse::SparseSettings settings_for(const std::string& algorithm, double budget,
                                    const std::shared_ptr<const sparse::SeerGate>& seer_gate) {
  sparse::SparseSettings s;
  s.algorithm = algorithm;
  s.budget_fraction = budget;
  s.seer_gate = seer_gate;
  return s;
}

// ShadowKV's partition is an 8-token chunk; the others run on the default 16-token pages.
uint32_t page_size_for(const std::string& algorithm) { return algorithm == "shadowkv" ? 8 : 16; }

struct Reference {
  const Prompt* prompt = nullptr;
  std::vector<int32_t> tokens;               // dense greedy tokens y_1..y_S
  std::vector<std::vector<float>> logits;    // after feeding y_i, i = 1..S
  std::vector<float> decode_out;             // [step][layer][width]
  std::unique_ptr<CapturingDense> capture;
};

struct EvalContext {
  Transformer* model;
  const Tokenizer* tok;
  AttentionShape shape;
  int64_t steps;
  int64_t answer_tokens;
  kv::SelectionTrace* trace;
  json* trace_requests;
  std::shared_ptr<const sparse::SeerGate> seer_gate;
};

Reference run_dense(EvalContext& ctx, const Prompt& prompt) {
  Reference ref;
  ref.prompt = &prompt;
  const auto T = static_cast<int64_t>(prompt.tokens.size());
  ref.capture = std::make_unique<CapturingDense>(ctx.shape, T + ctx.steps + 1);
  std::vector<float> logits;
  const auto t0 = Clock::now();
  for (int64_t p = 0; p < T; p += 512) {
    const int64_t n = std::min<int64_t>(512, T - p);
    SequenceChunk chunk{std::span(prompt.tokens).subspan(static_cast<size_t>(p), static_cast<size_t>(n)), p,
                        ref.capture.get()};
    ctx.model->forward(std::span(&chunk, 1), false, logits);
    spdlog::info("{}: dense prefill {}/{} tokens", prompt.name, p + n, T);
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  ref.capture->stop_capturing();
  int32_t next = argmax(logits);
  for (int64_t i = 0; i < ctx.steps; ++i) {
    ref.tokens.push_back(next);
    SequenceChunk chunk{std::span(&ref.tokens.back(), 1), T + i, ref.capture.get()};
    ctx.model->forward(std::span(&chunk, 1), false, logits);
    ref.logits.push_back(logits);
    next = argmax(logits);
  }
  ref.decode_out = ref.capture->decode_out;
  spdlog::info("{}: dense prefill {:.1f} s ({:.0f} tok/s), {} decode steps", prompt.name, prefill_s,
               T / prefill_s, ctx.steps);
  return ref;
}

// One (algorithm, budget) on one prompt.
json run_session(EvalContext& ctx, const Reference& ref, const std::string& algorithm,
                 double budget, const std::string& budget_name, uint32_t request) {
  const auto T = static_cast<int64_t>(ref.prompt->tokens.size());
  const int64_t width = ctx.shape.n_heads * ctx.shape.head_dim;
  const auto t0 = Clock::now();
  auto open = [&](Store& store) {
    auto paged = std::make_unique<sparse::PagedSparseAttention>(*store.kv, *store.memory, ctx.shape,
                                                               settings_for(algorithm, budget, ctx.seer_gate));
    ref.capture->replay(*paged, T, 1024);
    paged->finish_prefill();
    return paged;
  };
  const auto max_context = static_cast<uint32_t>(T + ctx.steps + 1);
  Store store(ctx.shape, max_context, page_size_for(algorithm));
  auto paged = open(store);
  if (ctx.trace != nullptr) {
    paged->record_selections(ctx.trace, request);
    ctx.trace_requests->push_back({{"request", request}, {"algorithm", algorithm}, {"budget", budget_name},
                                   {"prompt", ref.prompt->name}, {"page_size", page_size_for(algorithm)}});
  }
  RecordingAttention recorder(*paged, width);
  std::vector<float> logits;
  int64_t agree = 0, first_disagreement = -1;
  double kl_sum = 0.0, kl_max = 0.0, err_sum = 0.0;
  uint64_t selected = 0, outliers = 0, estimated = 0, sinks = 0, window = 0, heads = 0;
  for (int64_t i = 0; i < ctx.steps; ++i) {
    SequenceChunk chunk{std::span(&ref.tokens[static_cast<size_t>(i)], 1), T + i, &recorder};
    ctx.model->forward(std::span(&chunk, 1), false, logits);
    const bool same = argmax(logits) == argmax(ref.logits[static_cast<size_t>(i)]);
    agree += same;
    if (!same && first_disagreement < 0) first_disagreement = i;
    const double kl = kl_divergence(ref.logits[static_cast<size_t>(i)], logits);
    kl_sum += kl;
    kl_max = std::max(kl_max, kl);
    const auto& b = paged->last_step();
    selected += b.selected_tokens;
    outliers += b.outlier_tokens;
    estimated += b.estimated_tokens;
    sinks += b.sink_tokens;
    window += b.window_tokens;
    heads += b.sparse_heads;
  }
  const auto n_out = static_cast<size_t>(ctx.steps * ctx.shape.n_layers);
  for (size_t r = 0; r < n_out; ++r)
    err_sum += rel_error(&recorder.decode_out[r * width], &ref.decode_out[r * width], static_cast<size_t>(width));
  const double steps = static_cast<double>(ctx.steps);
  const auto per_head = [&](uint64_t v) { return heads ? static_cast<double>(v) / heads : 0.0; };
  json result{{"algorithm", algorithm},
              {"budget", budget_name},
              {"budget_fraction", budget},
              {"prompt", ref.prompt->name},
              {"kind", ref.prompt->kind},
              {"steps", ctx.steps},
              {"top1_agreement", agree / steps},
              {"kl_mean", kl_sum / steps},
              {"kl_max", kl_max},
              {"attn_rel_err_mean", err_sum / static_cast<double>(n_out)},
              {"first_disagreement", first_disagreement},
              {"selected_tokens_per_head", per_head(selected)},
              {"outlier_tokens_per_head", per_head(outliers)},
              {"estimated_tokens_per_head", per_head(estimated)},
              {"sink_tokens_per_head", per_head(sinks)},
              {"window_tokens_per_head", per_head(window)}};
  paged->record_selections(nullptr, 0);
  if (ref.prompt->kind == "needle") {
    // Greedy answer: y_1 comes from the (dense, shared) prefill; while top-1 agrees the sparse
    // greedy tokens are dense's.
    const auto n = static_cast<size_t>(std::min(ctx.answer_tokens, ctx.steps));
    std::vector<int32_t> answer(ref.tokens.begin(), ref.tokens.begin() + static_cast<std::ptrdiff_t>(n));
    if (first_disagreement >= 0 && static_cast<size_t>(first_disagreement) + 1 < n) {
      Store free_store(ctx.shape, max_context, page_size_for(algorithm));
      auto free_run = open(free_store);
      answer.assign(1, ref.tokens[0]);
      while (answer.size() < n) {
        SequenceChunk chunk{std::span(&answer.back(), 1), T + static_cast<int64_t>(answer.size()) - 1,
                            free_run.get()};
        ctx.model->forward(std::span(&chunk, 1), false, logits);
        answer.push_back(argmax(logits));
      }
    }
    result["answer"] = ctx.tok->decode(answer);
    result["needle_correct"] = answer_has_key(*ctx.tok, answer, ref.prompt->key);
  }
  result["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

// ---------------------------------------------------------------- reports

std::string fmt_pct(double x) { return fmt::format("{:.1f}%", 100.0 * x); }

json summarise(const json& results, const std::vector<std::string>& algorithms,
               const std::vector<std::string>& budgets) {
  json summary = json::array();
  for (const std::string& a : algorithms) {
    for (const std::string& b : budgets) {
      double agree = 0, kl = 0, err = 0, sel = 0;
      int n = 0, needles = 0, correct = 0;
      for (const json& r : results) {
        if (r["algorithm"] != a || r["budget"] != b) continue;
        ++n;
        agree += r["top1_agreement"].get<double>();
        kl += r["kl_mean"].get<double>();
        err += r["attn_rel_err_mean"].get<double>();
        sel += r["selected_tokens_per_head"].get<double>();
        if (r.contains("needle_correct")) {
          ++needles;
          correct += r["needle_correct"].get<bool>();
        }
      }
      if (n == 0) continue;
      summary.push_back({{"algorithm", a}, {"budget", b}, {"prompts", n},
                         {"top1_agreement", agree / n}, {"kl_mean", kl / n},
                         {"attn_rel_err_mean", err / n}, {"selected_tokens_per_head", sel / n},
                         {"needle_accuracy", needles ? static_cast<double>(correct) / needles : -1.0},
                         {"needles", needles}});
    }
  }
  return summary;
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  SPIN_CHECK(out.good(), "cannot write {}", path.string());
  out << text;
}

void run_eval(const EvalArgs& a) {
  cpu::set_num_threads(a.threads);
  const std::vector<std::string> algorithms = split(a.algorithms, ',');
  const std::vector<std::string> budget_names = split(a.budgets, ',');
  SPIN_CHECK(!algorithms.empty() && !budget_names.empty(), "--algorithms and --budgets must not be empty");
  // The summary groups results by algorithm and budget: a repeat would merge into one row.
  std::vector<double> budgets;
  for (const std::string& b : budget_names) {
    const double fraction = parse_fraction(b);
    const auto earlier = std::find(budgets.begin(), budgets.end(), fraction);
    SPIN_CHECK(earlier == budgets.end(), "--budgets: '{}' repeats '{}'", b,
               budget_names[static_cast<size_t>(earlier - budgets.begin())]);
    budgets.push_back(fraction);
  }
  for (auto alg = algorithms.begin(); alg != algorithms.end(); ++alg) {
    SPIN_CHECK(sparse::AlgorithmRegistry::global().contains(*alg),
               "--algorithms: unknown algorithm '{}'", *alg);
    SPIN_CHECK(std::find(algorithms.begin(), alg, *alg) == alg, "--algorithms: '{}' is given twice", *alg);
  }
  std::vector<double> depths;
  for (const std::string& d : split(a.depths, ',')) {
    double v = -1.0;
    try {
      v = std::stod(d);
    } catch (const std::exception&) {
    }
    SPIN_CHECK(v >= 0.0 && v <= 1.0, "--depths: '{}' is not a depth in [0, 1]", d);
    depths.push_back(v);
  }
  SPIN_CHECK(a.documents >= 0, "--documents must be >= 0, got {}", a.documents);
  SPIN_CHECK(!depths.empty() || a.documents > 0, "nothing to evaluate: --depths is empty and --documents is 0");
  SPIN_CHECK(a.steps >= 1 && a.steps <= 4096, "--steps must be in 1..4096");
  SPIN_CHECK(a.context >= 256 && a.context <= (1 << 20), "--context must be in 256..1048576");

  LoadedModel model = load_model(a.load);
  SPIN_CHECK(model.tokenizer != nullptr, "spin eval needs a model with a tokenizer");
  SPIN_CHECK(a.context + a.steps <= model.weights.config.max_position || model.weights.config.max_position <= 0,
             "--context {} + --steps {} exceed the model's context length {}", a.context, a.steps,
             model.weights.config.max_position);
  Transformer transformer(model.weights);
  const Tokenizer& tok = *model.tokenizer;
  std::filesystem::create_directories(a.out);

  std::vector<Prompt> prompts;
  for (size_t i = 0; i < depths.size(); ++i)
    prompts.push_back(needle_prompt(tok, a.context, depths[i], a.seed + i));
  for (int64_t i = 0; i < a.documents; ++i)
    prompts.push_back(document_prompt(tok, a.context, a.seed, static_cast<int>(i)));

  kv::SelectionTrace trace;
  json trace_requests = json::array();
  EvalContext ctx{&transformer, &tok, transformer.attention_shape(), a.steps, 12,
                  a.trace.empty() ? nullptr : &trace, &trace_requests,
                  a.seer_gate.empty() ? nullptr : sparse::load_seer_gate(a.seer_gate, transformer.attention_shape())};
  json results = json::array(), prompt_info = json::array();
  uint32_t request = 0;
  const auto t0 = Clock::now();
  for (const Prompt& prompt : prompts) {
    const Reference ref = run_dense(ctx, prompt);
    json info{{"name", prompt.name}, {"kind", prompt.kind}, {"tokens", prompt.tokens.size()}};
    if (prompt.kind == "needle") {
      const auto n = static_cast<size_t>(std::min(ctx.answer_tokens, ctx.steps));
      const std::span<const int32_t> answer(ref.tokens.data(), n);
      info["depth"] = prompt.depth;
      info["key"] = prompt.key;
      info["dense_answer"] = tok.decode(answer);
      info["dense_correct"] = answer_has_key(tok, answer, prompt.key);
    } else {
      info["dense_continuation"] = tok.decode(ref.tokens);
    }
    prompt_info.push_back(info);
    for (const std::string& alg : algorithms) {
      for (size_t b = 0; b < budgets.size(); ++b) {
        json r = run_session(ctx, ref, alg, budgets[b], budget_names[b], request++);
        spdlog::info("{} {} {}: top-1 {:.3f}, KL {:.4f}, attention error {:.4f}{} ({:.1f} s)",
                     prompt.name, alg, budget_names[b], r["top1_agreement"].get<double>(),
                     r["kl_mean"].get<double>(), r["attn_rel_err_mean"].get<double>(),
                     r.contains("needle_correct") ? (r["needle_correct"].get<bool>() ? ", needle ok" : ", needle MISSED") : "",
                     r["seconds"].get<double>());
        results.push_back(std::move(r));
      }
    }
  }
  const json summary = summarise(results, algorithms, budget_names);
  int dense_needles = 0, dense_correct = 0;
  for (const json& p : prompt_info) {
    if (p["kind"] != "needle") continue;
    ++dense_needles;
    dense_correct += p["dense_correct"].get<bool>();
  }
  const json report{{"model", model.name},
                    {"context", a.context},
                    {"steps", a.steps},
                    {"seed", a.seed},
                    {"seer_gate", a.seer_gate.empty() ? "training-free" : a.seer_gate},
                    {"dense_needle_accuracy", dense_needles ? double(dense_correct) / dense_needles : -1.0},
                    {"prompts", prompt_info},
                    {"summary", summary},
                    {"results", results},
                    {"seconds", std::chrono::duration<double>(Clock::now() - t0).count()}};
  const std::filesystem::path out(a.out);
  write_text(out / "fidelity.json", report.dump(2) + "\n");
  std::string md = fmt::format(
      "Model {}, context {} tokens, {} teacher-forced decode steps per prompt, {} prompts "
      "({} needles, dense needle accuracy {}/{}).\n\n"
      "| algorithm | budget | top-1 agreement | KL(dense‖sparse) | attention rel. error | needle accuracy | selected tokens/head |\n"
      "|---|---|---|---|---|---|---|\n",
      model.name, a.context, a.steps, prompts.size(), dense_needles, dense_correct, dense_needles);
  for (const json& s : summary) {
    const double needle = s["needle_accuracy"].get<double>();
    md += fmt::format("| {} | {} | {} | {:.4f} | {:.4f} | {} | {:.0f} |\n", s["algorithm"].get<std::string>(),
                      s["budget"].get<std::string>(), fmt_pct(s["top1_agreement"].get<double>()),
                      s["kl_mean"].get<double>(), s["attn_rel_err_mean"].get<double>(),
                      needle < 0 ? std::string("-") : fmt::format("{}/{}", static_cast<int>(std::lround(needle * s["needles"].get<int>())), s["needles"].get<int>()),
                      s["selected_tokens_per_head"].get<double>());
  }
  write_text(out / "fidelity.md", md);
  if (!a.trace.empty()) {
    kv::write_trace(trace, a.trace);
    write_text(a.trace + ".json", trace_requests.dump(2) + "\n");
  }
  std::fputs(md.c_str(), stdout);
}

// ---------------------------------------------------------------- locality

void run_locality(const EvalArgs& a) {
  const kv::SelectionTrace trace = kv::read_trace(a.locality);
  const std::string sidecar = a.locality + ".json";
  std::ifstream in(sidecar);
  SPIN_CHECK(in.good(), "cannot open {} (written next to the trace by spin eval --trace)", sidecar);
  json requests;
  try {
    requests = json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: {}", sidecar, e.what());
  }
  SPIN_CHECK(requests.is_array(), "{}: expected a JSON array", sidecar);
  // Group requests by (algorithm, budget).
  std::map<std::pair<std::string, std::string>, std::set<uint32_t>> groups;
  for (const json& r : requests) {
    SPIN_CHECK(r.is_object() && r.contains("request") && r.contains("algorithm") && r.contains("budget"),
               "{}: malformed entry", sidecar);
    groups[{r["algorithm"].get<std::string>(), r["budget"].get<std::string>()}].insert(r["request"].get<uint32_t>());
  }
  json out = json::array();
  std::string md =
      "| algorithm | budget | mandatory pages/head | policy | 0× | 1× | 2× | 3× | 4× | 5× | 6× | 7× | 8× |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& [key, ids] : groups) {
    kv::SelectionTrace sub;
    sub.page_size = trace.page_size;
    uint32_t mandatory = 0;
    for (const kv::TraceRecord& r : trace.records) {
      if (!ids.count(r.request)) continue;
      sub.add(r.step, r.request, r.layer, r.head, trace.pages_of(r));
      mandatory = std::max(mandatory, r.count);
    }
    if (sub.records.empty() || mandatory == 0) continue;
    for (auto [policy, name] : {std::pair{kv::ReplacementPolicy::BucketedLru, "bucketed-lru"},
                                std::pair{kv::ReplacementPolicy::ExactLru, "exact-lru"},
                                std::pair{kv::ReplacementPolicy::Belady, "belady"}}) {
      json rates = json::array();
      std::string row = fmt::format("| {} | {} | {} | {} |", key.first, key.second, mandatory, name);
      for (uint32_t m = 0; m <= 8; ++m) {  // 0: the selection alone, no buffer
        const double rate = kv::replay_trace(sub, policy, m * mandatory).hit_rate();
        rates.push_back(rate);
        row += fmt::format(" {} |", fmt_pct(rate));
      }
      md += row + "\n";
      out.push_back({{"algorithm", key.first}, {"budget", key.second}, {"policy", name},
                     {"mandatory_pages", mandatory}, {"buffer_multiples", {0, 1, 2, 3, 4, 5, 6, 7, 8}},
                     {"hit_rate", rates}});
    }
  }
  std::filesystem::create_directories(a.out);
  write_text(std::filesystem::path(a.out) / "locality.json", out.dump(2) + "\n");
  write_text(std::filesystem::path(a.out) / "locality.md", md);
  std::fputs(md.c_str(), stdout);
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "fidelity of sparse attention against dense, and cache locality");
  cmd->add_option("-m,--model", args->load.model, ".gguf file, HF directory");
  cmd->add_option("--load-format", args->load.load_format, "auto | gguf | safetensors")->capture_default_str();
  cmd->add_option("--algorithms", args->algorithms, "comma-separated algorithms")->capture_default_str();
  cmd->add_option("--budgets", args->budgets, "budgets as fractions of the context")->capture_default_str();
  cmd->add_option("--context", args->context, "prompt length in tokens")->capture_default_str();
  cmd->add_option("--steps", args->steps, "teacher-forced decode steps per prompt")->capture_default_str();
  cmd->add_option("--depths", args->depths, "needle depths in [0, 1] (empty: no needle prompts)")->capture_default_str();
  cmd->add_option("--documents", args->documents, "long-document continuation prompts")->capture_default_str();
  cmd->add_option("--out", args->out, "output directory (fidelity.json/.md, locality.json/.md)")->capture_default_str();
  cmd->add_option("--trace", args->trace, "record every selection into this trace file (+ FILE.json)");
  cmd->add_option("--locality", args->locality, "replay a recorded trace: hit rate vs buffer size");
  cmd->add_option("-t,--threads", args->threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 4096));
  cmd->add_option("--seed", args->seed, "seed of the generated prompts")->capture_default_str();
  cmd->add_option("--seer-gate", args->seer_gate,
                  "seer: trained gate weights (safetensors, layers.{l}.seer.k_gate / q_gate per layer); default: the "
                  "training-free gate");
  cmd->callback([args] {
    if (!args->locality.empty()) return run_locality(*args);
    SPIN_CHECK(!args->load.model.empty(), "spin eval needs --model (or --locality TRACE)");
    run_eval(*args);
  });
}

}  // namespace spin::cli
