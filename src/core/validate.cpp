// Input validation for forward and backward. Messages follow docs/design.md section 4:
//   <op>: <what> <problem> (<name>=<value>, expected <constraint>)[; <remedy>]
#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>

#include "attncore/error.h"
#include "core/validate_checks.h"

namespace attncore::detail {

namespace {


// Checks of q, k, v and options shared by forward and backward.
Params resolve(const Checker& check, const TensorView& q, const TensorView& k, const TensorView& v,
                const Options& o, Backend backend) {
  check.backend(backend);
  check.view(q, "query", 4, "[B, Hq, Lq, D]");
  check.view(k, "key", 4, "[B, Hkv, Lk, D]");
  check.view(v, "value", 4, "[B, Hkv, Lk, Dv]");
  check.inputs(q, k, v);

  Params p;
  p.dtype = q.dtype;
  p.kv_dtype = q.dtype;
  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.seq.lq = q.size(2);
  p.head_dim = q.size(3);
  p.heads_kv = k.size(1);
  p.seq.lk = k.size(2);
  p.head_dim_v = v.size(3);
  check.dims(p);
  const std::int64_t k_expected[4] = {p.batch, k.size(1) < 1 ? 1 : k.size(1), p.seq.lk,
                                      p.head_dim};
  const std::string heads = " with Hq % Hkv == 0 (Hq=" + std::to_string(p.heads_q) +
                            ", Hkv=" + std::to_string(k.size(1)) + ")";
  check.shape(k, "key", k_expected, "[B, Hkv, Lk, D]", heads);
  if (p.heads_q % p.heads_kv != 0) {
    check.fail("key has shape " + k.shape_string() + ", expected [" + std::to_string(p.batch) +
               ", Hkv, Lk, " + std::to_string(p.head_dim) + "]" + heads);
  }
  check.group(p, o);
  const std::int64_t v_expected[4] = {p.batch, p.heads_kv, p.seq.lk, p.head_dim_v};
  check.shape(v, "value", v_expected, "[B, Hkv, Lk, Dv] like key");
  // Every (b, h, i, j) has an int64 index: the score loops' and dropout's, whose stream
  // positions offset + index then stay below 2^64 + 2^63 (philox.h's counter holds them).
  check.count("query and key make too many (query, key) pairs", "B * Hq * Lq * Lk",
              {p.batch, p.heads_q, p.seq.lq, p.seq.lk});
  p.dropout.rows = p.seq.lq;
  p.dropout.cols = p.seq.lk;
  resolve_variant(check, o, p);
  return p;
}

}  // namespace

void resolve_variant(const Checker& check, const Options& o, Params& p) {
  // Scalars.
  if (o.scale.has_value()) {
    if (!std::isfinite(*o.scale) || *o.scale <= 0.0) {
      check.fail("scale is invalid (scale=" + fmt_double(*o.scale) +
                 ", expected a finite value > 0)");
    }
    // f32, bf16 and f16 calls compute in f32: a scale past its range would be infinite. (Named
    // as a magnitude: the Python drop-ins pass a negative scale's |scale| with q negated.)
    if (p.dtype != DType::f64 && *o.scale > std::numeric_limits<float>::max()) {
      check.fail("scale is too large for f32 arithmetic (|scale|=" + fmt_double(*o.scale) +
                 ", expected |scale| <= " + fmt_double(std::numeric_limits<float>::max()) +
                 " with " + std::string(name_of(p.dtype)) + " inputs)");
    }
    p.scale = *o.scale;
  } else {
    p.scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  }
  if (static_cast<unsigned>(o.causal) > static_cast<unsigned>(Causal::lower_right)) {
    check.fail("causal is invalid (causal=" + std::to_string(static_cast<unsigned>(o.causal)) +
               ", expected none, upper-left or lower-right)");
  }
  p.causal = o.causal;
  if (o.window_left < -1) {
    check.fail("window_left is invalid (window_left=" + std::to_string(o.window_left) +
               ", expected >= -1; -1 = unbounded)");
  }
  if (o.window_right < -1) {
    check.fail("window_right is invalid (window_right=" + std::to_string(o.window_right) +
               ", expected >= -1; -1 = unbounded)");
  }
  // A window wider than any |i + Lk - Lq - j| is no window; this also keeps index math small.
  // (Saturated: an empty batch takes any lengths.)
  const std::int64_t widest =
      p.seq.max_q() > INT64_MAX - p.seq.max_k() ? INT64_MAX : p.seq.max_q() + p.seq.max_k();
  p.window_left = o.window_left > widest ? -1 : o.window_left;
  p.window_right = o.window_right > widest ? -1 : o.window_right;
  if (!std::isfinite(o.softcap) || o.softcap < 0.0) {
    check.fail("softcap is invalid (softcap=" + fmt_double(o.softcap) +
               ", expected a finite value >= 0; 0 = off)");
  }
  // A cap below f32's normal range would be 0 or have no f32 inverse (softcap's s / cap).
  if (p.dtype != DType::f64 && o.softcap > 0.0 && o.softcap < std::numeric_limits<float>::min()) {
    check.fail("softcap is too small for f32 arithmetic (softcap=" + fmt_double(o.softcap) +
               ", expected 0 or >= " + fmt_double(std::numeric_limits<float>::min()) + " with " +
               std::string(name_of(p.dtype)) + " inputs)");
  }
  p.softcap = o.softcap;
  if (!(o.dropout_p >= 0.0 && o.dropout_p < 1.0)) {
    check.fail("dropout_p is out of range (dropout_p=" + fmt_double(o.dropout_p) +
               ", expected 0 <= dropout_p < 1)");
  }
  // Dropout compares each uniform with p in f32 (core/philox.h): from 1 - 2^-25 on, p rounds to
  // 1 there and no element is ever kept.
  if (static_cast<float>(o.dropout_p) >= 1.0f) {
    char text[32];
    std::snprintf(text, sizeof text, "%.17g", o.dropout_p);  // (6 digits would print 1)
    check.fail("dropout_p is too close to 1 (dropout_p=" + std::string(text) +
               ", expected dropout_p < 1 - 2^-25: in f32, as dropout compares it, it is 1 and "
               "would keep nothing)");
  }
  p.dropout.p = o.dropout_p;
  p.dropout.seed = o.seed;
  p.dropout.offset = o.offset;
  check.threads(o.num_threads);
  check.splits(o.num_splits);
  p.num_splits = o.num_splits;

  // ALiBi slopes: f32 [Hq] or [B, Hq].
  if (o.alibi_slopes.has_value()) {
    const TensorView& a = *o.alibi_slopes;
    check.structure(a, "alibi_slopes");
    check.dtype(a, "alibi_slopes", DType::f32, "");
    if (a.rank == 1 && a.size(0) == p.heads_q) {
      p.alibi_stride_h = a.stride_of(0);
    } else if (a.rank == 2 && a.size(0) == p.batch && a.size(1) == p.heads_q) {
      p.alibi_stride_b = a.stride_of(0);
      p.alibi_stride_h = a.stride_of(1);
    } else {
      check.fail("alibi_slopes has shape " + a.shape_string() + ", expected [" +
                 std::to_string(p.heads_q) + "] or [" + std::to_string(p.batch) + ", " +
                 std::to_string(p.heads_q) + "] ([Hq] or [B, Hq])");
    }
    p.alibi = static_cast<const float*>(a.data);
    // A non-finite slope would turn its rows into NaN (or every score -inf) silently. Each
    // slope in memory is read once: a dim of stride 0 (broadcast) holds one slope along it.
    // (An empty dim reads none: min with 1.)
    const std::int64_t batches =
        a.rank == 2 && p.alibi_stride_b != 0 ? p.batch : std::min<std::int64_t>(p.batch, 1);
    const std::int64_t heads =
        p.alibi_stride_h != 0 ? p.heads_q : std::min<std::int64_t>(p.heads_q, 1);
    // f32, bf16 and f16 calls add the bias -slope * distance in f32: a slope whose bias could
    // pass f32's range (distances up to Lq + Lk) would make it infinite, and its rows NaN.
    const double reach = static_cast<double>(std::max(p.seq.lq, p.seq.max_q())) +
                         static_cast<double>(std::max(p.seq.lk, p.seq.max_k()));
    const double largest = p.dtype == DType::f64 || reach <= 1.0
                               ? std::numeric_limits<double>::infinity()
                               : std::numeric_limits<float>::max() / reach;
    for (std::int64_t b = 0; b < batches; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const float slope = p.alibi[b * p.alibi_stride_b + h * p.alibi_stride_h];
        if (std::isfinite(slope) && std::fabs(slope) <= largest) continue;
        std::string at;  // [b][h] or [h], by appends (GCC 12 warns on "[" + std::string)
        if (a.rank == 2) at.append("[").append(std::to_string(b)).append("]");
        at.append("[").append(std::to_string(h)).append("]");
        if (!std::isfinite(slope)) {
          check.fail("alibi_slopes holds a slope that is not finite (alibi_slopes" + at + "=" +
                     fmt_double(slope) + ", expected finite slopes)");
        }
        check.fail("alibi_slopes holds a slope too large for f32 arithmetic (alibi_slopes" + at +
                   "=" + fmt_double(slope) + ", expected |slope| <= " + fmt_double(largest) +
                   " = FLT_MAX / (Lq + Lk) with " + std::string(name_of(p.dtype)) +
                   " inputs: the bias slope * distance must be finite)");
      }
    }
  }

