// Input validation for forward and backward. Messages follow DESIGN.md section 4:
//   <op>: <what> <problem> (<name>=<value>, expected <constraint>)[; <remedy>]
#include "core/validate.h"

#include <cmath>
#include <sstream>
#include <string>

#include "attncore/error.h"

namespace attncore::detail {

namespace {

std::string fmt_double(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

std::string dims_string(const std::int64_t* dims, int n) {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < n; ++d) os << (d ? ", " : "") << dims[d];
  os << ']';
  return os.str();
}

class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(std::string(op_) + ": " + what);
  }
  [[noreturn]] void unsupported(const std::string& what) const {
    throw Unsupported(std::string(op_) + ": " + what);
  }

  // Structure every view must have: rank, non-negative sizes and strides, an element count and
  // an address range that fit in int64, data unless empty, unit last stride.
  void view(const TensorView& t, const char* name, int rank, const char* layout) const {
    if (t.rank != rank) {
      fail(std::string(name) + " has the wrong rank (rank=" + std::to_string(t.rank) +
           ", expected " + std::to_string(rank) + ": " + layout + ")");
    }
    structure(t, name);
  }

  void structure(const TensorView& t, const char* name) const {
    if (t.rank < 0 || t.rank > kMaxRank) {
      fail(std::string(name) + " has an invalid rank (rank=" + std::to_string(t.rank) +
           ", expected 0.." + std::to_string(kMaxRank) + ")");
    }
    if (static_cast<unsigned>(t.dtype) > static_cast<unsigned>(DType::b8)) {
      fail(std::string(name) + " has an invalid dtype (dtype=" +
           std::to_string(static_cast<unsigned>(t.dtype)) + ", expected a DType value)");
    }
    for (int d = 0; d < t.rank; ++d) {
      if (t.size(d) < 0) {
        fail(std::string(name) + " has a negative size (shape=" + t.shape_string() +
             ", expected sizes >= 0)");
      }
      if (t.stride_of(d) < 0) {
        fail(std::string(name) + " has a negative stride (stride[" + std::to_string(d) +
             "]=" + std::to_string(t.stride_of(d)) + ", expected >= 0)");
      }
    }
    const std::int64_t n = t.numel();
    if (n < 0) {
      fail(std::string(name) + " has too many elements (shape=" + t.shape_string() +
           ", expected an element count that fits in int64)");
    }
    if (n == 0) return;
    // The last element's offset, and its byte offset, must fit in int64.
    std::int64_t extent = 0;
    for (int d = 0; d < t.rank; ++d) {
      const std::int64_t span = t.size(d) - 1;
      if (span > 0 && t.stride_of(d) > (INT64_MAX - extent) / span) {
        fail(std::string(name) + " spans too much memory (shape=" + t.shape_string() +
             ", expected strides whose extent fits in int64)");
      }
      extent += span * t.stride_of(d);
    }
    if (extent > INT64_MAX / 8) {
      fail(std::string(name) + " spans too much memory (extent=" + std::to_string(extent) +
           " elements, expected < 2^60)");
    }
    if (t.data == nullptr) {
      fail(std::string(name) + " has null data with non-zero size (shape=" + t.shape_string() +
           ", expected a valid pointer)");
    }
  }

  // Strides of an empty view address nothing (numpy gives them all 0), so neither check below
  // applies to one.
  void unit_last_stride(const TensorView& t, const char* name) const {
    if (t.numel() == 0) return;
    if (t.rank > 0 && t.size(t.rank - 1) > 1 && t.stride_of(t.rank - 1) != 1) {
      fail(std::string(name) + " has a non-unit last stride (stride[" + std::to_string(t.rank - 1) +
           "]=" + std::to_string(t.stride_of(t.rank - 1)) +
           ", expected 1); make the head dimension contiguous");
    }
  }

  // An output may not map two elements to one address through a zero stride.
  void writable(const TensorView& t, const char* name) const {
    if (t.numel() == 0) return;
    for (int d = 0; d < t.rank; ++d) {
      if (t.size(d) > 1 && t.stride_of(d) == 0) {
        fail(std::string(name) + " is an output with a zero stride (stride[" + std::to_string(d) +
             "]=0, expected > 0 on dims of size > 1)");
      }
    }
  }

