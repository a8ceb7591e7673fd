// The independent fp64 attention oracle: Philox4x32-10, dense masks, forward and backward.
// Deliberately plain: one dense bias, one row at a time, no tiling, no online softmax.
#include "testing/oracle.h"

#include <cmath>
#include <cstdlib>
#include <limits>

namespace attncore::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// (hi, lo) halves of the 64-bit product a * b.
void mul_hi_lo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t product = static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b);
  hi = static_cast<std::uint32_t>(product >> 32);
  lo = static_cast<std::uint32_t>(product & 0xffffffffu);
}

// Index of element (b, h, i, j) of a tensor of `shape` broadcast to [B, Hq, Lq, Lk].
std::int64_t broadcast_index(const std::array<std::int64_t, 4>& shape, std::int64_t b,
                             std::int64_t h, std::int64_t i, std::int64_t j) {
  const std::int64_t bb = shape[0] == 1 ? 0 : b;
  const std::int64_t hh = shape[1] == 1 ? 0 : h;
  const std::int64_t ii = shape[2] == 1 ? 0 : i;
  const std::int64_t jj = shape[3] == 1 ? 0 : j;
  return ((bb * shape[1] + hh) * shape[2] + ii) * shape[3] + jj;
}

double apply(Rounder round, double x) { return round == nullptr ? x : round(x); }

// The scores of one (b, h) block before the dense bias: softcap(scale * q.k), [Lq, Lk], and the
// derivative of the softcap at each score (1 without softcap).
struct RawScores {
  std::vector<double> score;  // [Lq, Lk]
  std::vector<double> slope;  // [Lq, Lk]: d score / d (scale * q.k)
};

RawScores raw_scores(const Dims& d, const Spec& spec, const std::vector<double>& q,
                     const std::vector<double>& k, std::int64_t b, std::int64_t h) {
  const std::int64_t group = d.heads_q / d.heads_kv;
  const std::int64_t hk = h / group;
  RawScores r;
  r.score.assign(static_cast<std::size_t>(d.len_q * d.len_k), 0.0);
  r.slope.assign(r.score.size(), 1.0);
  for (std::int64_t i = 0; i < d.len_q; ++i) {
    const double* qi = &q[static_cast<std::size_t>(((b * d.heads_q + h) * d.len_q + i) * d.dim)];
    for (std::int64_t j = 0; j < d.len_k; ++j) {
      const double* kj =
          &k[static_cast<std::size_t>(((b * d.heads_kv + hk) * d.len_k + j) * d.dim)];
      double dot = 0.0;
      for (std::int64_t c = 0; c < d.dim; ++c) dot += qi[c] * kj[c];
      double s = spec.scale * dot;
      double slope = 1.0;
      if (spec.softcap > 0.0) {
        const double t = std::tanh(s / spec.softcap);
        s = spec.softcap * t;
        slope = 1.0 - t * t;
      }
      r.score[static_cast<std::size_t>(i * d.len_k + j)] = s;
      r.slope[static_cast<std::size_t>(i * d.len_k + j)] = slope;
    }
  }
  return r;
}

// Softmax of one row of final scores: probabilities P (before dropout) and the LSE. A row
// without a visible key gives P = 0 and LSE -inf; NaN scores give NaN.
double softmax_row(const double* s, std::int64_t n, double* p) {
  double m = -kInf;
  for (std::int64_t j = 0; j < n; ++j) {
    if (s[j] > m) m = s[j];
  }
  if (m == -kInf) {
    for (std::int64_t j = 0; j < n; ++j) p[j] = 0.0;
    // Only NaN scores can leave the maximum at -inf with visible keys.
    for (std::int64_t j = 0; j < n; ++j) {
      if (std::isnan(s[j])) {
        for (std::int64_t t = 0; t < n; ++t) p[t] = std::nan("");
        return std::nan("");
      }
    }
    return -kInf;
  }
  double sum = 0.0;
  for (std::int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
  for (std::int64_t j = 0; j < n; ++j) p[j] = std::exp(s[j] - m) / sum;
  return m + std::log(sum);
}

}  // namespace

