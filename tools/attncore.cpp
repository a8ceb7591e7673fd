// The `attncore` program.
//
//   attncore              a short sweep that checks every backend against the reference and
//                         times it (the default: "does this build work here, and how fast")
//   attncore info         version, CPU, features, SIMD targets, threads, measured FMA peak
//   attncore run [flags]  one configured call: random inputs, best-of-N timing, GFLOP/s,
//                         optional check against the reference backend (--help lists flags)
//   attncore explain [flags]  the backend `auto` picks for the call the run flags describe,
//                         with every backend's verdict and the cost model's estimates
//   attncore bench [flags]  flash against math over sequence lengths; --select: auto's choice
//                         against every backend over a sweep of shapes
//
// Exit codes (DESIGN.md section 7): 0 success, 1 library error (its message on stderr),
// 2 bad usage. With --json, stdout holds exactly one JSON object; diagnostics go to stderr.
//
// FLOPs (DESIGN.md section 5): forward 2*(D + Dv) per visible (query, key) pair and head, that
// is 4*B*Hq*Lq*Lk*D with no mask and Dv = D; backward 2.5x forward. "Visible" counts the pairs
// that causal and window masks leave; a boolean mask is data, not structure, and is not
// discounted (its pairs are counted as visible).
#include "attncore/attncore.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "plot.h"

namespace {

using attncore::Backend;
using attncore::Causal;
using attncore::DType;
using attncore::Tensor;
using attncore::TensorView;

constexpr int kExitOk = 0;
constexpr int kExitLibraryError = 1;
constexpr int kExitUsage = 2;

// A command line the program cannot run: reported with the usage text, exit code 2.
struct UsageError {
  std::string message;
};

// Failed self-checks in the default sweep: exit code 1 (the library computed a wrong result).
struct CheckFailed {
  std::string message;
};

// ---------------------------------------------------------------------------------------------
// Names the command line accepts. Backends and causal kinds use the library's own spellings.

constexpr Backend kBackends[] = {Backend::automatic, Backend::reference, Backend::math,
                                 Backend::flash};
constexpr Causal kCausals[] = {Causal::none, Causal::upper_left, Causal::lower_right};
constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};

enum class MaskKind { none, boolean, additive };
constexpr MaskKind kMaskKinds[] = {MaskKind::none, MaskKind::boolean, MaskKind::additive};

std::string_view name_of(MaskKind m) {
  switch (m) {
    case MaskKind::none:
      return "none";
    case MaskKind::boolean:
      return "bool";
    case MaskKind::additive:
      return "additive";
  }
  return "?";
}
using attncore::name_of;

template <class Enum, std::size_t N>
std::string choices(const Enum (&values)[N]) {
  std::string s;
  for (std::size_t i = 0; i < N; ++i) s += (i ? "," : "") + std::string(name_of(values[i]));
  return s;
}

template <class Enum, std::size_t N>
Enum parse_enum(std::string_view flag, std::string_view text, const Enum (&values)[N]) {
  for (Enum e : values) {
    if (name_of(e) == text) return e;
  }
  throw UsageError{std::string(flag) + ": unknown value '" + std::string(text) +
                   "' (expected one of " + choices(values) + ")"};
}

// ---------------------------------------------------------------------------------------------
// Configuration of one call.

struct RunConfig {
  std::int64_t batch = 1;
  std::int64_t heads_q = 8;      // a typical small model (GPT-2 has 12, BERT-base 12, Llama 32)
  std::int64_t heads_kv = -1;    // -1: = heads_q
  std::int64_t seqlen_q = 1024;  // a common context length: long enough to be compute-bound
  std::int64_t seqlen_k = -1;    // -1: = seqlen_q
  std::int64_t head_dim = 64;    // the most common head dim with 128
  std::int64_t head_dim_v = -1;  // -1: = head_dim
  DType dtype = DType::f32;
  Causal causal = Causal::none;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  double softcap = 0.0;
  bool alibi = false;
  MaskKind mask = MaskKind::none;
  double dropout = 0.0;
  std::uint64_t seed = 0;
  Backend backend = Backend::automatic;
  bool backward = false;
  int threads = 0;   // 0: the library's default (ATTNCORE_NUM_THREADS or all cores)
  std::string simd;  // the flash SIMD target; "": the automatic choice
  int repeat = 3;    // best of 3: enough to skip the first call's page faults
  bool check = false;
  bool json = false;

  // Resolve the "same as" defaults.
  void finish() {
    if (heads_kv < 0) heads_kv = heads_q;
    if (seqlen_k < 0) seqlen_k = seqlen_q;
    if (head_dim_v < 0) head_dim_v = head_dim;
  }
  int resolved_threads() const { return threads > 0 ? threads : attncore::default_num_threads(); }
};

constexpr const char* kUsage = R"(usage:
  attncore                 check and time every backend on a few shapes (the default)
  attncore info            version, CPU, SIMD targets, threads, measured FMA peak
  attncore run [flags]     time (and check) one attention call on random data
  attncore explain [flags] which backend `auto` picks for the call the run flags describe, and
                           why: every backend's verdict, the cost model's estimates and constants
                           (runs nothing; --backend B considers only B; --backward: the backward)
  attncore bench [flags]   fused kernels against math over sequence lengths (bench --help)

run flags (defaults in brackets):
  --batch N                batch size B [1]
  --heads-q N              query heads Hq [8]
  --heads-kv N             key/value heads Hkv, Hq % Hkv == 0 [= heads-q]
  --seqlen-q N             query length Lq [1024]
  --seqlen-k N             key/value length Lk [= seqlen-q]
  --head-dim N             query/key head dim D [64]
  --head-dim-v N           value head dim Dv [= head-dim]
  --dtype T                f32, bf16 or f16 [f32]
  --causal C               none, upper-left or lower-right [none]
  --window L,R             sliding window, -1 = unbounded on that side [-1,-1]
  --softcap X              softcap, 0 = off [0]
  --alibi                  ALiBi with the standard slopes 2^(-8(h+1)/Hq)
  --mask M                 none, bool (random, 90% true) or additive (random in [-2, 0)),
                           shape [Lq, Lk] [none]
  --dropout P              dropout probability [0]
  --seed S                 seed of the random inputs and of dropout [0]
  --backend B              auto, reference, math or flash [auto]
  --backward               also time the backward (with a random dout)
  --threads N              threads, 0 = ATTNCORE_NUM_THREADS or all cores [0]
  --simd T                 the flash kernels' SIMD target: avx512bf16, avx512, avx2 or generic
                           (`attncore info` lists this CPU's) [the best this CPU runs]
  --repeat N               calls timed; the best is reported [3]
  --check                  max abs error against the reference backend in f64
  --json                   print one JSON object on stdout and nothing else
  --help                   this text
)";

// ---------------------------------------------------------------------------------------------
// Command-line parsing.

std::int64_t parse_int(std::string_view flag, std::string_view text, std::int64_t min_value) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' is not an integer"};
  }
  if (v < min_value) {
    throw UsageError{std::string(flag) + ": " + std::string(text) + " is below the minimum " +
                     std::to_string(min_value)};
  }
  return v;
}

std::uint64_t parse_uint(std::string_view flag, std::string_view text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) +
                     "' is not a non-negative integer"};
  }
  return v;
}

double parse_double(std::string_view flag, std::string_view text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' is not a number"};
  }
  return v;
}

int parse_count(std::string_view flag, std::string_view text, int min_value) {
  constexpr std::int64_t kMaxCount = 1 << 20;  // far above any sane thread or repeat count
  const std::int64_t v = parse_int(flag, text, min_value);
  if (v > kMaxCount)
    throw UsageError{std::string(flag) + ": " + std::string(text) + " is too large"};
  return static_cast<int>(v);
}