  void dtype(const TensorView& t, const char* name, DType expected, const char* like) const {
    if (t.dtype != expected) {
      fail(std::string(name) + " has the wrong dtype (dtype=" + std::string(name_of(t.dtype)) +
           ", expected " + std::string(name_of(expected)) + like + ")");
    }
  }

  void shape(const TensorView& t, const char* name, const std::int64_t* expected,
             const char* layout, const std::string& detail = "") const {
    for (int d = 0; d < t.rank; ++d) {
      if (t.size(d) != expected[d]) {
        fail(std::string(name) + " has shape " + t.shape_string() + ", expected " +
             dims_string(expected, t.rank) + " (" + layout + ")" + detail);
      }
    }
  }

 private:
  const char* op_;
};

// Checks of q, k, v and options shared by forward and backward.
Problem resolve(const Checker& check, const TensorView& q, const TensorView& k, const TensorView& v,
                const Options& o, Backend backend) {
  if (static_cast<unsigned>(backend) > static_cast<unsigned>(Backend::flash)) {
    check.unsupported("backend is not available in this build (backend=" +
                      std::to_string(static_cast<unsigned>(backend)) +
                      ", expected auto, reference, math or flash)");
  }
  check.view(q, "query", 4, "[B, Hq, Lq, D]");
  check.view(k, "key", 4, "[B, Hkv, Lk, D]");
  check.view(v, "value", 4, "[B, Hkv, Lk, Dv]");
  if (!is_floating(q.dtype)) {
    check.fail("query has an unsupported dtype (dtype=" + std::string(name_of(q.dtype)) +
               ", expected f32, f64, bf16 or f16)");
  }
  check.dtype(k, "key", q.dtype, " like query");
  check.dtype(v, "value", q.dtype, " like query");
  check.unit_last_stride(q, "query");
  check.unit_last_stride(k, "key");
  check.unit_last_stride(v, "value");

  Problem p;
  p.dtype = q.dtype;
  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.seqlen_q = q.size(2);
  p.head_dim = q.size(3);
  p.heads_kv = k.size(1);
  p.seqlen_k = k.size(2);
  p.head_dim_v = v.size(3);
  if (p.head_dim < 1) {
    check.fail("query has head dim 0 (D=0, expected D >= 1)");
  }
  if (p.head_dim_v < 1) {
    check.fail("value has head dim 0 (Dv=0, expected Dv >= 1)");
  }
  if (p.heads_q < 1) {
    check.fail("query has no heads (Hq=0, expected Hq >= 1)");
  }
  const std::int64_t k_expected[4] = {p.batch, k.size(1) < 1 ? 1 : k.size(1), p.seqlen_k,
                                      p.head_dim};
  const std::string heads = " with Hq % Hkv == 0 (Hq=" + std::to_string(p.heads_q) +
                            ", Hkv=" + std::to_string(k.size(1)) + ")";
  check.shape(k, "key", k_expected, "[B, Hkv, Lk, D]", heads);
  if (p.heads_q % p.heads_kv != 0) {
    check.fail("key has shape " + k.shape_string() + ", expected [" + std::to_string(p.batch) +
               ", Hkv, Lk, " + std::to_string(p.head_dim) + "]" + heads);
  }
  if (!o.enable_gqa && p.heads_kv != p.heads_q) {
    check.fail("key has fewer heads than query without GQA (Hkv=" + std::to_string(p.heads_kv) +
               ", expected Hkv == Hq=" + std::to_string(p.heads_q) + "); set enable_gqa");
  }
  p.group = p.heads_q / p.heads_kv;
  const std::int64_t v_expected[4] = {p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v};
  check.shape(v, "value", v_expected, "[B, Hkv, Lk, Dv] like key");

  // Scalars.
  if (o.scale.has_value()) {
    if (!std::isfinite(*o.scale) || *o.scale <= 0.0) {
      check.fail("scale is invalid (scale=" + fmt_double(*o.scale) +
                 ", expected a finite value > 0)");
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
  const std::int64_t widest = p.seqlen_q + p.seqlen_k;
  p.window_left = o.window_left > widest ? -1 : o.window_left;
  p.window_right = o.window_right > widest ? -1 : o.window_right;
  if (!std::isfinite(o.softcap) || o.softcap < 0.0) {
    check.fail("softcap is invalid (softcap=" + fmt_double(o.softcap) +
               ", expected a finite value >= 0; 0 = off)");
  }
  p.softcap = o.softcap;
  if (!(o.dropout_p >= 0.0 && o.dropout_p < 1.0)) {
    check.fail("dropout_p is out of range (dropout_p=" + fmt_double(o.dropout_p) +
               ", expected 0 <= dropout_p < 1)");
  }
  p.dropout_p = o.dropout_p;
  p.seed = o.seed;
  p.offset = o.offset;
  if (o.num_threads < 0) {
    check.fail("num_threads is negative (num_threads=" + std::to_string(o.num_threads) +
               ", expected >= 0; 0 = default)");
  }

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
  }

  // Mask: rank 2 [Lq|1, Lk|1] or rank 4 [B|1, Hq|1, Lq|1, Lk|1]; bool or any floating dtype.
  if (o.mask.has_value()) {
    const TensorView& m = *o.mask;
    check.structure(m, "mask");
    if (m.rank != 2 && m.rank != 4) {
      check.fail("mask has the wrong rank (rank=" + std::to_string(m.rank) +
                 ", expected 2: [Lq|1, Lk|1] or 4: [B|1, Hq|1, Lq|1, Lk|1])");
    }
    const std::int64_t full[4] = {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k};
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
  return p;
}

void check_lse(const Checker& check, const TensorView& lse, const Problem& p, const char* name) {
  check.view(lse, name, 3, "[B, Hq, Lq]");
  const DType want = p.dtype == DType::f64 ? DType::f64 : DType::f32;
  check.dtype(lse, name, want, " (f64 only for f64 inputs)");
  const std::int64_t expected[3] = {p.batch, p.heads_q, p.seqlen_q};
  check.shape(lse, name, expected, "[B, Hq, Lq]");
}

void check_like(const Checker& check, const TensorView& t, const char* name, DType dtype,
                const std::int64_t* shape, const char* layout) {
  check.view(t, name, 4, layout);
  check.dtype(t, name, dtype, "");
  check.shape(t, name, shape, layout);
  check.unit_last_stride(t, name);
}

}  // namespace

Problem validate_forward(const ForwardArgs& a, const Options& options, Backend backend,
                         bool check_outputs) {
  const Checker check("forward");
  Problem p = resolve(check, a.q, a.k, a.v, options, backend);
  // compute_dbias only matters to backward; forward accepts the same options and ignores it.
  p.compute_dbias = false;
  p.threads = options.num_threads;
  if (!check_outputs) return p;
  const std::int64_t out_shape[4] = {p.batch, p.heads_q, p.seqlen_q, p.head_dim_v};
  check_like(check, a.out, "out", p.dtype, out_shape, "[B, Hq, Lq, Dv]");
  check.writable(a.out, "out");
  if (a.lse.data != nullptr || a.lse.rank != 0) {
    check_lse(check, a.lse, p, "lse");
    check.writable(a.lse, "lse");
  }
  return p;
}

Problem validate_backward(const BackwardArgs& a, const Options& options, Backend backend,
                          bool check_outputs) {
  const Checker check("backward");
  Problem p = resolve(check, a.q, a.k, a.v, options, backend);
  const std::int64_t out_shape[4] = {p.batch, p.heads_q, p.seqlen_q, p.head_dim_v};
  check_like(check, a.dout, "dout", p.dtype, out_shape, "[B, Hq, Lq, Dv]");
  check_like(check, a.out, "out", p.dtype, out_shape, "[B, Hq, Lq, Dv]");
  check_lse(check, a.lse, p, "lse");
  p.threads = options.num_threads;
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
  return p;
}

}  // namespace attncore::detail