std::array<std::uint32_t, 4> oracle_philox4x32_10(std::array<std::uint32_t, 4> counter,
                                                  std::array<std::uint32_t, 2> key) {
  // Multipliers and Weyl increments of the paper (Table 2 and section 3.3).
  constexpr std::uint32_t kM0 = 0xD2511F53u;
  constexpr std::uint32_t kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u;
  constexpr std::uint32_t kW1 = 0xBB67AE85u;
  std::uint32_t x0 = counter[0], x1 = counter[1], x2 = counter[2], x3 = counter[3];
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {  // the key schedule bumps the key before every round but the first
      k0 += kW0;
      k1 += kW1;
    }
    std::uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kM0, x0, hi0, lo0);
    mul_hi_lo(kM1, x2, hi1, lo1);
    const std::uint32_t y0 = hi1 ^ x1 ^ k0;
    const std::uint32_t y1 = lo1;
    const std::uint32_t y2 = hi0 ^ x3 ^ k1;
    const std::uint32_t y3 = lo0;
    x0 = y0;
    x1 = y1;
    x2 = y2;
    x3 = y3;
  }
  return {x0, x1, x2, x3};
}

// Stream positions are 128-bit: offset + element index may pass 2^64.
__extension__ typedef unsigned __int128 Position;

std::uint32_t oracle_philox_word_at(std::uint64_t seed, Position pos) {
  const Position block = pos / 4;  // the 128-bit counter
  std::array<std::uint32_t, 4> counter{};
  for (int w = 0; w < 4; ++w)
    counter[static_cast<std::size_t>(w)] = static_cast<std::uint32_t>(block >> (32 * w));
  const std::array<std::uint32_t, 2> key = {static_cast<std::uint32_t>(seed & 0xffffffffu),
                                            static_cast<std::uint32_t>(seed >> 32)};
  return oracle_philox4x32_10(counter, key)[static_cast<std::size_t>(pos % 4)];
}

std::uint32_t oracle_philox_word(std::uint64_t seed, std::uint64_t pos) {
  return oracle_philox_word_at(seed, pos);
}

float oracle_uniform(std::uint32_t word) {
  const float two_pow_minus_32 = std::ldexp(1.0f, -32);
  const float two_pow_minus_33 = std::ldexp(1.0f, -33);
  const float x = static_cast<float>(word);
  const float scaled = x * two_pow_minus_32;  // exact: a power-of-two scaling
  return scaled + two_pow_minus_33;
}

bool oracle_keep_at(std::uint64_t seed, Position pos, double p) {
  return oracle_uniform(oracle_philox_word_at(seed, pos)) > static_cast<float>(p);
}

bool oracle_keep(std::uint64_t seed, std::uint64_t pos, double p) {
  return oracle_keep_at(seed, pos, p);
}

std::vector<double> oracle_dense_bias(const Dims& d, const Spec& spec) {
  std::vector<double> bias(static_cast<std::size_t>(numel_of(d.score_shape())), 0.0);
  const std::int64_t diag = d.len_k - d.len_q;  // lower-right alignment: row i meets key i+diag
  std::size_t n = 0;
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.heads_q; ++h) {
      for (std::int64_t i = 0; i < d.len_q; ++i) {
        for (std::int64_t j = 0; j < d.len_k; ++j, ++n) {
          double value = 0.0;
          if (!spec.alibi.empty()) {
            const double slope =
                spec.alibi[static_cast<std::size_t>(spec.alibi_per_batch ? b * d.heads_q + h : h)];
            value -= slope * static_cast<double>(std::llabs(i + diag - j));
          }
          bool visible = true;
          if (spec.mask) {
            const double m = spec.mask->values[static_cast<std::size_t>(
                broadcast_index(spec.mask->shape, b, h, i, j))];
            if (spec.mask->is_bool) {
              visible = visible && m != 0.0;
            } else {
              value += m;
            }
          }
          if (spec.causal == CausalMode::upper_left) visible = visible && j <= i;
          if (spec.causal == CausalMode::lower_right) visible = visible && j <= i + diag;
          if (spec.window_left >= 0) visible = visible && j >= i + diag - spec.window_left;
          if (spec.window_right >= 0) visible = visible && j <= i + diag + spec.window_right;
          bias[n] = visible ? value : -kInf;
        }
      }
    }
  }
  return bias;
}