// Sizes: non-negative (zero is legal: empty problems); the library checks the rest.
constexpr std::int64_t kMinSize = 0;

RunConfig parse_run_flags(const std::vector<std::string>& args) {
  RunConfig c;
  using Setter = std::function<void(std::string_view flag, std::string_view value)>;
  struct Flag {
    const char* name;
    bool takes_value;
    Setter set;
  };
  const Flag flags[] = {
      {"--batch", true, [&](auto f, auto v) { c.batch = parse_int(f, v, kMinSize); }},
      {"--heads-q", true, [&](auto f, auto v) { c.heads_q = parse_int(f, v, kMinSize); }},
      {"--heads-kv", true, [&](auto f, auto v) { c.heads_kv = parse_int(f, v, kMinSize); }},
      {"--seqlen-q", true, [&](auto f, auto v) { c.seqlen_q = parse_int(f, v, kMinSize); }},
      {"--seqlen-k", true, [&](auto f, auto v) { c.seqlen_k = parse_int(f, v, kMinSize); }},
      {"--head-dim", true, [&](auto f, auto v) { c.head_dim = parse_int(f, v, kMinSize); }},
      {"--head-dim-v", true, [&](auto f, auto v) { c.head_dim_v = parse_int(f, v, kMinSize); }},
      {"--dtype", true, [&](auto f, auto v) { c.dtype = parse_enum(f, v, kDTypes); }},
      {"--causal", true, [&](auto f, auto v) { c.causal = parse_enum(f, v, kCausals); }},
      {"--window", true,
       [&](auto f, auto v) {
         const auto comma = v.find(',');
         if (comma == std::string_view::npos) {
           throw UsageError{std::string(f) + ": '" + std::string(v) + "' is not L,R"};
         }
         // The library checks the values (-1 = unbounded, else >= 0).
         c.window_left = parse_int(f, v.substr(0, comma), std::numeric_limits<std::int64_t>::min());
         c.window_right =
             parse_int(f, v.substr(comma + 1), std::numeric_limits<std::int64_t>::min());
       }},
      {"--softcap", true, [&](auto f, auto v) { c.softcap = parse_double(f, v); }},
      {"--alibi", false, [&](auto, auto) { c.alibi = true; }},
      {"--mask", true, [&](auto f, auto v) { c.mask = parse_enum(f, v, kMaskKinds); }},
      {"--dropout", true, [&](auto f, auto v) { c.dropout = parse_double(f, v); }},
      {"--seed", true, [&](auto f, auto v) { c.seed = parse_uint(f, v); }},
      {"--backend", true, [&](auto f, auto v) { c.backend = parse_enum(f, v, kBackends); }},
      {"--backward", false, [&](auto, auto) { c.backward = true; }},
      {"--threads", true, [&](auto f, auto v) { c.threads = parse_count(f, v, 0); }},
      {"--simd", true, [&](auto, auto v) { c.simd = std::string(v); }},
      {"--repeat", true, [&](auto f, auto v) { c.repeat = parse_count(f, v, 1); }},
      {"--check", false, [&](auto, auto) { c.check = true; }},
      {"--json", false, [&](auto, auto) { c.json = true; }},
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    std::optional<std::string_view> inline_value;  // --flag=value
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    const Flag* flag = nullptr;
    for (const Flag& f : flags) {
      if (arg == f.name) flag = &f;
    }
    if (flag == nullptr) throw UsageError{"unknown argument '" + std::string(args[i]) + "'"};
    if (!flag->takes_value) {
      if (inline_value) throw UsageError{std::string(arg) + " takes no value"};
      flag->set(arg, {});
      continue;
    }
    std::string_view value;
    if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < args.size() && !std::string_view(args[i + 1]).starts_with("--")) {
      value = args[++i];
    } else {
      throw UsageError{std::string(arg) + " needs a value"};
    }
    flag->set(arg, value);
  }
  c.finish();
  return c;
}

// ---------------------------------------------------------------------------------------------
// Random inputs: splitmix64 (Steele et al. 2014), so the data is the same on every platform
// (std:: distributions are implementation-defined).

class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  std::uint64_t state_;
};

void store(const TensorView& t, std::int64_t index, double value) {
  switch (t.dtype) {
    case DType::f32:
      static_cast<float*>(t.data)[index] = static_cast<float>(value);
      break;
    case DType::f64:
      static_cast<double*>(t.data)[index] = value;
      break;
    case DType::bf16:
      static_cast<attncore::bf16*>(t.data)[index] = attncore::bf16(static_cast<float>(value));
      break;
    case DType::f16:
      static_cast<attncore::f16*>(t.data)[index] = attncore::f16(static_cast<float>(value));
      break;
    case DType::b8:
      static_cast<std::uint8_t*>(t.data)[index] = value != 0.0;
      break;
  }
}

double load(const TensorView& t, std::int64_t index) {
  switch (t.dtype) {
    case DType::f32:
      return static_cast<const float*>(t.data)[index];
    case DType::f64:
      return static_cast<const double*>(t.data)[index];
    case DType::bf16:
      return static_cast<float>(static_cast<const attncore::bf16*>(t.data)[index]);
    case DType::f16:
      return static_cast<float>(static_cast<const attncore::f16*>(t.data)[index]);
    case DType::b8:
      return static_cast<const std::uint8_t*>(t.data)[index];
  }
  return 0;
}

// Fills a contiguous tensor with uniform values in [lo, hi); `stream` separates the tensors.
void fill_uniform(const Tensor& t, std::uint64_t seed, std::uint64_t stream, double lo, double hi) {
  Random rng(seed ^ (stream * 0xD1B54A32D192ED03ull));
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) store(t, i, lo + (hi - lo) * rng.uniform());
}

// ---------------------------------------------------------------------------------------------
// The problem: inputs, options and FLOP count.

constexpr double kBoolMaskKeep =
    0.9;  // share of true entries: most pairs take part, as with padding

struct Problem {
  RunConfig cfg;
  Tensor q, k, v, dout, mask, alibi;
  attncore::Options options;
};

// The options of a configured call; `alibi` and `mask` are the views of its slopes and mask
// (used when the configuration asks for them).
attncore::Options make_options(const RunConfig& c, const TensorView& alibi,
                               const TensorView& mask) {
  attncore::Options o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  o.dropout_p = c.dropout;
  o.seed = c.seed;
  o.num_threads = c.threads;
  if (c.alibi) o.alibi_slopes = alibi;
  if (c.mask != MaskKind::none) o.mask = mask;
  return o;
}

// The views of a configured call's inputs over `data` (attncore explain reads no data); the
// alibi slopes and the mask have rank 0 when the call has none.
struct CallViews {
  TensorView q, k, v, out, lse, alibi, mask;
};

CallViews call_views(const RunConfig& c, void* data) {
  CallViews w;
  w.q = TensorView::contiguous(data, c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim});
  w.k = TensorView::contiguous(data, c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim});
  w.v = TensorView::contiguous(data, c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim_v});
  w.out = TensorView::contiguous(data, c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v});
  w.lse = TensorView::contiguous(data, DType::f32, {c.batch, c.heads_q, c.seqlen_q});
  if (c.alibi) w.alibi = TensorView::contiguous(data, DType::f32, {c.heads_q});
  if (c.mask != MaskKind::none) {
    w.mask = TensorView::contiguous(data, c.mask == MaskKind::boolean ? DType::b8 : DType::f32,
                                    {c.seqlen_q, c.seqlen_k});
  }
  return w;
}

