// The libFuzzer target (README: Reliability): decodes an input's bytes into one call of the C++
// API (dense forward and backward, variable-length forward, KV-cache forward with and without
// an append, merge_attention_states, or a call of absurd size) with shapes, strides (zero and
// overlapping included), dtypes, options and small data, at most ~10^7 flops, runs it on every
// backend and checks it as tests/fuzz/fuzz_check.h says. Good and bad calls alike: each choice
// is sometimes made invalid.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "fuzz_check.h"
#include "fuzz_input.h"
#include "testing/problem.h"
#include "testing/tensors.h"

namespace attncore::fuzz {
namespace {

constexpr double kMaxFlops = 1e7;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::int64_t length(Reader& r) { return r.chance(200) ? r.range(0, 9) : r.range(0, 80); }

std::int64_t head_dim(Reader& r) {
  static constexpr std::int64_t dims[] = {1, 2, 3, 4, 7, 8, 16, 32, 40, 59, 64, 80, 128};
  return dims[r.byte() % std::size(dims)];
}

DType value_dtype(Reader& r) {
  static constexpr DType types[] = {DType::f32, DType::f32, DType::bf16, DType::f16, DType::f64};
  return types[r.byte() % std::size(types)];
}

// Mostly the good layouts; overlapping and bad ones now and then.
Layout layout(Reader& r) {
  const int b = r.byte();
  if (b < 150) return Layout::contiguous;
  if (b < 180) return Layout::transposed;
  if (b < 205) return Layout::padded;
  if (b < 225) return Layout::broadcast;
  if (b < 248) return Layout::overlapping;
  return Layout::bad_last;
}
Layout output_layout(Reader& r) { return r.chance(220) ? Layout::contiguous : layout(r); }

// Sizes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv].
struct Dims {
  std::int64_t b, hq, hkv, lq, lk, d, dv;
};

Dims dims(Reader& r) {
  Dims s{};
  s.b = r.range(1, 3);
  s.hkv = r.range(1, 3);
  s.hq = s.hkv * r.range(1, 3) + (r.chance(6) ? 1 : 0);
  s.lq = length(r);
  s.lk = length(r);
  s.d = head_dim(r);
  s.dv = r.chance(128) ? s.d : head_dim(r);
  return s;
}

double flops(const Dims& s, double pairs) {
  return 4.0 * static_cast<double>(s.hq) * pairs * static_cast<double>(s.d + s.dv);
}

// The score options and threads, each sometimes invalid; the arrays it points to.
struct Decoded {
  Options options;
  std::optional<Array> alibi, mask;
  std::atomic<bool> cancel{true};
};

void decode_options(Reader& r, const Dims& s, bool mask_and_dropout, Decoded& o) {
  Options& opt = o.options;
  static constexpr double scales[] = {0.01, 0.1, 0.5, 1.0, 2.0, 1e-30};
  static constexpr double bad_scales[] = {0.0, -1.0, kInf, std::numeric_limits<double>::quiet_NaN()};
  if (r.chance(40)) opt.scale = scales[r.byte() % std::size(scales)];
  if (r.chance(3)) opt.scale = bad_scales[r.byte() % std::size(bad_scales)];
  opt.causal = static_cast<Causal>(r.byte() % 3);
  if (r.chance(50)) {
    opt.window_left = r.range(-1, s.lk);
    opt.window_right = r.range(-1, s.lk);
  }
  if (r.chance(3)) opt.window_left = -2;
  static constexpr double caps[] = {0.5, 5.0, 50.0, -1.0};
  if (r.chance(40)) opt.softcap = caps[r.byte() % std::size(caps)];
  if (r.chance(40)) {
    const bool per_batch = r.chance(128);
    std::vector<std::int64_t> shape{s.hq};
    if (per_batch) shape.insert(shape.begin(), s.b);
    if (r.chance(5)) shape.back() += 1;
    o.alibi = make_input(r.chance(5) ? DType::f64 : DType::f32, shape, Layout::contiguous, r,
                         11, 1.0 / 4);
    test::write_view(o.alibi->view, [&] {
      auto v = test::read_view(o.alibi->view);
      for (double& x : v) x = std::fabs(x);
      return v;
    }());
    opt.alibi_slopes = o.alibi->view;
  }
  if (r.chance(mask_and_dropout ? 60 : 4)) {
    const bool is_bool = r.chance(100);
    static constexpr DType additive[] = {DType::f32, DType::bf16, DType::f16, DType::f64};
    const DType dtype = is_bool ? DType::b8 : additive[r.byte() % std::size(additive)];
    std::vector<std::int64_t> shape{r.chance(128) ? s.lq : 1, r.chance(200) ? s.lk : 1};
    if (r.chance(128)) shape.insert(shape.begin(), {r.chance(128) ? s.b : 1, r.chance(128) ? s.hq : 1});
    if (r.chance(4)) shape.back() += 1;
    o.mask = make_input(dtype, shape, layout(r), r, 13, 8.0);
    if (!is_bool) {  // the most negative values hide keys: fully masked rows now and then
      auto v = test::read_view(o.mask->view);
      for (double& x : v) x = x <= -7.0 ? -kInf : x;
      test::write_view(o.mask->view, v);
    }
    opt.mask = o.mask->view;
  }
  static constexpr double drops[] = {0.25, 0.5, 0.9, 1.0};
  if (r.chance(mask_and_dropout ? 30 : 3)) {
    opt.dropout_p = drops[r.byte() % std::size(drops)];
    opt.seed = r.byte();
    opt.offset = static_cast<std::uint64_t>(r.byte()) * 1000;
  }
  opt.enable_gqa = !r.chance(4);
  opt.num_threads = static_cast<int>(r.range(1, 3));
  if (r.chance(3)) opt.num_threads = r.chance(128) ? -1 : kMaxThreads + 1;
  if (r.chance(3)) opt.cancel = &o.cancel;
}

// With ATTNCORE_FUZZ_VERBOSE set, what an input decoded to (to read a crash's input).
void describe(const char* mode, const Dims& s, DType dtype, const Options& o,
              const std::vector<const Array*>& arrays) {
  if (std::getenv("ATTNCORE_FUZZ_VERBOSE") == nullptr) return;
  std::fprintf(stderr,
               "%s %s B=%lld Hq=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld scale=%g causal=%d "
               "window=(%lld,%lld) softcap=%g alibi=%d mask=%d dropout=%g gqa=%d threads=%d "
               "cancel=%d\n",
               mode, std::string(name_of(dtype)).c_str(), (long long)s.b, (long long)s.hq,
               (long long)s.hkv, (long long)s.lq, (long long)s.lk, (long long)s.d,
               (long long)s.dv, o.scale.value_or(-1), int(o.causal), (long long)o.window_left,
               (long long)o.window_right, o.softcap, o.alibi_slopes.has_value(),
               o.mask.has_value(), o.dropout_p, o.enable_gqa, o.num_threads, o.cancel != nullptr);
  for (const Array* a : arrays) {
    std::fprintf(stderr, "  %s %s strides", std::string(name_of(a->view.dtype)).c_str(),
                 a->view.shape_string().c_str());
    for (int d = 0; d < a->view.rank; ++d) std::fprintf(stderr, " %lld", (long long)a->view.stride[d]);
    std::fprintf(stderr, "\n");
  }
}

// max |v| of the values a row averages, as dropout scales them.
double value_bound(const Array& v, const Options& o) {
  return max_finite(test::read_view(v.view)) / (1.0 - std::min(o.dropout_p, 0.99));
}

// lse [B, Hq, Lq] or (varlen) [Hq, total]: LSE values in out's row order.
std::vector<double> lse_in_row_order(const std::vector<double>& lse, std::int64_t heads,
                                     bool head_major) {
  if (!head_major) return lse;
  const std::size_t total = lse.size() / static_cast<std::size_t>(heads);
  std::vector<double> rows(lse.size());
  for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h)
    for (std::size_t t = 0; t < total; ++t) rows[t * heads + h] = lse[h * total + t];
  return rows;
}

// out and lse (results 0 and 1) of every successful run against the reference's.
void check_forward(const std::vector<Run>& runs, DType dtype, double vmax, std::int64_t heads,
                   std::int64_t dim_v, bool head_major_lse) {
  const Run& ref = runs.front();
  if (ref.outcome != Outcome::ok) return;
  const std::vector<double> ref_rows = lse_in_row_order(ref.results[1], heads, head_major_lse);
  for (const Run& run : runs) {
    if (run.outcome != Outcome::ok) continue;
    check_close(ref, run, 0, output_tolerance(dtype, vmax), "out");
    for (std::size_t j = 0; j < ref.results[1].size(); ++j) {
      const double want = ref.results[1][j];
      if (std::isfinite(want) && !(std::fabs(run.results[1][j] - want) <= test::lse_tolerance(dtype, want)))
        fail(std::string(name_of(run.backend)) + ": lse element " + std::to_string(j) + " is " +
             std::to_string(run.results[1][j]) + ", reference " + std::to_string(want));
    }
    check_masked_rows(ref_rows, run.results[0],
                      lse_in_row_order(run.results[1], heads, head_major_lse), dim_v,
                      std::string(name_of(run.backend)));
  }
}

void fuzz_dense(Reader& r) {
  Dims s = dims(r);
  while (flops(s, double(s.b * s.lq * s.lk)) > kMaxFlops) s.lk /= 2, s.lq = (s.lq + 1) / 2;
  const DType dtype = value_dtype(r);
  const double magnitude = r.chance(64) ? 1.0 / 16 : 1.0;
  Array q = make_input(dtype, {s.b, s.hq, s.lq, s.d}, layout(r), r, 1, magnitude);
  Array k = make_input(r.chance(4) ? DType::bf16 : dtype, {s.b, s.hkv, s.lk, s.d}, layout(r), r, 2,
                       magnitude);
  Array v = make_input(dtype, {s.b, s.hkv, s.lk, s.dv}, layout(r), r, 3, 1.0);
  Decoded o;
  decode_options(r, s, true, o);
  Array out = make_array(dtype, {s.b, s.hq, s.lq, s.dv}, output_layout(r), 0xa5);
  Array lse = make_array(dtype == DType::f64 ? DType::f64 : DType::f32, {s.b, s.hq, s.lq},
                         output_layout(r), 0xa5);
  describe("dense", s, dtype, o.options, {&q, &k, &v, &out, &lse});
  if (o.mask) describe("mask", s, dtype, o.options, {&*o.mask});
  TensorView out_view = out.view;
  if (r.chance(4)) out_view.data = q.storage.data();  // shares bytes with q (when non-empty)
  std::vector<Array*> inputs{&q, &k, &v};
  if (o.alibi) inputs.push_back(&*o.alibi);
  if (o.mask) inputs.push_back(&*o.mask);
  CallSpec fwd{{&out, &lse}, inputs, {}, {out.view, lse.view}, o.options.cancel != nullptr,
               [&](Backend b) { forward_into(q.view, k.view, v.view, out_view, lse.view, o.options, b); }};
  const std::vector<Run> runs = run_all_backends(fwd);
  check_forward(runs, dtype, value_bound(v, o.options), s.hq, s.dv, false);
  if (runs.front().outcome != Outcome::ok || r.chance(128)) return;

  // Backward from the reference's out and lse.
  Array ref_out = make_array(dtype, {s.b, s.hq, s.lq, s.dv}, Layout::contiguous);
  Array ref_lse = make_array(lse.view.dtype, {s.b, s.hq, s.lq}, Layout::contiguous);
  test::write_view(ref_out.view, runs.front().results[0]);
  test::write_view(ref_lse.view, runs.front().results[1]);
  Array dout = make_input(dtype, {s.b, s.hq, s.lq, s.dv}, layout(r), r, 5, 1.0);
  Array dq = make_array(q.view.dtype, {s.b, s.hq, s.lq, s.d}, output_layout(r), 0xa5);
  Array dk = make_array(k.view.dtype, {s.b, s.hkv, s.lk, s.d}, output_layout(r), 0xa5);
  Array dv = make_array(dtype, {s.b, s.hkv, s.lk, s.dv}, output_layout(r), 0xa5);
  std::optional<Array> dbias;
  std::vector<Array*> outputs{&dq, &dk, &dv};
  if (o.mask && r.chance(128)) {
    o.options.compute_dbias = true;
    std::vector<std::int64_t> shape(o.mask->view.shape.begin(),
                                    o.mask->view.shape.begin() + o.mask->view.rank);
    dbias = make_array(o.mask->view.dtype, shape, Layout::contiguous, 0xa5);
    outputs.push_back(&*dbias);
  }
  std::vector<Array*> bwd_inputs = inputs;
  bwd_inputs.insert(bwd_inputs.end(), {&ref_out, &ref_lse, &dout});
  std::vector<TensorView> results{dq.view, dk.view, dv.view};
  if (dbias) results.push_back(dbias->view);
  CallSpec bwd{outputs, bwd_inputs, {}, results, false, [&](Backend b) {
                 backward_into(dout.view, q.view, k.view, v.view, ref_out.view, ref_lse.view,
                               dq.view, dk.view, dv.view,
                               dbias ? std::optional<TensorView>(dbias->view) : std::nullopt,
                               o.options, b);
               }};
  const std::vector<Run> grads = run_all_backends(bwd);
  // 16-bit gradients have no bound without the oracle's naive run: f32 and f64 only.
  if (grads.front().outcome != Outcome::ok || (dtype != DType::f32 && dtype != DType::f64)) return;
  double scale = 0;
  for (const auto& g : grads.front().results) scale = std::max(scale, max_finite(g));
  // The rounding of dP - Delta (dot products of Dv terms), which the gradients' own magnitudes
  // do not bound when they cancel (P near uniform makes dq tiny): each dS_ij errs up to about
  // 4 eps Dv max|dO| max|V| / (1 - p) times P_ij, so dq (P summing to 1 over j) up to that times
  // scale max|K|, dk and dbias (P summed over up to Lq rows) up to Lq times scale max|Q| or 1.
  const double eps = dtype == DType::f64 ? 0x1p-53 : 0x1p-24;
  const double sm_scale = o.options.scale.value_or(1.0 / std::sqrt(double(s.d)));
  const double ds_error = 4.0 * eps * double(s.dv) * max_finite(test::read_view(dout.view)) *
                          max_finite(test::read_view(v.view)) / (1.0 - o.options.dropout_p);
  const double cancel = ds_error * std::max({1.0, sm_scale * max_finite(test::read_view(k.view)),
                                             double(s.lq) * std::max(1.0, sm_scale * max_finite(
                                                                              test::read_view(q.view)))});
  // dbias has the mask's dtype: a 16-bit mask's gradient is rounded to it (its unit, doubled).
  const double mask_unit = !dbias                                 ? 0.0
                           : dbias->view.dtype == DType::bf16     ? 0x1p-8
                           : dbias->view.dtype == DType::f16      ? 0x1p-11
                                                                  : 0.0;
  for (const Run& run : grads) {
    if (run.outcome != Outcome::ok) continue;
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& exact = grads.front().results[i];
      const double rounding = i == 3 ? 2.0 * mask_unit * max_finite(exact) : 0.0;
      check_close(grads.front(), run, i,
                  test::grad_tolerance(dtype, exact, exact, scale) + cancel + rounding,
                  "gradient " + std::to_string(i));
    }
  }
}