std::vector<std::uint8_t> oracle_dropout_mask(const Dims& d, const Spec& spec) {
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(numel_of(d.score_shape())), 1);
  if (spec.dropout_p == 0.0) return keep;
  for (std::size_t n = 0; n < keep.size(); ++n) {
    // Element (b, h, i, j) sits at ((b*Hq + h)*Lq + i)*Lk + j = n of the dense layout.
    keep[n] = oracle_keep_at(spec.seed, Position{spec.offset} + n, spec.dropout_p) ? 1 : 0;
  }
  return keep;
}

OracleForward oracle_forward(const Dims& d, const Spec& spec, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v,
                             Rounder round) {
  OracleForward result;
  result.out.assign(static_cast<std::size_t>(numel_of(d.out_shape())), 0.0);
  result.lse.assign(static_cast<std::size_t>(numel_of(d.lse_shape())), -kInf);
  const std::vector<double> bias = oracle_dense_bias(d, spec);
  const std::vector<std::uint8_t> keep = oracle_dropout_mask(d, spec);
  const double keep_scale = 1.0 / (1.0 - spec.dropout_p);
  const std::int64_t group = d.heads_q / d.heads_kv;
  std::vector<double> s(static_cast<std::size_t>(d.len_k));
  std::vector<double> p(static_cast<std::size_t>(d.len_k));
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.heads_q; ++h) {
      const RawScores raw = raw_scores(d, spec, q, k, b, h);
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < d.len_q; ++i) {
        const std::int64_t row = (b * d.heads_q + h) * d.len_q + i;
        for (std::int64_t j = 0; j < d.len_k; ++j) {
          const double bij = bias[static_cast<std::size_t>(row * d.len_k + j)];
          s[static_cast<std::size_t>(j)] =
              bij == -kInf ? -kInf : raw.score[static_cast<std::size_t>(i * d.len_k + j)] + bij;
        }
        const double lse = softmax_row(s.data(), d.len_k, p.data());
        result.lse[static_cast<std::size_t>(row)] = lse;
        if (lse == -kInf) continue;  // no visible key: output 0
        double* o = &result.out[static_cast<std::size_t>(row * d.dim_v)];
        for (std::int64_t j = 0; j < d.len_k; ++j) {
          double pj = apply(round, p[static_cast<std::size_t>(j)]);
          pj = keep[static_cast<std::size_t>(row * d.len_k + j)] != 0
                   ? apply(round, pj * keep_scale)
                   : 0.0;
          const double* vj =
              &v[static_cast<std::size_t>(((b * d.heads_kv + hk) * d.len_k + j) * d.dim_v)];
          for (std::int64_t c = 0; c < d.dim_v; ++c) o[c] += pj * vj[c];
        }
        for (std::int64_t c = 0; c < d.dim_v; ++c) o[c] = apply(round, o[c]);
      }
    }
  }
  return result;
}

