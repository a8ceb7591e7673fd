// `--check`: a call's results against the reference backend in f64, judged by the rule of
// docs/design.md section 6.
//
// Scope. The reference runs plain fp64 loops, slow on big problems. Above kFullCheckMaxFlops a
// dense call is checked on batch 0 and the first query heads only: whole GQA groups (so dk/dv of
// the checked key heads get every contribution) and at least 2 query heads. A packed batch is
// checked on as many leading sequences, all heads, as the budget allows (at least one); when
// the first sequence alone is over it, on that sequence and the first query heads as above.
// The dropout stream position of (b, h, i, j) depends on Hq only through b * Hq, and the checked
// part keeps the call's Lq, Lk (max_seqlen_q, max_seqlen_k for a packed batch), so the part sees
// the same dropout mask as the whole call.
//
// Tolerances, as in the library's tests: f32 and f64 results within 1e-5 * max|v| / (1 - p) of the
// reference (gradients: 3e-5 of the gradient's largest magnitude plus 3e-6 of the largest over
// dq, dk and dv); bf16 and f16 results within twice the error of a naive run in the same dtype
// plus 2^-20 of the magnitudes (the FlashAttention test rule). The naive run is the plain
// row-by-row computation of this file in f64 with the probabilities, the output and the
// backward's intermediates rounded to the dtype, so the tolerance follows the dtype's rounding
// at this problem's size.
#include "check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace attncore_tools {

using attncore::Backend;
using attncore::Causal;
using attncore::DType;
using attncore::Tensor;
using attncore::TensorView;

const char* const kCheckRule =
    "f32, f64 1e-5 of max|v|, gradients alike; bf16, f16 2x a naive same-dtype run's error";

namespace {

// ~0.4 s of reference forward (~2.6 GFLOP/s measured on 2 Zen 5 cores), ~1 s with backward.
constexpr double kFullCheckMaxFlops = 1e9;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTiny = 1e-30;  // keeps a tolerance positive when every magnitude is 0

// ---------------------------------------------------------------------------------------------
// The checked part of a call.

struct CheckPart {
  std::int64_t batch, heads_q, heads_kv;  // leading sequences (batch entries) and heads
  bool full;
  std::string describe(const RunConfig& c) const {
    if (full) return "all";
    std::string s;
    if (c.is_varlen()) {
      s = batch == 1 ? "sequence 0" : "sequences 0-" + std::to_string(batch - 1);
      s += " of " + std::to_string(c.batch);
    } else {
      s = "batch 0";
    }
    if (heads_q == c.heads_q) return s + ", all heads";
    return s + ", query heads 0-" + std::to_string(heads_q - 1) + ", key/value heads 0-" +
           std::to_string(heads_kv - 1);
  }
};

double pair_cost(const RunConfig& c, double pairs, std::int64_t heads) {
  return 2.0 * static_cast<double>(c.head_dim + c.head_dim_v) * static_cast<double>(heads) * pairs;
}

// Whole GQA groups, at least 2 query heads.
void few_heads(const RunConfig& c, CheckPart& s) {
  constexpr std::int64_t kMinHeads = 2;
  const std::int64_t group = c.heads_q / c.heads_kv;
  const std::int64_t groups = std::min(c.heads_kv, (kMinHeads + group - 1) / group);
  s.heads_q = groups * group;
  s.heads_kv = groups;
}

CheckPart check_part(const RunConfig& c) {
  CheckPart s{c.batch, c.heads_q, c.heads_kv, true};
  if (c.heads_kv == 0 || c.heads_q % c.heads_kv != 0) return s;
  if (!c.is_varlen()) {
    const double pairs = static_cast<double>(c.batch) * static_cast<double>(c.seqlen_q) *
                         static_cast<double>(c.seqlen_k);
    if (pair_cost(c, pairs, c.heads_q) <= kFullCheckMaxFlops) return s;
    s.batch = std::min<std::int64_t>(c.batch, 1);
    few_heads(c, s);
  } else {
    // The longest prefix of sequences that fits, all heads.
    double pairs = 0;
    std::int64_t n = 0;
    for (; n < c.batch; ++n) {
      const auto b = static_cast<std::size_t>(n);
      const double next =
          pairs + static_cast<double>(c.varlen[b]) * static_cast<double>(c.used_k()[b]);
      if (pair_cost(c, next, c.heads_q) > kFullCheckMaxFlops) break;
      pairs = next;
    }
    s.batch = n;
    if (n == 0) {
      s.batch = 1;
      few_heads(c, s);
    }
  }
  s.full = s.batch == c.batch && s.heads_q == c.heads_q;
  return s;
}

// The checked part of a view: dense [B, H, L, D] -> [batch, heads, L, D]; packed
// [rows, H, D] -> [rows, heads, D].
TensorView part_of(const TensorView& t, std::int64_t lead, std::int64_t heads) {
  TensorView s = t;
  s.shape[0] = lead;
  s.shape[1] = heads;
  return s;
}

std::int64_t sum_first(const std::vector<std::int64_t>& lengths, std::int64_t n) {
  std::int64_t total = 0;
  for (std::int64_t b = 0; b < n; ++b) total += lengths[static_cast<std::size_t>(b)];
  return total;
}

// ---------------------------------------------------------------------------------------------
// f64 copies and comparisons.

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

double max_abs(const Tensor& t) {
  const auto* x = t.data_as<double>();
  double m = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(x[i]));
  return m;
}

