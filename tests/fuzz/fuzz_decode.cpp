// Decoding an input's bytes into the shapes, layouts and options of a call (fuzz_cases.h).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_cases.h"
#include "testing/tensors.h"

namespace attncore::fuzz {

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

void decode_options(Reader& r, const Dims& s, bool mask_and_dropout, Decoded& o) {
  Options& opt = o.options;
  static constexpr double scales[] = {0.01, 0.1, 0.5, 1.0, 2.0, 1e-30};
  static constexpr double bad_scales[] = {0.0, -1.0, kInf,
                                          std::numeric_limits<double>::quiet_NaN()};
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
    o.alibi = make_input(r.chance(5) ? DType::f64 : DType::f32, shape, Layout::contiguous, r, 11,
                         1.0 / 4);
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
    if (r.chance(128))
      shape.insert(shape.begin(), {r.chance(128) ? s.b : 1, r.chance(128) ? s.hq : 1});
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
  // Key splits (flash's split-KV): forced now and then, now and then out of range.
  if (r.chance(40)) opt.num_splits = static_cast<int>(r.range(1, 9));
  if (r.chance(3)) opt.num_splits = r.chance(128) ? -1 : kMaxSplits + 1;
}

// With ATTNCORE_FUZZ_VERBOSE set, what an input decoded to (to read a crash's input).
void describe(const char* mode, const Dims& s, DType dtype, const Options& o,
              const std::vector<const Array*>& arrays) {
  if (std::getenv("ATTNCORE_FUZZ_VERBOSE") == nullptr) return;
  std::fprintf(stderr,
               "%s %s B=%lld Hq=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld scale=%g causal=%d "
               "window=(%lld,%lld) softcap=%g alibi=%d mask=%d dropout=%g gqa=%d threads=%d "
               "cancel=%d splits=%d\n",
               mode, std::string(name_of(dtype)).c_str(), (long long)s.b, (long long)s.hq,
               (long long)s.hkv, (long long)s.lq, (long long)s.lk, (long long)s.d, (long long)s.dv,
               o.scale.value_or(-1), int(o.causal), (long long)o.window_left,
               (long long)o.window_right, o.softcap, o.alibi_slopes.has_value(), o.mask.has_value(),
               o.dropout_p, o.enable_gqa, o.num_threads, o.cancel != nullptr, o.num_splits);
  for (const Array* a : arrays) {
    std::fprintf(stderr, "  %s %s strides", std::string(name_of(a->view.dtype)).c_str(),
                 a->view.shape_string().c_str());
    for (int d = 0; d < a->view.rank; ++d)
      std::fprintf(stderr, " %lld", (long long)a->view.stride[d]);
    std::fprintf(stderr, "\n");
  }
}

// max |v| of the values a row averages, as dropout scales them.
double value_bound(const Array& v, const Options& o) {
  return max_finite(test::read_view(v.view)) / (1.0 - std::min(o.dropout_p, 0.99));
}

// i32 [n] holding `values`.
Array index_array(const std::vector<std::int64_t>& values) {
  Array a = make_array(DType::i32, {static_cast<std::int64_t>(values.size())}, Layout::contiguous);
  auto* p = reinterpret_cast<std::int32_t*>(a.storage.data());
  for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<std::int32_t>(values[i]);
  return a;
}

}  // namespace attncore::fuzz