  // Mask: rank 2 [Lq|1, Lk|1] or rank 4 [B|1, Hq|1, Lq|1, Lk|1]; bool or any floating dtype.
  if (o.mask.has_value() && p.seq.varlen()) {
    check.unsupported(
        "mask is not supported with variable-length sequences (mask=given, expected none); use "
        "causal, window_left/window_right or seqused_k, or pad the batch and call the dense "
        "form");
  }
  if (o.mask.has_value()) {
    const TensorView& m = *o.mask;
    check.structure(m, "mask");
    if (m.dtype != DType::b8 && !is_floating(m.dtype)) {
      check.fail("mask has the wrong dtype (dtype=" + std::string(name_of(m.dtype)) +
                 ", expected bool or a floating type: f32, f64, bf16 or f16)");
    }
    if (m.rank != 2 && m.rank != 4) {
      check.fail("mask has the wrong rank (rank=" + std::to_string(m.rank) +
                 ", expected 2: [Lq|1, Lk|1] or 4: [B|1, Hq|1, Lq|1, Lk|1])");
    }
    const std::int64_t full[4] = {p.batch, p.heads_q, p.seq.lq, p.seq.lk};
    TensorView m4;
    m4.data = m.data;
    m4.dtype = m.dtype;
    m4.rank = 4;
    const int lead = 4 - m.rank;
    for (int d = 0; d < 4; ++d) {
      const std::int64_t size = d < lead ? 1 : m.size(d - lead);
      const std::int64_t stride = d < lead ? 0 : m.stride_of(d - lead);
      if (size != full[d] && size != 1) {
        check.fail("mask has shape " + m.shape_string() + ", expected it to broadcast to " +
                   dims_string(full + lead, m.rank) + " (each dim equal or 1)");
      }
      m4.shape[static_cast<std::size_t>(d)] = full[d];
      m4.stride[static_cast<std::size_t>(d)] = size == 1 ? 0 : stride;
    }
    p.mask = m4;
    p.mask_original = m;
    p.mask_kind = m.dtype == DType::b8 ? MaskKind::boolean : MaskKind::additive;
  }
  if (o.compute_dbias && p.mask_kind != MaskKind::additive) {
    check.fail("compute_dbias needs an additive mask (mask=" +
               std::string(p.mask_kind == MaskKind::none ? "none" : "bool") +
               ", expected a floating-point mask)");
  }
  p.compute_dbias = o.compute_dbias;
}