// i32 [n] holding `values`.
Array index_array(const std::vector<std::int64_t>& values) {
  Array a = make_array(DType::i32, {static_cast<std::int64_t>(values.size())}, Layout::contiguous);
  auto* p = reinterpret_cast<std::int32_t*>(a.storage.data());
  for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<std::int32_t>(values[i]);
  return a;
}

void fuzz_varlen(Reader& r) {
  Dims s = dims(r);
  std::vector<std::int64_t> cu_q{0}, cu_k{0}, used;
  double pairs = 0;
  std::int64_t max_q = 0, max_k = 0;
  for (std::int64_t b = 0; b < s.b; ++b) {
    const std::int64_t lq = length(r) / 2, lk = length(r) / 2;
    const std::int64_t u = r.chance(60) ? r.range(0, lk) : lk;
    cu_q.push_back(cu_q.back() + lq);
    cu_k.push_back(cu_k.back() + lk);
    used.push_back(u);
    pairs += double(lq * lk);
    max_q = std::max(max_q, lq), max_k = std::max(max_k, lk);
  }
  if (flops(s, pairs) > kMaxFlops) return;
  if (r.chance(6)) std::swap(cu_q[1], cu_q[s.b]);  // decreasing offsets
  const std::int64_t total_q = cu_q.back() + r.range(0, 2), total_k = cu_k.back() + r.range(0, 2);
  Array acu_q = index_array(cu_q), acu_k = index_array(cu_k), aused = index_array(used);
  VarlenSeqs seqs{acu_q.view, acu_k.view, std::nullopt, max_q + r.range(0, 2) - (r.chance(6) ? 1 : 0),
                  max_k + r.range(0, 2)};
  if (r.chance(100)) seqs.seqused_k = aused.view;
  const DType dtype = value_dtype(r);
  Array q = make_input(dtype, {total_q, s.hq, s.d}, layout(r), r, 1, 1.0);
  Array k = make_input(dtype, {total_k, s.hkv, s.d}, layout(r), r, 2, 1.0);
  Array v = make_input(dtype, {total_k, s.hkv, s.dv}, layout(r), r, 3, 1.0);
  Decoded o;
  decode_options(r, s, false, o);
  Array out = make_array(dtype, {total_q, s.hq, s.dv}, output_layout(r), 0xa5);
  Array lse = make_array(dtype == DType::f64 ? DType::f64 : DType::f32, {s.hq, total_q},
                         output_layout(r), 0xa5);
  std::vector<Array*> inputs{&q, &k, &v, &acu_q, &acu_k, &aused};
  if (o.alibi) inputs.push_back(&*o.alibi);
  if (o.mask) inputs.push_back(&*o.mask);
  CallSpec fwd{{&out, &lse}, inputs, {}, {out.view, lse.view}, o.options.cancel != nullptr,
               [&](Backend b) {
                 forward_varlen_into(q.view, k.view, v.view, seqs, out.view, lse.view, o.options, b);
               }};
  check_forward(run_all_backends(fwd), dtype, value_bound(v, o.options), s.hq, s.dv, true);
}