// ---------------------------------------------------------------------------------------------
// Dropout's keep decisions (docs/design.md section 1.5): word `pos` of the Philox4x32-10 stream
// keyed by the seed, u = x * 2^-32 + 2^-33 in fp32, keep iff u > p.

std::uint32_t philox_word(std::uint64_t seed, std::uint64_t pos) {
  // Multipliers and Weyl increments of Philox4x32 (Salmon et al., SC'11).
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  const std::uint64_t block = pos / 4;  // the counter; positions here stay below 2^64
  std::array<std::uint32_t, 4> x = {static_cast<std::uint32_t>(block),
                                    static_cast<std::uint32_t>(block >> 32), 0, 0};
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const std::uint64_t p0 = std::uint64_t{kM0} * x[0];
    const std::uint64_t p1 = std::uint64_t{kM1} * x[2];
    x = {static_cast<std::uint32_t>(p1 >> 32) ^ x[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ x[3] ^ k1, static_cast<std::uint32_t>(p0)};
  }
  return x[pos % 4];
}

bool keep(std::uint64_t seed, std::uint64_t pos, double p) {
  const float u = static_cast<float>(philox_word(seed, pos)) * 0x1.0p-32f + 0x1.0p-33f;
  return u > static_cast<float>(p);
}

// ---------------------------------------------------------------------------------------------
// The naive same-dtype run: one (sequence, head) at a time, row by row, as a framework's
// unfused attention in that dtype computes it.

using Rounder = double (*)(double);

double round_bf16(double x) { return static_cast<float>(attncore::bf16(static_cast<float>(x))); }
double round_f16(double x) { return static_cast<float>(attncore::f16(static_cast<float>(x))); }

// Rows of one (sequence, head) inside an f64 tensor: row i at data + i * stride.
struct Rows {
  double* data = nullptr;
  std::int64_t stride = 0;
  double* operator[](std::int64_t i) const { return data + i * stride; }
};

struct NaiveVariant {
  double scale = 1, softcap = 0;
  Causal causal = Causal::none;
  std::int64_t window_left = -1, window_right = -1;
  const TensorView* mask = nullptr;  // [Lq, Lk], dense calls only
  double dropout = 0;
  std::uint64_t seed = 0;
  Rounder round = nullptr;
  bool backward = false;
  std::int64_t dim = 0, dim_v = 0;
};

struct NaiveHead {
  Rows q, k, v, dout;    // inputs
  Rows out, dq, dk, dv;  // outputs; dk and dv add up over the query heads of a GQA group
  std::int64_t lq = 0, lk = 0;
  bool alibi = false;
  double slope = 0;
  std::uint64_t pos0 = 0;  // dropout position of (i, j): pos0 + i * pos_row + j
  std::uint64_t pos_row = 0;
};

