// Reference forward and backward: for every (b, h, i), the scores of all keys in fp64, the
// dense softmax, dropout, then the output or the gradients. See docs/design.md section 1.
//
// An oracle for users shares no code with what it checks: the masks, score modifiers and
// softmax here are plain loops of their own, written from docs/design.md section 1, not the
// policies the math and flash backends use. What it shares is the definition of the dropout
// stream (core/philox.h, checked against Philox's published known answers) and dtype
// conversion.
#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/convert.h"
#include "core/dbias.h"
#include "core/philox.h"
#include "core/sequence.h"
#include "core/threadpool.h"

namespace attncore::detail {

namespace {

constexpr double kNegInf = -INFINITY;

// Whether query row i sees key j under the causal and window masks (docs/design.md section 1.3).
bool visible(const Params& p, std::int64_t i, std::int64_t j) {
  const std::int64_t diag = i + p.seq.lk - p.seq.lq;  // the lower-right diagonal of row i
  if (p.causal == Causal::upper_left && j > i) return false;
  if (p.causal == Causal::lower_right && j > diag) return false;
  if (p.window_left >= 0 && j < diag - p.window_left) return false;
  if (p.window_right >= 0 && j > diag + p.window_right) return false;
  return true;
}

// s[j]: on entry <q_i, k_j>; on return the final score of docs/design.md section 1.2-1.3 (scale,
// softcap, ALiBi, additive mask) or -inf where a mask hides key j. dcap[j] (when not null):
// d(score)/d(scale q.k), 1 - tanh^2 under softcap, 0 where hidden.
void final_scores(const Params& p, std::int64_t b, std::int64_t h, std::int64_t i, double* s,
                  double* dcap) {
  const double slope =
      p.alibi ? static_cast<double>(p.alibi[b * p.alibi_stride_b + h * p.alibi_stride_h]) : 0.0;
  for (std::int64_t j = 0; j < p.seq.lk; ++j) {
    if (dcap) dcap[j] = 0.0;
    if (!visible(p, i, j)) {
      s[j] = kNegInf;
      continue;
    }
    double x = p.scale * s[j];
    double d = 1.0;
    if (p.softcap != 0.0) {
      const double t = std::tanh(x / p.softcap);
      x = p.softcap * t;
      d = 1.0 - t * t;
    }
    if (p.alibi) x -= slope * std::fabs(static_cast<double>(i + p.seq.lk - p.seq.lq - j));
    if (p.mask_kind != MaskKind::none) {
      const double m = load_element<double>(p.mask.data, p.mask.dtype, offset4(p.mask, b, h, i, j));
      if (p.mask_kind == MaskKind::additive) {
        x += m;
      } else if (m == 0.0) {
        s[j] = kNegInf;
        continue;
      }
    }
    s[j] = x;
    if (dcap) dcap[j] = d;
  }
}

// s -> softmax(s) in place over n keys; returns log(sum_j exp(s_j)). No visible key: P = 0 and
// -inf; a NaN score: NaN.
double softmax(double* s, std::int64_t n) {
  double m = kNegInf;
  bool nan = false;
  for (std::int64_t j = 0; j < n; ++j) {
    nan |= std::isnan(s[j]);
    m = std::max(m, s[j]);
  }
  if (nan) m = NAN;
  if (m == kNegInf) {
    for (std::int64_t j = 0; j < n; ++j) s[j] = 0.0;
    return kNegInf;
  }
  double sum = 0.0;
  for (std::int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
  for (std::int64_t j = 0; j < n; ++j) s[j] /= sum;
  return m + std::log(sum);
}

// The dropout factor of element (b, h, i, j): 1/(1-p) if kept, else 0 (1 without dropout);
// addressed as in a [B, Hq, dropout.rows, dropout.cols] batch (docs/design.md section 1.5).
double dropout_factor(const Params& p, std::int64_t b, std::int64_t h, std::int64_t i,
                      std::int64_t j) {
  if (!p.dropout.active()) return 1.0;
  using U = std::uint64_t;  // the element index is < 2^63; offset + index may pass 2^64
  const U index =
      ((static_cast<U>(b) * static_cast<U>(p.heads_q) + static_cast<U>(h)) *
           static_cast<U>(p.dropout.rows) +
       static_cast<U>(i)) *
          static_cast<U>(p.dropout.cols) +
      static_cast<U>(j);
  const U pos = p.dropout.offset + index;
  const bool keep = dropout_keep(p.dropout.seed, pos, static_cast<float>(p.dropout.p),
                                 pos < p.dropout.offset ? 1 : 0);
  return keep ? 1.0 / (1.0 - p.dropout.p) : 0.0;
}

// scores[j] = <q[b, h, i, :], k[b, h / group, j, :]> in fp64, j in [0, Lk) (key j of a paged
// sequence through its pages: kv_offset).
void dot_row(const Params& p, const TensorView& q, const TensorView& k, std::int64_t b,
             std::int64_t h, std::int64_t i, double* scores) {
  const std::int64_t kv_head = h / p.group;
  const std::int64_t q_row = offset4(q, b, h, i, 0);
  for (std::int64_t j = 0; j < p.seq.lk; ++j) {
    const std::int64_t k_row = kv_offset(p, k, b, kv_head, j);
    double dot = 0.0;
    for (std::int64_t d = 0; d < p.head_dim; ++d) {
      dot += load_element<double>(q.data, q.dtype, q_row + d) *
             load_element<double>(k.data, k.dtype, k_row + d);
    }
    scores[j] = dot;
  }
}

// Sequences [b_begin, b_end) of a dense call (or one resolved sequence of a varlen call). The
// cancel flag is read before each row.
void forward_rows(const Params& p, const Launch& launch, const ForwardArgs& a, std::int64_t b_begin,
                  std::int64_t b_end) {
  const std::int64_t rows = (b_end - b_begin) * p.heads_q * p.seq.lq;
  parallel_for(rows, launch.threads, [&](std::int64_t row_begin, std::int64_t row_end) {
    std::vector<double> probs(static_cast<std::size_t>(p.seq.lk));  // [Lk]
    std::vector<double> out(static_cast<std::size_t>(p.head_dim_v));  // [Dv]
    for (std::int64_t row = row_begin; row < row_end; ++row) {
      launch.check_cancel();
      const std::int64_t i = row % p.seq.lq;
      const std::int64_t h = (row / p.seq.lq) % p.heads_q;
      const std::int64_t b = b_begin + row / (p.seq.lq * p.heads_q);
      const std::int64_t kv_head = h / p.group;
      dot_row(p, a.q, a.k, b, h, i, probs.data());
      final_scores(p, b, h, i, probs.data(), nullptr);
      const double lse = softmax(probs.data(), p.seq.lk);
      std::fill(out.begin(), out.end(), 0.0);
      for (std::int64_t j = 0; j < p.seq.lk; ++j) {
        const double weight = probs[static_cast<std::size_t>(j)] * dropout_factor(p, b, h, i, j);
        if (weight == 0.0) continue;
        const std::int64_t v_row = kv_offset(p, a.v, b, kv_head, j);
        for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
          out[static_cast<std::size_t>(d)] +=
              weight * load_element<double>(a.v.data, a.v.dtype, v_row + d);
        }
      }
      store_row(out.data(), p.head_dim_v, a.out.data, a.out.dtype, offset4(a.out, b, h, i, 0));
      if (a.lse.data != nullptr) {
        store_element(a.lse.data, a.lse.dtype,
                      b * a.lse.stride[0] + h * a.lse.stride[1] + i * a.lse.stride[2], lse);
      }
    }
  });
}

// The cancel flag is read before each query row.
void backward_rows(const Params& p, const Launch& launch, const BackwardArgs& a,
                   std::int64_t b_begin, std::int64_t b_end) {
  DbiasAccumulator dbias(p);
  // Tasks own (b, kv head): its dk/dv rows and the dq rows of its query heads. They share
  // dbias only when the mask broadcasts across them; then one task runs at a time.
  const int threads = dbias.shared_across(p) ? 1 : launch.threads;
  const std::int64_t tasks = (b_end - b_begin) * p.heads_kv;
  parallel_for(tasks, threads, [&](std::int64_t task_begin, std::int64_t task_end) {
    const auto lk = static_cast<std::size_t>(p.seq.lk);
    std::vector<double> probs(lk), dcap(lk);                               // [Lk]
    std::vector<double> dk(lk * static_cast<std::size_t>(p.head_dim));     // [Lk, D]
    std::vector<double> dv(lk * static_cast<std::size_t>(p.head_dim_v));   // [Lk, Dv]
    std::vector<double> dq(static_cast<std::size_t>(p.head_dim));          // [D]
    std::vector<double> q_row(static_cast<std::size_t>(p.head_dim));       // [D]
    std::vector<double> dout_row(static_cast<std::size_t>(p.head_dim_v));  // [Dv]
    for (std::int64_t task = task_begin; task < task_end; ++task) {
      const std::int64_t b = b_begin + task / p.heads_kv, kv_head = task % p.heads_kv;
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (std::int64_t h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
        for (std::int64_t i = 0; i < p.seq.lq; ++i) {
          launch.check_cancel();
          std::fill(dq.begin(), dq.end(), 0.0);
          const double lse =
              load_element<double>(a.lse.data, a.lse.dtype,
                                   b * a.lse.stride[0] + h * a.lse.stride[1] + i * a.lse.stride[2]);
          if (lse != -INFINITY && p.seq.lk > 0) {
            load_row(a.q.data, a.q.dtype, offset4(a.q, b, h, i, 0), p.head_dim, q_row.data());
            load_row(a.dout.data, a.dout.dtype, offset4(a.dout, b, h, i, 0), p.head_dim_v,
                     dout_row.data());
            // Delta_i = sum_d dO[i, d] * O[i, d]
            double delta = 0.0;
            const std::int64_t out_row = offset4(a.out, b, h, i, 0);
            for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
              delta += dout_row[static_cast<std::size_t>(d)] *
                       load_element<double>(a.out.data, a.out.dtype, out_row + d);
            }
            dot_row(p, a.q, a.k, b, h, i, probs.data());
            final_scores(p, b, h, i, probs.data(), dcap.data());
            double* dbias_row = dbias.active() ? dbias.row(b, h, i) : nullptr;
            for (std::int64_t j = 0; j < p.seq.lk; ++j) {
              const auto ju = static_cast<std::size_t>(j);
              // P[i, j], 0 where masked (even where the row's LSE is NaN)
              const double prob = probs[ju] == -INFINITY ? 0.0 : std::exp(probs[ju] - lse);
              if (prob == 0.0) continue;
              const double keep = dropout_factor(p, b, h, i, j);
              const std::int64_t v_row = offset4(a.v, b, kv_head, j, 0);
              double dprob = 0.0;  // dP[i, j] = keep * <dO_i, v_j>
              for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
                const auto du = static_cast<std::size_t>(d);
                dprob += dout_row[du] * load_element<double>(a.v.data, a.v.dtype, v_row + d);
                dv[ju * static_cast<std::size_t>(p.head_dim_v) + du] += prob * keep * dout_row[du];
              }
              const double dscore = prob * (keep * dprob - delta);  // dS = P (dP - Delta)
              if (dbias_row) dbias_row[j * dbias.column_stride()] += dscore;
              const double ddot = dscore * dcap[ju] * p.scale;  // d/d<q_i, k_j>
              const std::int64_t k_row = offset4(a.k, b, kv_head, j, 0);
              for (std::int64_t d = 0; d < p.head_dim; ++d) {
                const auto du = static_cast<std::size_t>(d);
                dq[du] += ddot * load_element<double>(a.k.data, a.k.dtype, k_row + d);
                dk[ju * static_cast<std::size_t>(p.head_dim) + du] += ddot * q_row[du];
              }
            }
          }
          store_row(dq.data(), p.head_dim, a.dq.data, a.dq.dtype, offset4(a.dq, b, h, i, 0));
        }
      }
      for (std::int64_t j = 0; j < p.seq.lk; ++j) {
        const auto ju = static_cast<std::size_t>(j);
        store_row(dk.data() + ju * static_cast<std::size_t>(p.head_dim), p.head_dim, a.dk.data,
                  a.dk.dtype, offset4(a.dk, b, kv_head, j, 0));
        store_row(dv.data() + ju * static_cast<std::size_t>(p.head_dim_v), p.head_dim_v, a.dv.data,
                  a.dv.dtype, offset4(a.dv, b, kv_head, j, 0));
      }
    }
  });
  dbias.store(a.dbias);
}

}  // namespace

void reference_forward(const Params& p, const Launch& launch, const ForwardArgs& a) {
  for_each_sequence(p, a,
                    [&](const Params& sp, const ForwardArgs& sa, std::int64_t b0, std::int64_t b1) {
                      forward_rows(sp, launch, sa, b0, b1);
                    });
}

void reference_backward(const Params& p, const Launch& launch, const BackwardArgs& a) {
  for_each_sequence(
      p, a, [&](const Params& sp, const BackwardArgs& sa, std::int64_t b0, std::int64_t b1) {
        backward_rows(sp, launch, sa, b0, b1);
      });
}

double reference_workspace_bytes(Pass pass, const Params& p, const Launch& launch) {
  const double lk = static_cast<double>(p.seq.max_k()), threads = std::max(1, launch.threads);
  const double d = static_cast<double>(p.head_dim), dv = static_cast<double>(p.head_dim_v);
  if (pass == Pass::forward) return 8 * threads * (lk + dv);
  return 8 * threads * (lk * (2 + d + dv) + 2 * d + dv);
}

}  // namespace attncore::detail