void fuzz_kvcache(Reader& r) {
  Dims s = dims(r);
  s.lq = r.chance(160) ? 1 : r.range(0, 8);
  const std::int64_t rows = r.range(1, 3), capacity = r.range(0, 40);
  const bool append = r.chance(128);
  const std::int64_t l_new = append ? r.range(0, 6) : 0;
  std::vector<std::int64_t> lens, idx, pad;
  for (std::int64_t b = 0; b < s.b; ++b) {
    lens.push_back(r.range(0, capacity));
    idx.push_back(r.range(0, rows - 1));
    pad.push_back(r.range(0, lens.back()));
  }
  if (r.chance(4)) lens[0] = capacity + 1;
  if (flops(s, double(s.b * s.lq * (capacity + l_new))) > kMaxFlops) return;
  Array alens = index_array(lens), aidx = index_array(idx), apad = index_array(pad);
  KvCacheSeqs seqs;
  seqs.cache_seqlens = alens.view;
  if (r.chance(80) || rows < s.b) seqs.cache_batch_idx = aidx.view;
  if (r.chance(60)) seqs.cache_leftpad = apad.view;
  const DType dtype = value_dtype(r);
  Array q = make_input(dtype, {s.b, s.hq, s.lq, s.d}, layout(r), r, 1, 1.0);
  Array k_cache = make_input(dtype, {rows, s.hkv, capacity, s.d}, layout(r), r, 2, 1.0);
  Array v_cache = make_input(dtype, {rows, s.hkv, capacity, s.dv}, layout(r), r, 3, 1.0);
  Array k_new = make_input(dtype, {s.b, s.hkv, l_new, s.d}, layout(r), r, 4, 1.0);
  Array v_new = make_input(dtype, {s.b, s.hkv, l_new, s.dv}, layout(r), r, 5, 1.0);
  KvAppend add{k_new.view, v_new.view, std::nullopt, std::nullopt, r.chance(128)};
  std::optional<Array> cos, sin;
  if (append && r.chance(80)) {
    const std::int64_t half = r.range(0, s.d / 2), positions = r.range(0, capacity + 8);
    cos = make_input(DType::f32, {positions, half}, Layout::contiguous, r, 6, 0.25);
    sin = make_input(DType::f32, {positions, half}, Layout::contiguous, r, 7, 0.25);
    add.rotary_cos = cos->view, add.rotary_sin = sin->view;
  }
  Decoded o;
  decode_options(r, s, false, o);
  // An append returns new tensors, copied here: into contiguous arrays.
  Array out = make_array(dtype, {s.b, s.hq, s.lq, s.dv}, append ? Layout::contiguous : output_layout(r), 0xa5);
  Array lse = make_array(dtype == DType::f64 ? DType::f64 : DType::f32, {s.b, s.hq, s.lq},
                         append ? Layout::contiguous : output_layout(r), 0xa5);
  std::vector<Array*> inputs{&q, &k_cache, &v_cache, &k_new, &v_new, &alens, &aidx, &apad};
  for (auto* a : {&cos, &sin, &o.alibi, &o.mask})
    if (*a) inputs.push_back(&**a);
  std::vector<Array*> written;
  if (append) written = {&k_cache, &v_cache};
  CallSpec call{{&out, &lse}, inputs, written, {out.view, lse.view}, o.options.cancel != nullptr,
                [&](Backend b) {
                  if (!append) {
                    forward_kvcache_into(q.view, k_cache.view, v_cache.view, seqs, out.view,
                                         lse.view, o.options, b);
                    return;
                  }
                  const ForwardResult res =
                      forward_kvcache(q.view, k_cache.view, v_cache.view, seqs, add, o.options, b);
                  test::write_view(out.view, test::read_view(res.out));
                  test::write_view(lse.view, test::read_view(res.lse));
                }};
  const std::vector<Run> runs = run_all_backends(call);
  check_forward(runs, dtype, value_bound(v_cache, o.options), s.hq, s.dv, false);
  for (const Run& run : runs) {  // every backend appends the same bytes
    if (run.outcome == Outcome::ok && runs.front().outcome == Outcome::ok &&
        run.written != runs.front().written)
      fail(std::string(name_of(run.backend)) + ": appended other bytes than the reference");
  }
}