void naive_head(const NaiveVariant& nv, const NaiveHead& h) {
  const std::int64_t diag = h.lk - h.lq;  // lower-right alignment: row i meets key i + diag
  const double keep_scale = 1.0 / (1.0 - nv.dropout);
  const auto n = static_cast<std::size_t>(h.lk);
  std::vector<double> s(n), slope(n), p(n), pd(n), o(static_cast<std::size_t>(nv.dim_v));
  std::vector<char> kept(n);
  for (std::int64_t i = 0; i < h.lq; ++i) {
    const double* qi = h.q[i];
    double m = -kInf;
    for (std::int64_t j = 0; j < h.lk; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      const double* kj = h.k[j];
      double dot = 0;
      for (std::int64_t c = 0; c < nv.dim; ++c) dot += qi[c] * kj[c];
      double x = nv.scale * dot;
      slope[jj] = 1;
      if (nv.softcap > 0) {
        const double t = std::tanh(x / nv.softcap);
        x = nv.softcap * t;
        slope[jj] = 1 - t * t;
      }
      if (h.alibi) x -= h.slope * static_cast<double>(std::llabs(i + diag - j));
      bool visible = true;
      if (nv.mask != nullptr) {
        const double mv = load(*nv.mask, i * h.lk + j);
        if (nv.mask->dtype == DType::b8) {
          visible = mv != 0;
        } else {
          x += mv;
        }
      }
      if (nv.causal == Causal::upper_left) visible = visible && j <= i;
      if (nv.causal == Causal::lower_right) visible = visible && j <= i + diag;
      if (nv.window_left >= 0) visible = visible && j >= i + diag - nv.window_left;
      if (nv.window_right >= 0) visible = visible && j <= i + diag + nv.window_right;
      s[jj] = visible ? x : -kInf;
      m = std::max(m, s[jj]);
      kept[jj] = nv.dropout == 0 || keep(nv.seed,
                                         h.pos0 + static_cast<std::uint64_t>(i) * h.pos_row +
                                             static_cast<std::uint64_t>(j),
                                         nv.dropout);
    }
    if (m == -kInf) continue;  // no visible key: output and gradients 0
    double sum = 0;
    for (std::size_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
    std::fill(o.begin(), o.end(), 0.0);
    for (std::int64_t j = 0; j < h.lk; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      p[jj] = nv.round(std::exp(s[jj] - m) / sum);
      pd[jj] = kept[jj] ? nv.round(p[jj] * keep_scale) : 0.0;
      const double* vj = h.v[j];
      for (std::int64_t c = 0; c < nv.dim_v; ++c) o[static_cast<std::size_t>(c)] += pd[jj] * vj[c];
    }
    double* oi = h.out[i];
    for (std::int64_t c = 0; c < nv.dim_v; ++c) oi[c] = nv.round(o[static_cast<std::size_t>(c)]);
    if (!nv.backward) continue;
    const double* doi = h.dout[i];
    double delta = 0;  // Delta_i = sum(dO_i * O_i)
    for (std::int64_t c = 0; c < nv.dim_v; ++c) delta += doi[c] * oi[c];
    double* dqi = h.dq[i];
    for (std::int64_t j = 0; j < h.lk; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      const double* vj = h.v[j];
      const double* kj = h.k[j];
      double* dvj = h.dv[j];
      double* dkj = h.dk[j];
      double dp_dropped = 0;  // dO_i . V_j
      for (std::int64_t c = 0; c < nv.dim_v; ++c) {
        dvj[c] += pd[jj] * doi[c];
        dp_dropped += doi[c] * vj[c];
      }
      const double dp = kept[jj] ? nv.round(dp_dropped) * keep_scale : 0.0;
      const double ds = p[jj] == 0 ? 0.0 : nv.round(p[jj] * (dp - delta));
      const double draw = ds * slope[jj];
      for (std::int64_t c = 0; c < nv.dim; ++c) {
        dqi[c] += nv.scale * draw * kj[c];
        dkj[c] += nv.scale * draw * qi[c];
      }
    }
  }
}

struct NaiveResult {
  Tensor out, dq, dk, dv;
};

// The naive same-dtype run of the checked part; q, k, v, dout are its f64 copies.
NaiveResult naive_run(const PreparedCall& p, const CheckPart& part, Rounder rounder,
                      const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* dout) {
  const RunConfig& c = p.cfg;
  const attncore::Options& o = p.options;
  NaiveVariant nv;
  nv.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  nv.softcap = o.softcap;
  nv.causal = o.causal;
  nv.window_left = o.window_left;
  nv.window_right = o.window_right;
  if (o.mask) nv.mask = &*o.mask;
  nv.dropout = o.dropout_p;
  nv.seed = o.seed;
  nv.round = rounder;
  nv.backward = dout != nullptr;
  nv.dim = c.head_dim;
  nv.dim_v = c.head_dim_v;

  NaiveResult r;
  std::array<std::int64_t, attncore::kMaxRank> out_shape = q.view().shape;
  out_shape[static_cast<std::size_t>(q.rank() - 1)] = c.head_dim_v;  // [.., Dv]
  r.out = Tensor(DType::f64, out_shape.data(), q.rank());
  if (nv.backward) {
    r.dq = Tensor(DType::f64, q.view().shape.data(), q.rank());
    r.dk = Tensor(DType::f64, k.view().shape.data(), k.rank());
    r.dv = Tensor(DType::f64, v.view().shape.data(), v.rank());
  }
  const std::int64_t hq = part.heads_q, hkv = part.heads_kv, group = hq / hkv;
  auto rows = [](const Tensor& t, std::int64_t offset, std::int64_t stride) {
    return t.defined() ? Rows{t.data_as<double>() + offset, stride} : Rows{};
  };
  for (std::int64_t b = 0; b < part.batch; ++b) {
    const auto bb = static_cast<std::size_t>(b);
    // Sequence b's first rows and row strides, in elements of [.., H, .., D] tensors.
    std::int64_t q_first, k_first, q_row, k_row, q_head, k_head;
    NaiveHead h;
    if (c.is_varlen()) {
      const std::int64_t row_q = sum_first(c.varlen, b), row_k = sum_first(c.varlen_k, b);
      h.lq = c.varlen[bb];
      h.lk = c.used_k()[bb];
      q_first = row_q * hq;  // times the head dim below
      k_first = row_k * hkv;
      q_row = hq;
      k_row = hkv;
      q_head = k_head = 1;
      h.pos_row = static_cast<std::uint64_t>(c.seqlen_k);
    } else {
      h.lq = c.seqlen_q;
      h.lk = c.seqlen_k;
      q_first = b * hq * c.seqlen_q;
      k_first = b * hkv * c.seqlen_k;
      q_row = k_row = 1;
      q_head = c.seqlen_q;
      k_head = c.seqlen_k;
      h.pos_row = static_cast<std::uint64_t>(c.seqlen_k);
    }
    for (std::int64_t head = 0; head < hq; ++head) {
      const std::int64_t kh = head / group;
      const std::int64_t qo = q_first + head * q_head, ko = k_first + kh * k_head;
      h.q = rows(q, qo * c.head_dim, q_row * c.head_dim);
      h.k = rows(k, ko * c.head_dim, k_row * c.head_dim);
      h.v = rows(v, ko * c.head_dim_v, k_row * c.head_dim_v);
      h.out = rows(r.out, qo * c.head_dim_v, q_row * c.head_dim_v);
      if (nv.backward) {
        h.dout = rows(*dout, qo * c.head_dim_v, q_row * c.head_dim_v);
        h.dq = rows(r.dq, qo * c.head_dim, q_row * c.head_dim);
        h.dk = rows(r.dk, ko * c.head_dim, k_row * c.head_dim);
        h.dv = rows(r.dv, ko * c.head_dim_v, k_row * c.head_dim_v);
      }
      h.alibi = o.alibi_slopes.has_value();
      if (h.alibi) h.slope = load(*o.alibi_slopes, head);
      // Element (b, head, i, j) of the whole call's stream; rows = Lq or max_seqlen_q.
      h.pos0 = ((static_cast<std::uint64_t>(b) * static_cast<std::uint64_t>(c.heads_q) +
                 static_cast<std::uint64_t>(head)) *
                static_cast<std::uint64_t>(c.seqlen_q)) *
               h.pos_row;
      naive_head(nv, h);
    }
  }
  if (nv.backward) {
    for (const Tensor* t : {&r.dq, &r.dk, &r.dv}) {
      auto* x = t->data_as<double>();
      for (std::int64_t i = 0; i < t->numel(); ++i) x[i] = rounder(x[i]);
    }
  }
  return r;
}

}  // namespace