OracleBackward oracle_backward(const Dims& d, const Spec& spec, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<double>& dout, Rounder round) {
  OracleBackward g;
  g.dq.assign(q.size(), 0.0);
  g.dk.assign(k.size(), 0.0);
  g.dv.assign(v.size(), 0.0);
  const bool want_dbias = spec.mask && !spec.mask->is_bool;
  if (want_dbias) g.dbias.assign(spec.mask->values.size(), 0.0);
  const std::vector<double> bias = oracle_dense_bias(d, spec);
  const std::vector<std::uint8_t> keep = oracle_dropout_mask(d, spec);
  const double keep_scale = 1.0 / (1.0 - spec.dropout_p);
  const std::int64_t group = d.heads_q / d.heads_kv;
  const auto lk = static_cast<std::size_t>(d.len_k);
  std::vector<double> s(lk), p(lk), pd(lk), dpd(lk);
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.heads_q; ++h) {
      const RawScores raw = raw_scores(d, spec, q, k, b, h);
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < d.len_q; ++i) {
        const std::int64_t row = (b * d.heads_q + h) * d.len_q + i;
        for (std::int64_t j = 0; j < d.len_k; ++j) {
          const double bij = bias[static_cast<std::size_t>(row * d.len_k + j)];
          s[static_cast<std::size_t>(j)] =
              bij == -kInf ? -kInf : raw.score[static_cast<std::size_t>(i * d.len_k + j)] + bij;
        }
        const double lse = softmax_row(s.data(), d.len_k, p.data());
        if (lse == -kInf) continue;  // no visible key: zero gradients
        const double* qi = &q[static_cast<std::size_t>(row * d.dim)];
        const double* doi = &dout[static_cast<std::size_t>(row * d.dim_v)];
        double* dqi = &g.dq[static_cast<std::size_t>(row * d.dim)];
        // P (rounded for the naive run), P after dropout, and the output row O_i.
        std::vector<double> o(static_cast<std::size_t>(d.dim_v), 0.0);
        for (std::int64_t j = 0; j < d.len_k; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          p[jj] = apply(round, p[jj]);
          pd[jj] = keep[static_cast<std::size_t>(row * d.len_k + j)] != 0
                       ? apply(round, p[jj] * keep_scale)
                       : 0.0;
          const double* vj =
              &v[static_cast<std::size_t>(((b * d.heads_kv + hk) * d.len_k + j) * d.dim_v)];
          for (std::int64_t c = 0; c < d.dim_v; ++c)
            o[static_cast<std::size_t>(c)] += pd[jj] * vj[c];
        }
        double delta = 0.0;  // Delta_i = sum(dO_i * O_i)
        for (std::int64_t c = 0; c < d.dim_v; ++c) {
          delta += doi[c] * apply(round, o[static_cast<std::size_t>(c)]);
        }
        for (std::int64_t j = 0; j < d.len_k; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          const std::size_t kv_row = static_cast<std::size_t>((b * d.heads_kv + hk) * d.len_k + j);
          const double* vj = &v[kv_row * static_cast<std::size_t>(d.dim_v)];
          const double* kj = &k[kv_row * static_cast<std::size_t>(d.dim)];
          double* dvj = &g.dv[kv_row * static_cast<std::size_t>(d.dim_v)];
          double* dkj = &g.dk[kv_row * static_cast<std::size_t>(d.dim)];
          // dV_j += P~_ij dO_i; dP~_ij = dO_i . V_j; dP_ij = dP~_ij * keep / (1 - p).
          double dp_dropped = 0.0;
          for (std::int64_t c = 0; c < d.dim_v; ++c) {
            dvj[c] += pd[jj] * doi[c];
            dp_dropped += doi[c] * vj[c];
          }
          dp_dropped = apply(round, dp_dropped);
          const double dp = keep[static_cast<std::size_t>(row * d.len_k + j)] != 0
                                ? dp_dropped * keep_scale
                                : 0.0;
          // dS_ij = P_ij (dP_ij - Delta_i): the gradient of the final score (and of the bias).
          const double ds = p[jj] == 0.0 ? 0.0 : apply(round, p[jj] * (dp - delta));
          if (want_dbias) {
            g.dbias[static_cast<std::size_t>(broadcast_index(spec.mask->shape, b, h, i, j))] += ds;
          }
          const double draw = ds * raw.slope[static_cast<std::size_t>(i * d.len_k + j)];
          for (std::int64_t c = 0; c < d.dim; ++c) {
            dqi[c] += spec.scale * draw * kj[c];
            dkj[c] += spec.scale * draw * qi[c];
          }
        }
      }
    }
  }
  if (round != nullptr) {
    for (auto* t : {&g.dq, &g.dk, &g.dv, &g.dbias}) {
      for (double& x : *t) x = round(x);
    }
  }
  return g;
}

}  // namespace attncore::test