Tensor allocate_like(const TensorView& t) {
  return t.rank > 0 ? Tensor(t.dtype, t.shape.data(), t.rank) : Tensor();
}

Problem make_problem(const RunConfig& c) {
  Problem p;
  p.cfg = c;
  p.q = Tensor(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim});
  p.k = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim});
  p.v = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim_v});
  // Inputs in [-1, 1): scores of size ~sqrt(D)/3 * scale, a realistic softmax spread.
  fill_uniform(p.q, c.seed, 1, -1, 1);
  fill_uniform(p.k, c.seed, 2, -1, 1);
  fill_uniform(p.v, c.seed, 3, -1, 1);
  if (c.backward) {
    p.dout = Tensor(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v});
    fill_uniform(p.dout, c.seed, 4, -1, 1);
  }
  const CallViews shapes = call_views(c, nullptr);
  p.alibi = allocate_like(shapes.alibi);
  if (c.alibi) {
    // The ALiBi paper's slopes: a geometric sequence starting at 2^(-8/Hq).
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      store(p.alibi, h,
            std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(c.heads_q)));
    }
  }
  p.mask = allocate_like(shapes.mask);
  if (c.mask == MaskKind::boolean) {
    Random rng(c.seed ^ 5);
    for (std::int64_t i = 0; i < p.mask.numel(); ++i)
      store(p.mask, i, rng.uniform() < kBoolMaskKeep);
  } else if (c.mask == MaskKind::additive) {
    fill_uniform(p.mask, c.seed, 6, -2, 0);
  }
  p.options = make_options(c, p.alibi, p.mask);
  return p;
}

// (query, key) pairs of one head that causal and window masks leave visible.
double visible_pairs(const RunConfig& c) {
  const std::int64_t lq = c.seqlen_q, lk = c.seqlen_k, shift = lk - lq;
  double pairs = 0;
  for (std::int64_t i = 0; i < lq; ++i) {
    std::int64_t lo = 0, hi = lk - 1;  // inclusive
    if (c.causal == Causal::upper_left) hi = std::min(hi, i);
    if (c.causal == Causal::lower_right) hi = std::min(hi, i + shift);
    if (c.window_left >= 0) lo = std::max(lo, i + shift - c.window_left);
    if (c.window_right >= 0) hi = std::min(hi, i + shift + c.window_right);
    if (hi >= lo) pairs += static_cast<double>(hi - lo + 1);
  }
  return pairs;
}

double forward_flops(const RunConfig& c) {
  return 2.0 * static_cast<double>(c.head_dim + c.head_dim_v) * static_cast<double>(c.batch) *
         static_cast<double>(c.heads_q) * visible_pairs(c);
}
constexpr double kBackwardFlopFactor = 2.5;  // DESIGN.md section 5

double gflops(double flops, double seconds) {
  return flops > 0 && seconds > 0 ? flops / seconds * 1e-9 : 0.0;
}

// ---------------------------------------------------------------------------------------------
// Timing.