void fuzz_merge(Reader& r) {
  const int rank = static_cast<int>(r.range(1, 4));
  std::vector<std::int64_t> shape;
  for (int d = 0; d < rank; ++d) shape.push_back(d + 1 == rank ? head_dim(r) : r.range(0, 5));
  const std::vector<std::int64_t> lse_shape(shape.begin(), shape.end() - 1);
  std::vector<std::int64_t> shape_b = shape;
  if (r.chance(4)) shape_b.back() += 1;
  const DType dtype = value_dtype(r), lse_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
  Array oa = make_input(dtype, shape, layout(r), r, 1, 1.0);
  Array ob = make_input(dtype, shape_b, layout(r), r, 2, 1.0);
  Array la = make_input(lse_dtype, lse_shape, layout(r), r, 3, 16.0);
  Array lb = make_input(lse_dtype, lse_shape, layout(r), r, 4, 16.0);
  for (Array* l : {&la, &lb}) {  // LSE -inf: a side that saw no key
    auto x = test::read_view(l->view);
    for (double& e : x) e = e <= -14.0 ? -kInf : e;
    test::write_view(l->view, x);
  }
  const bool in_place = r.chance(60);  // into out_a and lse_a themselves
  const int threads = r.chance(4) ? -1 : static_cast<int>(r.range(0, 3));
  const bool allocating = r.chance(60);  // new tensors, copied here into contiguous arrays
  Array out = make_array(dtype, shape, allocating ? Layout::contiguous : output_layout(r), 0xa5);
  Array lse = make_array(lse_dtype, lse_shape, allocating ? Layout::contiguous : output_layout(r), 0xa5);
  // Expected, in double from the inputs as the library reads them.
  const auto xa = test::read_view(oa.view), xb = test::read_view(ob.view);
  const auto ya = test::read_view(la.view), yb = test::read_view(lb.view);
  Array* target_out = in_place ? &oa : &out;
  Array* target_lse = in_place ? &la : &lse;
  CallSpec call{{&out, &lse}, {&oa, &ob, &la, &lb}, {}, {}, false, [&](Backend) {
                  if (allocating) {
                    const MergeResult m = merge_attention_states(oa.view, la.view, ob.view, lb.view, threads);
                    test::write_view(out.view, test::read_view(m.out));
                    test::write_view(lse.view, test::read_view(m.lse));
                    return;
                  }
                  merge_attention_states_into(oa.view, la.view, ob.view, lb.view, target_out->view,
                                              target_lse->view, threads);
                }};
  if (in_place && !allocating) call.written = {&oa, &la};
  call.result = {target_out->view, target_lse->view};
  if (allocating) call.result = {out.view, lse.view};
  const Run run = run_all_backends(call).front();  // no backends: the same call three times
  if (run.outcome != Outcome::ok) return;
  const std::size_t dv = static_cast<std::size_t>(shape.back());
  double vmax = std::max(max_finite(xa), max_finite(xb));
  const double tol = output_tolerance(dtype, vmax);
  for (std::size_t row = 0; row < ya.size(); ++row) {
    const double m = std::max(ya[row], yb[row]);
    const double l = m == -kInf ? -kInf : m + std::log(std::exp(ya[row] - m) + std::exp(yb[row] - m));
    if (!(std::fabs(run.results[1][row] - l) <= test::lse_tolerance(dtype, l)) && run.results[1][row] != l)
      fail("merge: lse differs");
    for (std::size_t j = 0; j < dv; ++j) {
      const double want = l == -kInf ? 0.0
                                     : std::exp(ya[row] - l) * xa[row * dv + j] +
                                           std::exp(yb[row] - l) * xb[row * dv + j];
      if (!(std::fabs(run.results[0][row * dv + j] - want) <= tol))
        fail("merge: out element " + std::to_string(row * dv + j) + " is " +
             std::to_string(run.results[0][row * dv + j]) + ", expected " + std::to_string(want) +
             " (" + std::string(name_of(dtype)) + ", lse " + std::to_string(ya[row]) + ", " +
             std::to_string(yb[row]) + (in_place ? ", in place" : "") +
             (allocating ? ", allocating" : "") + ")");
    }
  }
}