CheckResult check_against_reference(const PreparedCall& p, const TensorView& out, const Tensor* dq,
                                    const Tensor* dk, const Tensor* dv) {
  const RunConfig& c = p.cfg;
  const CheckPart s = check_part(c);
  // The part's leading extent: batch entries, or the rows of its sequences.
  const std::int64_t lead_q = c.is_varlen() ? sum_first(c.varlen, s.batch) : s.batch;
  const std::int64_t lead_k = c.is_varlen() ? sum_first(c.varlen_k, s.batch) : s.batch;
  const Tensor q = to_f64(part_of(p.q, lead_q, s.heads_q));
  const Tensor k = to_f64(part_of(p.k, lead_k, s.heads_kv));
  const Tensor v = to_f64(part_of(p.v, lead_k, s.heads_kv));
  attncore::Options o = p.options;
  if (o.alibi_slopes) o.alibi_slopes->shape[0] = s.heads_q;  // [Hq]: the first heads' slopes
  attncore::VarlenSeqs seqs = p.seqs;  // the part's sequences: leading offsets, same maxima
  if (c.is_varlen()) {
    seqs.cu_seqlens_q.shape[0] = s.batch + 1;
    seqs.cu_seqlens_k.shape[0] = s.batch + 1;
    if (seqs.seqused_k) seqs.seqused_k->shape[0] = s.batch;
  }
  const attncore::ForwardResult ref =
      c.is_varlen() ? attncore::forward_varlen(q, k, v, seqs, o, Backend::reference)
                    : attncore::forward(q, k, v, o, Backend::reference);
  Tensor dout;
  attncore::BackwardResult g;
  if (dq != nullptr) {
    dout = to_f64(part_of(p.dout, lead_q, s.heads_q));
    g = c.is_varlen() ? attncore::backward_varlen(dout, q, k, v, ref.out, ref.lse, seqs, o,
                                                  Backend::reference)
                      : attncore::backward(dout, q, k, v, ref.out, ref.lse, o, Backend::reference);
  }

  // The naive same-dtype run, for 16-bit dtypes.
  const Rounder rounder = c.dtype == DType::bf16  ? round_bf16
                          : c.dtype == DType::f16 ? round_f16
                                                  : nullptr;
  NaiveResult naive;
  if (rounder != nullptr) {
    naive = naive_run(p, s, rounder, q, k, v, dq != nullptr ? &dout : nullptr);
  }

  CheckResult r;
  r.scope = s.describe(c);
  r.full = s.full;
  r.out_err = max_abs_diff(part_of(out, lead_q, s.heads_q), ref.out);
  const double vmax = max_abs(v) / (1.0 - o.dropout_p);
  r.out_tolerance = rounder == nullptr
                        ? 1e-5 * vmax + kTiny
                        : 2 * max_abs_diff(naive.out, ref.out) + 0x1.0p-20 * vmax + kTiny;
  r.out_ratio = r.out_err / r.out_tolerance;
  r.worst_ratio = r.out_ratio;
  if (dq != nullptr) {
    const double scale = std::max({max_abs(g.dq), max_abs(g.dk), max_abs(g.dv)});
    const struct {
      const Tensor& got;
      const Tensor& exact;
      const Tensor& naive;
      std::int64_t lead, heads;
    } grads[] = {{*dq, g.dq, naive.dq, lead_q, s.heads_q},
                 {*dk, g.dk, naive.dk, lead_k, s.heads_kv},
                 {*dv, g.dv, naive.dv, lead_k, s.heads_kv}};
    double grad_err = 0, grad_ratio = 0;
    for (const auto& t : grads) {
      const double err = max_abs_diff(part_of(t.got, t.lead, t.heads), t.exact);
      const double gmax = max_abs(t.exact);
      const double tol = rounder == nullptr ? 3e-5 * gmax + 3e-6 * scale + kTiny
                                            : 2 * max_abs_diff(t.naive, t.exact) +
                                                  0x1.0p-20 * (gmax + scale) + kTiny;
      grad_err = max_err(grad_err, err);
      grad_ratio = max_err(grad_ratio, err / tol);
    }
    r.grad_err = grad_err;
    r.grad_ratio = grad_ratio;
    r.worst_ratio = max_err(r.worst_ratio, grad_ratio);
  }
  return r;
}

}  // namespace attncore_tools