template <class F>
double best_seconds(int repeat, F&& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// Checking against the reference backend in f64.
//
// The reference runs plain fp64 loops, slow on big problems. Above kFullCheckMaxFlops the check
// covers batch 0 and the first query heads only: whole GQA groups (so dk/dv of the checked key
// heads get every contribution) and at least 2 query heads. The dropout stream position of
// (b = 0, h, i, j) does not depend on B or Hq, so the slice sees the same dropout mask.

// ~0.4 s of reference forward (~2.6 GFLOP/s measured on 2 Zen 5 cores), ~1 s with backward.
constexpr double kFullCheckMaxFlops = 1e9;

struct CheckScope {
  std::int64_t batch, heads_q, heads_kv;
  bool full;
  std::string describe() const {
    if (full) return "all";
    return "batch 0, query heads 0-" + std::to_string(heads_q - 1) + ", key/value heads 0-" +
           std::to_string(heads_kv - 1);
  }
};

CheckScope check_scope(const RunConfig& c) {
  const double all_pairs = static_cast<double>(c.batch) * static_cast<double>(c.heads_q) *
                           static_cast<double>(c.seqlen_q) * static_cast<double>(c.seqlen_k);
  const double cost = 2.0 * static_cast<double>(c.head_dim + c.head_dim_v) * all_pairs;
  if (cost <= kFullCheckMaxFlops || c.heads_kv == 0 || c.heads_q % c.heads_kv != 0) {
    return {c.batch, c.heads_q, c.heads_kv, true};
  }
  constexpr std::int64_t kMinHeads = 2;
  const std::int64_t group = c.heads_q / c.heads_kv;
  const std::int64_t groups = std::min(c.heads_kv, (kMinHeads + group - 1) / group);
  CheckScope s{std::min<std::int64_t>(c.batch, 1), groups * group, groups, false};
  s.full = s.batch == c.batch && s.heads_q == c.heads_q;
  return s;
}

// The leading [batch, heads] block of a [B, H, ...] view.
TensorView leading(const TensorView& t, std::int64_t batch, std::int64_t heads) {
  TensorView s = t;
  s.shape[0] = batch;
  s.shape[1] = heads;
  return s;
}

constexpr int kMaxDims = attncore::kMaxRank;

// Offsets of every element of a strided view, in row-major order.
template <class F>
void for_each_offset(const TensorView& t, F&& f) {
  std::int64_t n[kMaxDims] = {1, 1, 1, 1}, st[kMaxDims] = {0, 0, 0, 0};
  for (int d = 0; d < t.rank; ++d) {
    n[kMaxDims - t.rank + d] = t.size(d);
    st[kMaxDims - t.rank + d] = t.stride_of(d);
  }
  for (std::int64_t a = 0; a < n[0]; ++a)
    for (std::int64_t b = 0; b < n[1]; ++b)
      for (std::int64_t c = 0; c < n[2]; ++c)
        for (std::int64_t d = 0; d < n[3]; ++d) f(a * st[0] + b * st[1] + c * st[2] + d * st[3]);
}

Tensor to_f64(const TensorView& t) {
  Tensor out(DType::f64, t.shape.data(), t.rank);
  std::int64_t i = 0;
  for_each_offset(t, [&](std::int64_t off) { store(out, i++, load(t, off)); });
  return out;
}

// The larger of two errors, NaN if either is NaN (a NaN result is never "small").
double max_err(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return std::max(a, b);
}

// max |a - b| over a strided view `a` and a contiguous f64 tensor `b` of the same shape.
double max_abs_diff(const TensorView& a, const Tensor& b) {
  double err = 0;
  std::int64_t i = 0;
  for_each_offset(
      a, [&](std::int64_t off) { err = max_err(err, std::abs(load(a, off) - load(b, i++))); });
  return err;
}

struct CheckResult {
  std::string scope;  // what was checked
  bool full = true;   // all of it
  double out_err = 0;
  std::optional<double> grad_err;  // max over dq, dk, dv
};

CheckResult check_against_reference(const Problem& p, const TensorView& out, const Tensor* dq,
                                    const Tensor* dk, const Tensor* dv) {
  const RunConfig& c = p.cfg;
  const CheckScope s = check_scope(c);
  const Tensor q = to_f64(leading(p.q, s.batch, s.heads_q));
  const Tensor k = to_f64(leading(p.k, s.batch, s.heads_kv));
  const Tensor v = to_f64(leading(p.v, s.batch, s.heads_kv));
  attncore::Options o = p.options;
  if (o.alibi_slopes) o.alibi_slopes->shape[0] = s.heads_q;  // [Hq]: the first heads' slopes
  const attncore::ForwardResult ref = attncore::forward(q, k, v, o, Backend::reference);
  CheckResult r;
  r.scope = s.describe();
  r.full = s.full;
  r.out_err = max_abs_diff(leading(out, s.batch, s.heads_q), ref.out);
  if (dq != nullptr) {
    const Tensor dout = to_f64(leading(p.dout, s.batch, s.heads_q));
    const attncore::BackwardResult g =
        attncore::backward(dout, q, k, v, ref.out, ref.lse, o, Backend::reference);
    r.grad_err = max_err(max_abs_diff(leading(*dq, s.batch, s.heads_q), g.dq),
                         max_err(max_abs_diff(leading(*dk, s.batch, s.heads_kv), g.dk),
                                 max_abs_diff(leading(*dv, s.batch, s.heads_kv), g.dv)));
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// One timed (and optionally checked) call.

struct RunResult {
  double flops = 0, seconds = 0;
  double bwd_flops = 0, bwd_seconds = 0;
  std::optional<CheckResult> check;
};

RunResult run_once(const Problem& p) {
  const RunConfig& c = p.cfg;
  Tensor out(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v});
  Tensor lse(DType::f32, {c.batch, c.heads_q, c.seqlen_q});
  RunResult r;
  r.flops = forward_flops(c);
  r.seconds = best_seconds(c.repeat, [&] {
    attncore::forward_into(p.q, p.k, p.v, out, lse.view(), p.options, c.backend);
  });
  Tensor dq, dk, dv;
  if (c.backward) {
    dq = Tensor(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim});
    dk = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim});
    dv = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim_v});
    r.bwd_flops = kBackwardFlopFactor * r.flops;
    r.bwd_seconds = best_seconds(c.repeat, [&] {
      attncore::backward_into(p.dout, p.q, p.k, p.v, out, lse, dq, dk, dv, std::nullopt, p.options,
                              c.backend);
    });
  }
  if (c.check) {
    r.check = c.backward ? check_against_reference(p, out, &dq, &dk, &dv)
                         : check_against_reference(p, out, nullptr, nullptr, nullptr);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// JSON output: one object, keys in insertion order.

class JsonObject {
 public:
  void add(const char* key, std::string_view s) {
    std::string quoted = "\"";
    for (char ch : s) {
      if (ch == '"' || ch == '\\') {
        quoted += '\\';
        quoted += ch;
      } else if (static_cast<unsigned char>(ch) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", ch);
        quoted += buf;
      } else {
        quoted += ch;
      }
    }
    raw(key, quoted + "\"");
  }
  void add(const char* key, const char* s) { add(key, std::string_view(s)); }
  void add(const char* key, bool b) { raw(key, b ? "true" : "false"); }
  void add(const char* key, std::int64_t i) { raw(key, std::to_string(i)); }
  void add(const char* key, std::uint64_t i) { raw(key, std::to_string(i)); }
  void add(const char* key, int i) { raw(key, std::to_string(i)); }
  // Non-finite numbers have no JSON form: written as the strings "nan", "inf", "-inf".
  void add(const char* key, double d) {
    if (std::isnan(d)) return add(key, "nan");
    if (std::isinf(d)) return add(key, d > 0 ? "inf" : "-inf");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", d);
    raw(key, buf);
  }
  void add(const char* key, std::optional<double> d) {
    if (d) return add(key, *d);
    raw(key, "null");
  }
  // `json`: a value already in JSON form (an object, an array).
  void add_json(const char* key, const std::string& json) { raw(key, json); }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void raw(const char* key, const std::string& value) {
    if (!body_.empty()) body_ += ", ";
    body_ += "\"" + std::string(key) + "\": " + value;
  }
  std::string body_;
};

// ---------------------------------------------------------------------------------------------
// attncore run

std::string shape_text(const RunConfig& c) {
  std::ostringstream s;
  s << "B=" << c.batch << " Hq=" << c.heads_q << " Hkv=" << c.heads_kv << " Lq=" << c.seqlen_q
    << " Lk=" << c.seqlen_k << " D=" << c.head_dim << " Dv=" << c.head_dim_v;
  return s.str();
}

std::string format(const char* fmt, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

// Whether the flags ask for the command's usage text.
bool asks_for_help(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

// The call's dtype and shape, as `run --json` and `explain --json` report them.
void add_shape(JsonObject& j, const RunConfig& c) {
  j.add("dtype", name_of(c.dtype));
  j.add("batch", c.batch);
  j.add("heads_q", c.heads_q);
  j.add("heads_kv", c.heads_kv);
  j.add("seqlen_q", c.seqlen_q);
  j.add("seqlen_k", c.seqlen_k);
  j.add("head_dim", c.head_dim);
  j.add("head_dim_v", c.head_dim_v);
  j.add("causal", name_of(c.causal));
}

int cmd_run(const std::vector<std::string>& args) {
  if (asks_for_help(args)) {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  const RunConfig c = parse_run_flags(args);
  attncore::set_simd_target(c.simd);  // "" = the automatic choice
  const Problem p = make_problem(c);
  const RunResult r = run_once(p);
  const int threads = c.resolved_threads();
  const double peak = attncore::measure_fma_peak_gflops(threads);
  const double fwd_gflops = gflops(r.flops, r.seconds);
  const double bwd_gflops = gflops(r.bwd_flops, r.bwd_seconds);
  std::optional<double> err, grad_err;
  if (r.check) {
    err = r.check->out_err;
    grad_err = r.check->grad_err;
  }

  if (c.json) {
    JsonObject j;
    j.add("version", attncore::version());
    j.add("backend", name_of(c.backend));
    add_shape(j, c);
    j.add("window_left", c.window_left);
    j.add("window_right", c.window_right);
    j.add("softcap", c.softcap);
    j.add("alibi", c.alibi);
    j.add("mask", name_of(c.mask));
    j.add("dropout", c.dropout);
    j.add("seed", c.seed);
    j.add("threads", threads);
    j.add("simd", attncore::simd_target());
    j.add("repeat", c.repeat);
    j.add("flops", r.flops);
    j.add("flop_count", "2*(D+Dv) per causal/window-visible pair; bool mask not discounted");
    j.add("seconds", r.seconds);
    j.add("gflops", fwd_gflops);
    j.add("peak_gflops", peak);
    j.add("percent_of_peak", peak > 0 ? 100 * fwd_gflops / peak : 0.0);
    if (c.backward) {
      j.add("bwd_flops", r.bwd_flops);
      j.add("bwd_seconds", r.bwd_seconds);
      j.add("bwd_gflops", bwd_gflops);
      j.add("bwd_percent_of_peak", peak > 0 ? 100 * bwd_gflops / peak : 0.0);
    }
    j.add("max_abs_err", err);
    if (c.backward) j.add("max_abs_err_grad", grad_err);
    if (r.check) {
      j.add("checked", r.check->scope);
    } else {
      j.add("checked", std::optional<double>());
    }
    std::printf("%s\n", j.str().c_str());
    return kExitOk;
  }

  std::printf("attncore run: backend=%s dtype=%s %s causal=%s threads=%d\n",
              std::string(name_of(c.backend)).c_str(), std::string(name_of(c.dtype)).c_str(),
              shape_text(c).c_str(), std::string(name_of(c.causal)).c_str(), threads);
  std::printf(
      "forward:   best of %d: %.3f ms, %.1f GFLOP/s (%.1f%% of the measured %.0f GFLOP/s FMA "
      "peak)\n",
      c.repeat, r.seconds * 1e3, fwd_gflops, peak > 0 ? 100 * fwd_gflops / peak : 0.0, peak);
  if (c.backward) {
    std::printf("backward:  best of %d: %.3f ms, %.1f GFLOP/s (%.1f%% of peak)\n", c.repeat,
                r.bwd_seconds * 1e3, bwd_gflops, peak > 0 ? 100 * bwd_gflops / peak : 0.0);
  }
  if (r.check) {
    std::printf("check:     max_abs_err %.3g", r.check->out_err);
    if (r.check->grad_err) std::printf(", max_abs_err_grad %.3g", *r.check->grad_err);
    std::printf(" (against reference in f64; checked: %s)\n", r.check->scope.c_str());
  }
  std::printf(
      "flops:     %.4g forward: 2*(D+Dv) per causal/window-visible pair, bool mask not "
      "discounted%s\n",
      r.flops, c.backward ? "; backward 2.5x forward" : "");
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// attncore explain

// A JSON array of JSON values.
std::string json_array(const std::vector<std::string>& items) {
  std::string s = "[";
  for (std::size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s + "]";
}

// A JSON string (JsonObject's quoting).
std::string json_string(std::string_view text) {
  JsonObject o;
  o.add("s", text);
  const std::string object = o.str();  // {"s": "..."}
  return object.substr(6, object.size() - 7);
}

int cmd_explain(const std::vector<std::string>& args) {
  if (asks_for_help(args)) {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  const RunConfig c = parse_run_flags(args);
  attncore::set_simd_target(c.simd);
  // The views point at one byte: explain validates shapes and strides and reads no data.
  static char no_data;
  const CallViews w = call_views(c, &no_data);
  const attncore::Options options = make_options(c, w.alibi, w.mask);
  std::optional<attncore::BackendScope> only;  // --backend B: B alone is considered
  if (c.backend != Backend::automatic) only.emplace(std::vector<Backend>{c.backend});
  const attncore::Explanation e =
      c.backward ? attncore::explain_backward(w.out, w.q, w.k, w.v, w.out, w.lse, options)
                 : attncore::explain_forward(w.q, w.k, w.v, options);
  const attncore::CostConstants k = attncore::cost_constants();
  const int threads = c.resolved_threads();
  const char* pass = c.backward ? "backward" : "forward";

  if (c.json) {
    JsonObject j;
    j.add("version", attncore::version());
    j.add("pass", pass);
    add_shape(j, c);
    j.add("threads", threads);
    std::vector<std::string> enabled;
    for (Backend b : attncore::enabled_backends()) enabled.push_back(json_string(name_of(b)));
    j.add_json("enabled", json_array(enabled));
    if (e.chosen == Backend::automatic) {
      j.add("chosen", std::optional<double>());
    } else {
      j.add("chosen", name_of(e.chosen));
    }
    std::vector<std::string> verdicts;
    for (const attncore::BackendVerdict& v : e.verdicts) {
      JsonObject o;
      o.add("backend", name_of(v.backend));
      o.add("enabled", v.enabled);
      o.add("can_run", v.reasons.empty());
      std::vector<std::string> reasons;
      for (const std::string& r : v.reasons) reasons.push_back(json_string(r));
      o.add_json("reasons", json_array(reasons));
      o.add("estimated_seconds", v.estimated_seconds >= 0
                                     ? std::optional<double>(v.estimated_seconds)
                                     : std::optional<double>());
      verdicts.push_back(o.str());
    }
    j.add_json("verdicts", json_array(verdicts));
    JsonObject constants;
    constants.add("fma_gflops", k.fma_gflops);
    constants.add("memory_gbps", k.memory_gbps);
    constants.add("softmax_per_s", k.softmax_per_s);
    constants.add("dispatch_seconds", k.dispatch_seconds);
    constants.add("measure_seconds", k.measure_seconds);
    j.add_json("constants", constants.str());
    std::printf("%s\n", j.str().c_str());
    return kExitOk;
  }

  std::printf("attncore explain: %s, dtype=%s %s causal=%s threads=%d\n", pass,
              std::string(name_of(c.dtype)).c_str(), shape_text(c).c_str(),
              std::string(name_of(c.causal)).c_str(), threads);
  std::printf("%s", e.summary().c_str());
  std::printf(
      "cost model: f32 FMA %.0f GFLOP/s per thread, memory %.1f GB/s per thread, softmax "
      "%.0f M elements/s per thread, thread pool wake-up %.1f us (measured in %.0f ms at first "
      "use)\n",
      k.fma_gflops, k.memory_gbps, k.softmax_per_s * 1e-6, k.dispatch_seconds * 1e6,
      k.measure_seconds * 1e3);
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// attncore info

std::string join(const std::vector<std::string>& words) {
  std::string s;
  for (const std::string& w : words) {
    if (!s.empty()) s += ' ';
    s += w;
  }
  return s;
}

int cmd_info(const std::vector<std::string>& args) {
  if (!args.empty()) throw UsageError{"info takes no arguments (got '" + args[0] + "')"};
  const attncore::CpuInfo cpu = attncore::cpu_info();
  const std::string features = join(cpu.features);
  const std::string compiled = join(attncore::simd_targets_compiled());
  const std::string supported = join(attncore::simd_targets_supported());
  const int threads = attncore::default_num_threads();
  std::printf("attncore %s\n", attncore::version());
  std::printf("cpu:       %s, %s, %d logical cores\n",
              cpu.vendor.empty() ? "unknown vendor" : cpu.vendor.c_str(),
              cpu.brand.empty() ? "unknown model" : cpu.brand.c_str(), cpu.logical_cores);
  std::printf("features:  %s\n", features.empty() ? "(none detected)" : features.c_str());
  std::printf("simd:      compiled: %s; this cpu: %s; chosen: %s\n", compiled.c_str(),
              supported.c_str(), attncore::simd_target().c_str());
  std::printf("blas:      %s (math backend GEMMs)\n", attncore::blas_info().c_str());
  std::printf("threads:   %d (ATTNCORE_NUM_THREADS, else all cores)\n", threads);
  std::fflush(stdout);
  const double peak1 = attncore::measure_fma_peak_gflops(1);
  const double peak_all = threads > 1 ? attncore::measure_fma_peak_gflops(threads) : peak1;
  std::printf(
      "fma peak:  %.1f GFLOP/s f32 with 1 thread, %.1f GFLOP/s with %d threads (measured now)\n",
      peak1, peak_all, threads);
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// attncore (no arguments): the default sweep.

// Largest tolerated max |out - reference| per dtype, for outputs of magnitude <= 1 (the inputs
// are uniform in [-1, 1)): f32 leaves room for accumulation-order differences (~1e-7 seen),
// bf16 and f16 for a few roundings to their 8-bit / 11-bit mantissas (2^-8 = 3.9e-3,
// 2^-11 = 4.9e-4; ~1.9e-3 and ~2.4e-4 seen). Gradients are sums over a row or column and
// reach a few units: kGradTolerance times more (bf16: ~7.7e-3 seen at L=128, D=128).
double tolerance(DType t) {
  switch (t) {
    case DType::bf16:
      return 2e-2;
    case DType::f16:
      return 3e-3;
    default:
      return 1e-4;
  }
}
constexpr double kGradTolerance = 4.0;

struct SweepCase {
  std::int64_t seqlen, head_dim;
  Causal causal;
  DType dtype;
};

// B = 1, Hq = Hkv = 8: small enough that the whole sweep takes seconds on 2 cores.
constexpr std::int64_t kSweepHeads = 8;
// The reference backend (fp64 loops, ~2.5 GFLOP/s on 2 cores) is timed only up to this length;
// it checks every row.
constexpr std::int64_t kReferenceMaxSeqlen = 256;

int cmd_default() {
  const SweepCase cases[] = {
      {128, 64, Causal::none, DType::f32},           {128, 128, Causal::lower_right, DType::bf16},
      {256, 64, Causal::lower_right, DType::f32},    {256, 128, Causal::none, DType::f16},
      {512, 64, Causal::none, DType::bf16},          {512, 128, Causal::lower_right, DType::f32},
      {1024, 64, Causal::lower_right, DType::bf16},  {1024, 128, Causal::none, DType::f32},
      {1024, 128, Causal::lower_right, DType::bf16},
  };
  struct Row {
    SweepCase sc;
    Backend backend;
  };
  std::vector<Row> rows;
  for (const SweepCase& sc : cases) {
    if (sc.seqlen <= kReferenceMaxSeqlen) rows.push_back({sc, Backend::reference});
    rows.push_back({sc, Backend::math});
    rows.push_back({sc, Backend::flash});
  }

  const int threads = attncore::default_num_threads();
  std::fprintf(stderr, "measuring the FMA peak ...");
  const double peak = attncore::measure_fma_peak_gflops(threads);
  std::printf(
      "attncore %s: forward and backward, B=1 Hq=Hkv=%lld, Lq=Lk, Dv=D, checked against the "
      "reference in f64\n%d threads, measured f32 FMA peak %.0f GFLOP/s\n\n",
      attncore::version(), static_cast<long long>(kSweepHeads), threads, peak);
  std::printf("%-12s %-12s %-5s %-10s %-4s %9s %9s %7s %9s  %s\n", "shape", "causal", "dtype",
              "backend", "pass", "ms", "GFLOP/s", "%peak", "max_err", "");
  int failures = 0, checks = 0;
  std::size_t progress_width = 0;
  for (std::size_t n = 0; n < rows.size(); ++n) {
    const Row& row = rows[n];
    RunConfig c;
    c.heads_q = kSweepHeads;
    c.seqlen_q = row.sc.seqlen;
    c.head_dim = row.sc.head_dim;
    c.causal = row.sc.causal;
    c.dtype = row.sc.dtype;
    c.backend = row.backend;
    c.backward = true;
    c.check = true;
    c.repeat = row.backend == Backend::reference ? 1 : 3;  // the reference is slow and not tuned
    c.finish();
    const std::string shape =
        "L=" + std::to_string(c.seqlen_q) + " D=" + std::to_string(c.head_dim);
    char progress[160];
    std::snprintf(progress, sizeof progress, "\r[%zu/%zu] %s %s %s %s", n + 1, rows.size(),
                  shape.c_str(), std::string(name_of(c.causal)).c_str(),
                  std::string(name_of(c.dtype)).c_str(), std::string(name_of(c.backend)).c_str());
    const std::size_t width = std::strlen(progress);
    const int pad = static_cast<int>(progress_width > width ? progress_width - width : 0);
    std::fprintf(stderr, "%s%*s", progress, pad, "");
    progress_width = std::max(progress_width, width);
    std::fflush(stderr);

    const Problem p = make_problem(c);
    const RunResult r = run_once(p);
    const std::string dims = std::to_string(c.seqlen_q) + "x" + std::to_string(c.head_dim);
    auto print_row = [&](const char* pass, double flops, double seconds, double err, double tol) {
      const double g = gflops(flops, seconds);
      const bool ok = err <= tol;  // false for NaN
      ++checks;
      failures += ok ? 0 : 1;
      const std::string status = ok ? "ok" : "FAIL (tolerance " + format("%.0e", tol) + ")";
      std::printf("%-12s %-12s %-5s %-10s %-4s %9.3f %9.1f %6.1f%% %9.2e%s %s\n", dims.c_str(),
                  std::string(name_of(c.causal)).c_str(), std::string(name_of(c.dtype)).c_str(),
                  std::string(name_of(c.backend)).c_str(), pass, seconds * 1e3, g,
                  peak > 0 ? 100 * g / peak : 0.0, err, r.check->full ? " " : "*", status.c_str());
    };
    print_row("fwd", r.flops, r.seconds, r.check->out_err, tolerance(c.dtype));
    if (c.backward) {
      print_row("bwd", r.bwd_flops, r.bwd_seconds, *r.check->grad_err,
                kGradTolerance * tolerance(c.dtype));
    }
    std::fflush(stdout);
  }
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(progress_width), "");
  std::printf(
      "\nshape = L x D. FLOPs: forward 4*B*Hq*D per visible pair, backward 2.5x forward.\n"
      "max_err: max |result - reference| of out (fwd) and of dq, dk, dv (bwd);\n"
      "* = the first 2 heads only (the reference is slow on large problems).\n");
  if (failures > 0) {
    throw CheckFailed{std::to_string(failures) + " of " + std::to_string(checks) +
                      " results differ from the reference by more than the tolerance"};
  }
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// attncore bench: the fused kernels against math over sequence lengths.

constexpr const char* kBenchUsage = R"(usage: attncore bench [flags]
  --seqlens L,L,...        sequence lengths, Lq = Lk [512,1024,2048,4096]
  --batch N                batch size [1]
  --heads-q N              query heads [16]
  --heads-kv N             key/value heads [= heads-q]
  --head-dim N             head dim, D = Dv [128]
  --dtypes T,T             f32, bf16, f16 [f32,bf16]
  --causal C,C             none, upper-left, lower-right [none,lower-right]
  --threads N              threads, 0 = ATTNCORE_NUM_THREADS or all cores [0]
  --simd T                 the flash kernels' SIMD target (as for run) [the best this CPU runs]
  --repeat N               calls timed per point; the best counts [3]
  --backward               also time the backward (a row per point, pass "bwd");
                           with --select: time the backward instead of the forward
  --select                 instead: a fixed sweep of shapes (tiny to long, decode, causal;
                           f32 and bf16), each backend and auto's choice timed in --passes
                           interleaved passes (median), and auto's time over the best one's
  --passes N               with --select: interleaved passes per shape [3]
  --csv FILE               also write the table as CSV
  --json FILE              also write it as JSON
  --png FILE               also plot GFLOP/s against sequence length
)";

struct BenchConfig {
  std::vector<std::int64_t> seqlens = {512, 1024, 2048, 4096};
  std::int64_t batch = 1, heads_q = 16, heads_kv = -1, head_dim = 128;
  std::vector<DType> dtypes = {DType::f32, DType::bf16};
  std::vector<Causal> causals = {Causal::none, Causal::lower_right};
  int threads = 0, repeat = 3, passes = 3;
  bool backward = false, select = false;
  std::string simd, csv, json, png;
};

std::vector<std::string_view> split_commas(std::string_view text) {
  std::vector<std::string_view> parts;
  for (std::size_t at = 0;;) {
    const std::size_t comma = text.find(',', at);
    parts.push_back(text.substr(at, comma == std::string_view::npos ? comma : comma - at));
    if (comma == std::string_view::npos) return parts;
    at = comma + 1;
  }
}

BenchConfig parse_bench_flags(const std::vector<std::string>& args) {
  BenchConfig c;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--backward") {
      c.backward = true;
      continue;
    }
    if (flag == "--select") {
      c.select = true;
      continue;
    }
    if (i + 1 >= args.size()) throw UsageError{flag + " needs a value (or is unknown)"};
    const std::string_view value = args[++i];
    if (flag == "--seqlens") {
      c.seqlens.clear();
      for (std::string_view part : split_commas(value))
        c.seqlens.push_back(parse_int(flag, part, 1));
    } else if (flag == "--batch") {
      c.batch = parse_int(flag, value, 1);
    } else if (flag == "--heads-q") {
      c.heads_q = parse_int(flag, value, 1);
    } else if (flag == "--heads-kv") {
      c.heads_kv = parse_int(flag, value, 1);
    } else if (flag == "--head-dim") {
      c.head_dim = parse_int(flag, value, 1);
    } else if (flag == "--dtypes") {
      c.dtypes.clear();
      for (std::string_view part : split_commas(value))
        c.dtypes.push_back(parse_enum(flag, part, kDTypes));
    } else if (flag == "--causal") {
      c.causals.clear();
      for (std::string_view part : split_commas(value))
        c.causals.push_back(parse_enum(flag, part, kCausals));
    } else if (flag == "--threads") {
      c.threads = parse_count(flag, value, 0);
    } else if (flag == "--repeat") {
      c.repeat = parse_count(flag, value, 1);
    } else if (flag == "--simd") {
      c.simd = value;
    } else if (flag == "--passes") {
      c.passes = parse_count(flag, value, 1);
    } else if (flag == "--csv") {
      c.csv = value;
    } else if (flag == "--json") {
      c.json = value;
    } else if (flag == "--png") {
      c.png = value;
    } else {
      throw UsageError{"unknown bench flag '" + flag + "'"};
    }
  }
  if (c.heads_kv < 0) c.heads_kv = c.heads_q;
  return c;
}

struct BenchRow {
  std::int64_t seqlen;
  DType dtype;
  Causal causal;
  Backend backend;
  const char* pass;                 // "fwd" or "bwd"
  double seconds, gflops, speedup;  // speedup: math's time / this time, same shape and pass
};

// attncore bench --select: does `auto` pick the fastest backend? Each shape's problem is built
// once; every pass times flash, math and auto one after the other (best of --repeat calls
// each), and each backend's time is its median over the passes.
int cmd_bench_select(const BenchConfig& bc) {
  struct SelectShape {
    const char* name;
    std::int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
    Causal causal;
  };
  constexpr SelectShape kShapes[] = {
      {"tiny", 1, 1, 1, 16, 16, 64, Causal::none},
      {"small", 1, 8, 8, 32, 32, 64, Causal::none},
      {"L=64", 1, 8, 8, 64, 64, 64, Causal::none},
      {"short", 1, 8, 8, 128, 128, 64, Causal::none},
      {"decode Lk=128", 1, 8, 8, 1, 128, 128, Causal::lower_right},
      {"decode GQA", 4, 32, 8, 1, 4096, 128, Causal::lower_right},
      {"L=512", 1, 16, 16, 512, 512, 128, Causal::none},
      {"long", 1, 16, 16, 2048, 2048, 128, Causal::none},
      {"long causal", 1, 16, 16, 2048, 2048, 128, Causal::lower_right},
  };
  constexpr DType kSelectDTypes[] = {DType::f32, DType::bf16};
  const Backend timed[] = {Backend::flash, Backend::math, Backend::automatic};
  const int threads = bc.threads > 0 ? bc.threads : attncore::default_num_threads();
  const char* pass = bc.backward ? "backward" : "forward";
  std::printf(
      "attncore %s bench --select: %s, %d threads, median of %d interleaved passes of best of "
      "%d calls\n\n",
      attncore::version(), pass, threads, bc.passes, bc.repeat);
  std::printf("%-14s %-5s %-26s %10s %10s %10s  %-6s %-6s %12s %9s\n", "shape", "dtype",
              "B Hq Hkv Lq Lk D", "flash ms", "math ms", "auto ms", "auto", "best", "choice/best",
              "auto/best");
  double worst = 0, worst_auto = 0;
  for (const SelectShape& sh : kShapes) {
    for (DType dtype : kSelectDTypes) {
      RunConfig c;
      c.batch = sh.batch;
      c.heads_q = sh.heads_q;
      c.heads_kv = sh.heads_kv;
      c.seqlen_q = sh.seqlen_q;
      c.seqlen_k = sh.seqlen_k;
      c.head_dim = sh.head_dim;
      c.causal = sh.causal;
      c.dtype = dtype;
      c.threads = threads;
      c.repeat = bc.repeat;
      c.backward = bc.backward;
      c.finish();
      Problem p = make_problem(c);
      static char no_data;
      const CallViews w = call_views(c, &no_data);
      const Backend chosen =
          bc.backward
              ? attncore::explain_backward(w.out, w.q, w.k, w.v, w.out, w.lse, p.options).chosen
              : attncore::explain_forward(w.q, w.k, w.v, p.options).chosen;
      std::vector<double> times[std::size(timed)];
      for (int n = 0; n < bc.passes; ++n) {
        for (std::size_t b = 0; b < std::size(timed); ++b) {
          p.cfg.backend = timed[b];
          const RunResult r = run_once(p);
          times[b].push_back(bc.backward ? r.bwd_seconds : r.seconds);
        }
      }
      double median[std::size(timed)];
      for (std::size_t b = 0; b < std::size(timed); ++b) {
        std::sort(times[b].begin(), times[b].end());
        median[b] = times[b][times[b].size() / 2];
      }
      const std::size_t best = median[0] <= median[1] ? 0 : 1;
      const std::size_t choice = chosen == Backend::flash ? 0 : chosen == Backend::math ? 1 : 2;
      const double ratio = median[choice] / median[best];  // the chosen backend's own timings
      const double auto_ratio = median[2] / median[best];
      worst = std::max(worst, ratio);
      worst_auto = std::max(worst_auto, auto_ratio);
      char dims[64];
      std::snprintf(dims, sizeof dims, "%lld %lld %lld %lld %lld %lld",
                    static_cast<long long>(c.batch), static_cast<long long>(c.heads_q),
                    static_cast<long long>(c.heads_kv), static_cast<long long>(c.seqlen_q),
                    static_cast<long long>(c.seqlen_k), static_cast<long long>(c.head_dim));
      std::printf("%-14s %-5s %-26s %10.4f %10.4f %10.4f  %-6s %-6s %11.2fx %8.2fx\n", sh.name,
                  std::string(name_of(dtype)).c_str(), dims, median[0] * 1e3, median[1] * 1e3,
                  median[2] * 1e3, std::string(name_of(chosen)).c_str(),
                  std::string(name_of(timed[best])).c_str(), ratio, auto_ratio);
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nauto: the backend `auto` chose (attncore explain); best: the faster of flash and math "
      "here;\nchoice/best: the chosen backend's time over the best one's (worst %.2fx);\n"
      "auto/best: auto's own time (the choice and its call) over the best one's, measured in "
      "the same passes (worst %.2fx).\n",
      worst, worst_auto);
  return kExitOk;
}

int cmd_bench(const std::vector<std::string>& args) {
  if (asks_for_help(args)) {
    std::fputs(kBenchUsage, stdout);
    return kExitOk;
  }
  const BenchConfig bc = parse_bench_flags(args);
  attncore::set_simd_target(bc.simd);
  if (bc.select) return cmd_bench_select(bc);
  const int threads = bc.threads > 0 ? bc.threads : attncore::default_num_threads();
  std::fprintf(stderr, "measuring the FMA peak ...");
  const double peak = attncore::measure_fma_peak_gflops(threads);
  std::fprintf(stderr, "\r%*s\r", 28, "");
  const Backend backends[] = {Backend::math, Backend::flash};
  const std::size_t total =
      bc.seqlens.size() * bc.dtypes.size() * bc.causals.size() * std::size(backends);
  std::printf(
      "attncore %s bench: B=%lld Hq=%lld Hkv=%lld D=%lld, Lq = Lk, forward, %d threads, "
      "measured f32 FMA peak %.0f GFLOP/s (simd %s)\n\n",
      attncore::version(), static_cast<long long>(bc.batch), static_cast<long long>(bc.heads_q),
      static_cast<long long>(bc.heads_kv), static_cast<long long>(bc.head_dim), threads, peak,
      attncore::simd_target().c_str());
  std::printf("%8s %-5s %-12s %-7s %-4s %10s %9s %7s %8s\n", "L", "dtype", "causal", "backend",
              "pass", "ms", "GFLOP/s", "%peak", "vs math");
  std::vector<BenchRow> rows;
  std::size_t done = 0;
  for (DType dtype : bc.dtypes) {
    for (Causal causal : bc.causals) {
      for (std::int64_t seqlen : bc.seqlens) {
        double math_seconds = 0, math_bwd_seconds = 0;
        for (Backend backend : backends) {
          constexpr int kBarWidth = 30;
          const int filled = static_cast<int>(kBarWidth * done / total);
          std::fprintf(stderr, "\r[%s%s] %zu/%zu L=%lld %s %s %s   ",
                       std::string(filled, '#').c_str(),
                       std::string(kBarWidth - filled, '.').c_str(), done, total,
                       static_cast<long long>(seqlen), std::string(name_of(dtype)).c_str(),
                       std::string(name_of(causal)).c_str(), std::string(name_of(backend)).c_str());
          std::fflush(stderr);
          RunConfig c;
          c.batch = bc.batch;
          c.heads_q = bc.heads_q;
          c.heads_kv = bc.heads_kv;
          c.seqlen_q = seqlen;
          c.head_dim = bc.head_dim;
          c.dtype = dtype;
          c.causal = causal;
          c.backend = backend;
          c.threads = threads;
          c.repeat = bc.repeat;
          c.backward = bc.backward;
          c.finish();
          const RunResult r = run_once(make_problem(c));
          if (backend == Backend::math) {
            math_seconds = r.seconds;
            math_bwd_seconds = r.bwd_seconds;
          }
          ++done;
          std::fprintf(stderr, "\r%*s\r", kBarWidth + 60, "");
          auto add_row = [&](const char* pass, double seconds, double flops, double math) {
            const BenchRow row{seqlen,
                               dtype,
                               causal,
                               backend,
                               pass,
                               seconds,
                               gflops(flops, seconds),
                               math > 0 ? math / seconds : 0.0};
            rows.push_back(row);
            std::printf("%8lld %-5s %-12s %-7s %-4s %10.3f %9.1f %6.1f%% %7.2fx\n",
                        static_cast<long long>(seqlen), std::string(name_of(dtype)).c_str(),
                        std::string(name_of(causal)).c_str(), std::string(name_of(backend)).c_str(),
                        pass, row.seconds * 1e3, row.gflops,
                        peak > 0 ? 100 * row.gflops / peak : 0.0, row.speedup);
          };
          add_row("fwd", r.seconds, r.flops, math_seconds);
          if (bc.backward) add_row("bwd", r.bwd_seconds, r.bwd_flops, math_bwd_seconds);
          std::fflush(stdout);
        }
      }
    }
  }
  std::printf(
      "\nFLOPs: forward 4*B*Hq*D per visible (query, key) pair, backward 2.5x; vs math = math's "
      "time / this time.\n");

  if (!bc.csv.empty()) {
    std::FILE* f = std::fopen(bc.csv.c_str(), "w");
    if (f == nullptr) throw UsageError{"--csv: cannot write '" + bc.csv + "'"};
    std::fprintf(
        f,
        "seqlen,batch,heads_q,heads_kv,head_dim,dtype,causal,backend,pass,threads,seconds,gflops,"
        "percent_of_peak,speedup_vs_math\n");
    for (const BenchRow& r : rows) {
      std::fprintf(f, "%lld,%lld,%lld,%lld,%lld,%s,%s,%s,%s,%d,%.9g,%.6g,%.4g,%.4g\n",
                   static_cast<long long>(r.seqlen), static_cast<long long>(bc.batch),
                   static_cast<long long>(bc.heads_q), static_cast<long long>(bc.heads_kv),
                   static_cast<long long>(bc.head_dim), std::string(name_of(r.dtype)).c_str(),
                   std::string(name_of(r.causal)).c_str(), std::string(name_of(r.backend)).c_str(),
                   r.pass, threads, r.seconds, r.gflops, peak > 0 ? 100 * r.gflops / peak : 0.0,
                   r.speedup);
    }
    std::fclose(f);
  }
  if (!bc.json.empty()) {
    std::string items;
    for (const BenchRow& r : rows) {
      JsonObject j;
      j.add("seqlen", r.seqlen);
      j.add("dtype", name_of(r.dtype));
      j.add("causal", name_of(r.causal));
      j.add("backend", name_of(r.backend));
      j.add("pass", r.pass);
      j.add("seconds", r.seconds);
      j.add("gflops", r.gflops);
      j.add("percent_of_peak", peak > 0 ? 100 * r.gflops / peak : 0.0);
      j.add("speedup_vs_math", r.speedup);
      items += (items.empty() ? "" : ", ") + j.str();
    }
    JsonObject top;
    top.add("version", attncore::version());
    top.add("batch", bc.batch);
    top.add("heads_q", bc.heads_q);
    top.add("heads_kv", bc.heads_kv);
    top.add("head_dim", bc.head_dim);
    top.add("threads", threads);
    top.add("peak_gflops", peak);
    top.add("simd", attncore::simd_target());
    std::string text = top.str();
    text.insert(text.size() - 1, ", \"rows\": [" + items + "]");
    std::FILE* f = std::fopen(bc.json.c_str(), "w");
    if (f == nullptr) throw UsageError{"--json: cannot write '" + bc.json + "'"};
    std::fprintf(f, "%s\n", text.c_str());
    std::fclose(f);
  }
  if (!bc.png.empty()) {
    attncore_tools::LineChart chart;
    chart.title = "b=" + std::to_string(bc.batch) + " hq=" + std::to_string(bc.heads_q) +
                  " d=" + std::to_string(bc.head_dim) + ", " + std::to_string(threads) +
                  " threads, peak " + format("%.0f", peak);
    chart.x_label = "sequence length (lq = lk)";
    chart.y_label = "gflop/s";
    for (const char* pass : {"fwd", "bwd"}) {
      for (Backend backend : backends) {
        for (DType dtype : bc.dtypes) {
          for (Causal causal : bc.causals) {
            attncore_tools::Series s;
            s.name = std::string(name_of(backend)) + " " + std::string(name_of(dtype)) + " " +
                     std::string(name_of(causal)) + (bc.backward ? std::string(" ") + pass : "");
            for (const BenchRow& r : rows) {
              if (r.backend == backend && r.dtype == dtype && r.causal == causal &&
                  std::string_view(r.pass) == pass) {
                s.points.emplace_back(static_cast<double>(r.seqlen), r.gflops);
              }
            }
            if (!s.points.empty()) chart.series.push_back(s);
          }
        }
      }
    }
    if (!attncore_tools::write_line_chart(chart, bc.png)) {
      throw UsageError{"--png: cannot write '" + bc.png + "'"};
    }
  }
  return kExitOk;
}

int dispatch(const std::vector<std::string>& args) {
  if (args.empty()) return cmd_default();
  const std::string& cmd = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "info") return cmd_info(rest);
  if (cmd == "run") return cmd_run(rest);
  if (cmd == "explain") return cmd_explain(rest);
  if (cmd == "bench") return cmd_bench(rest);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  throw UsageError{"unknown command '" + cmd + "'"};
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return dispatch(args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "attncore: %s\n\n%s", e.message.c_str(), kUsage);
    return kExitUsage;
  } catch (const attncore::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return kExitLibraryError;
  } catch (const CheckFailed& e) {
    std::fprintf(stderr, "attncore: %s\n", e.message.c_str());
    return kExitLibraryError;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "attncore: out of memory\n");
    return kExitLibraryError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attncore: %s\n", e.what());
    return kExitLibraryError;
  }
}