// Calls no machine can hold: broadcast (stride 0) inputs of 2^40 and more rows into outputs the
// library allocates. They must be refused before any allocation or work.
void fuzz_absurd(Reader& r) {
  Array one = make_input(DType::f32, {64}, Layout::contiguous, r, 1, 1.0);
  TensorView q = TensorView::strided(one.storage.data(), DType::f32,
                                     {std::int64_t{1} << r.range(10, 40), 16, std::int64_t{1} << 20, 64},
                                     {0, 0, 0, 1});
  TensorView k = TensorView::strided(one.storage.data(), DType::f32,
                                     {q.shape[0], 16, std::int64_t{1} << r.range(0, 57), 64},
                                     {0, 0, 0, 1});
  Options o;
  o.dropout_p = r.chance(128) ? 0.5 : 0.0;
  for (Backend b : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    try {
      forward(q, k, k, o, b);
    } catch (const InvalidArgument&) {
      continue;
    } catch (const OutOfMemory&) {
      continue;
    } catch (const Unsupported&) {
      continue;
    }
    fail("an absurd call ran");
  }
}

}  // namespace
}  // namespace attncore::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace attncore::fuzz;
  Reader r(data, size);
  switch (r.byte() % 8) {
    case 0:
    case 1:
    case 2:
      fuzz_dense(r);
      break;
    case 3:
    case 4:
      fuzz_varlen(r);
      break;
    case 5:
      fuzz_kvcache(r);
      break;
    case 6:
      fuzz_merge(r);
      break;
    default:
      if (r.chance(32)) fuzz_absurd(r);
      else fuzz_kvcache(r);
  }
  return 0;
}