namespace {

void check_lse(const Checker& check, const TensorView& lse, const Params& p, const char* name) {
  check.view(lse, name, 3, "[B, Hq, Lq]");
  const DType want = p.dtype == DType::f64 ? DType::f64 : DType::f32;
  check.dtype(lse, name, want, " (f64 only for f64 inputs)");
  const std::int64_t expected[3] = {p.batch, p.heads_q, p.seq.lq};
  check.shape(lse, name, expected, "[B, Hq, Lq]");
}

void check_like(const Checker& check, const TensorView& t, const char* name, DType dtype,
                const std::int64_t* shape, const char* layout) {
  check.view(t, name, 4, layout);
  check.dtype(t, name, dtype, "");
  check.shape(t, name, shape, layout);
  check.unit_last_stride(t, name);
}

// The dtype `out` may have: q's, or f32 for 16-bit inputs. A forward writes the f32 out without
// rounding it to 16 bits, and a backward given it takes Delta = rowsum(dO * O) from it: from
// the 16-bit rounding, dQ and dK err 2-4x more than from the f32 out in FlashAttention's
// test_flash_attn_bwd_overflow case (tests/python/test_backward_precision.py).
DType out_dtype(const TensorView& out, const Params& p) {
  const bool sixteen_bit = p.dtype == DType::bf16 || p.dtype == DType::f16;
  return sixteen_bit && out.dtype == DType::f32 ? DType::f32 : p.dtype;
}

}  // namespace

Params validate_forward(const ForwardArgs& a, const Options& options, Backend backend,
                         bool check_outputs) {
  const Checker check("forward");
  Params p = resolve(check, a.q, a.k, a.v, options, backend);
  // compute_dbias only matters to backward; forward accepts the same options and ignores it.
  p.compute_dbias = false;
  if (!check_outputs) {
    check.count("out would have too many elements", "B * Hq * Lq * Dv",
                {p.batch, p.heads_q, p.seq.lq, p.head_dim_v});
    return p;
  }
  const std::int64_t out_shape[4] = {p.batch, p.heads_q, p.seq.lq, p.head_dim_v};
  check_like(check, a.out, "out", out_dtype(a.out, p), out_shape, "[B, Hq, Lq, Dv]");
  check.writable(a.out, "out");
  if (a.lse.data != nullptr || a.lse.rank != 0) {
    check_lse(check, a.lse, p, "lse");
    check.writable(a.lse, "lse");
  }
  check.separate(
      {{&a.out, "out"}, {&a.lse, "lse"}},
      {{&a.q, "query"}, {&a.k, "key"}, {&a.v, "value"}, alibi_view(options), mask_view(options)});
  return p;
}

Params validate_backward(const BackwardArgs& a, const Options& options, Backend backend,
                          bool check_outputs) {
  const Checker check("backward");
  Params p = resolve(check, a.q, a.k, a.v, options, backend);
  const std::int64_t out_shape[4] = {p.batch, p.heads_q, p.seq.lq, p.head_dim_v};
  check_like(check, a.dout, "dout", p.dtype, out_shape, "[B, Hq, Lq, Dv]");
  check_like(check, a.out, "out", out_dtype(a.out, p), out_shape, "[B, Hq, Lq, Dv]");
  check_lse(check, a.lse, p, "lse");
  if (!check_outputs) return p;
  check_like(check, a.dq, "dq", p.dtype, a.q.shape.data(), "like query");
  check_like(check, a.dk, "dk", p.dtype, a.k.shape.data(), "like key");
  check_like(check, a.dv, "dv", p.dtype, a.v.shape.data(), "like value");
  check.writable(a.dq, "dq");
  check.writable(a.dk, "dk");
  check.writable(a.dv, "dv");
  if (p.compute_dbias) {
    const TensorView& m = p.mask_original;
    check.view(a.dbias, "dbias", m.rank, "the mask's shape");
    check.dtype(a.dbias, "dbias", m.dtype, " like mask");
    check.shape(a.dbias, "dbias", m.shape.data(), "the mask's shape");
    check.writable(a.dbias, "dbias");
  } else if (a.dbias.data != nullptr) {
    check.fail("dbias is given but not asked for (compute_dbias=false, expected no dbias view)");
  }
  check.separate({{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}, {&a.dbias, "dbias"}},
                 {{&a.dout, "dout"},
                  {&a.q, "query"},
                  {&a.k, "key"},
                  {&a.v, "value"},
                  {&a.out, "out"},
                  {&a.lse, "lse"},
                  alibi_view(options),
                  mask_view(options)});
  return p;
}

}  // namespace attncore::detail
