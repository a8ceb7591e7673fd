// Reference forward and backward: for every (b, h, i), the scores of all keys in fp64, the
// dense softmax, dropout, then the output or the gradients. See DESIGN.md section 1.
#include "reference/reference.h"

#include <cmath>
#include <vector>

#include "core/convert.h"
#include "core/dbias.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "policy/score_row.h"

namespace attncore::detail {

namespace {

// scores[j] = <q[b, h, i, :], k[b, h / group, j, :]> in fp64, j in [0, Lk).
void dot_row(const Params& p, const TensorView& q, const TensorView& k, std::int64_t b,
             std::int64_t h, std::int64_t i, double* scores) {
  const std::int64_t kv_head = h / p.group;
  const std::int64_t q_row = offset4(q, b, h, i, 0);
  for (std::int64_t j = 0; j < p.seq.lk; ++j) {
    const std::int64_t k_row = offset4(k, b, kv_head, j, 0);
    double dot = 0.0;
    for (std::int64_t d = 0; d < p.head_dim; ++d) {
      dot += load_element<double>(q.data, q.dtype, q_row + d) *
             load_element<double>(k.data, k.dtype, k_row + d);
    }
    scores[j] = dot;
  }
}

// Sequences [b_begin, b_end) of a dense call (or one resolved sequence of a varlen call).
void forward_rows(const Params& p, int threads, const ForwardArgs& a, std::int64_t b_begin,
                  std::int64_t b_end) {
  const CausalWindowMask causal_window(p);
  const std::int64_t rows = (b_end - b_begin) * p.heads_q * p.seq.lq;
  parallel_for(rows, threads, [&](std::int64_t row_begin, std::int64_t row_end) {
    std::vector<double> probs(static_cast<std::size_t>(p.seq.lk));  // [Lk]
    std::vector<double> out(static_cast<std::size_t>(p.head_dim_v));  // [Dv]
    for (std::int64_t row = row_begin; row < row_end; ++row) {
      const std::int64_t i = row % p.seq.lq;
      const std::int64_t h = (row / p.seq.lq) % p.heads_q;
      const std::int64_t b = b_begin + row / (p.seq.lq * p.heads_q);
      const std::int64_t kv_head = h / p.group;
      dot_row(p, a.q, a.k, b, h, i, probs.data());
      finish_scores<double>(p, causal_window, b, h, i, probs.data(), nullptr);
      const double lse = softmax_row(probs.data(), p.seq.lk);
      const DropoutRow dropout(p, b, h, i);
      std::fill(out.begin(), out.end(), 0.0);
      for (std::int64_t j = 0; j < p.seq.lk; ++j) {
        const double weight = probs[static_cast<std::size_t>(j)] * dropout.factor<double>(j);
        if (weight == 0.0) continue;
        const std::int64_t v_row = offset4(a.v, b, kv_head, j, 0);
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

void backward_rows(const Params& p, int call_threads, const BackwardArgs& a, std::int64_t b_begin,
                   std::int64_t b_end) {
  const CausalWindowMask causal_window(p);
  DbiasAccumulator dbias(p);
  // Tasks own (b, kv head): its dk/dv rows and the dq rows of its query heads. They share
  // dbias only when the mask broadcasts across them; then one task runs at a time.
  const int threads = dbias.shared_across(p) ? 1 : call_threads;
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
            finish_scores<double>(p, causal_window, b, h, i, probs.data(), dcap.data());
            const DropoutRow dropout(p, b, h, i);
            double* dbias_row = dbias.active() ? dbias.row(b, h, i) : nullptr;
            for (std::int64_t j = 0; j < p.seq.lk; ++j) {
              const auto ju = static_cast<std::size_t>(j);
              const double prob = std::exp(probs[ju] - lse);  // P[i, j], 0 where masked
              if (prob == 0.0) continue;
              const double keep = dropout.factor<double>(j);
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
  for_each_sequence(p, a, [&](const Params& sp, const ForwardArgs& sa, std::int64_t b0,
                              std::int64_t b1) { forward_rows(sp, launch.threads, sa, b0, b1); });
}

void reference_backward(const Params& p, const Launch& launch, const BackwardArgs& a) {
  for_each_sequence(p, a, [&](const Params& sp, const BackwardArgs& sa, std::int64_t b0,
                              std::int64_t b1) { backward_rows(sp, launch.threads, sa, b0, b1); });
}

}  // namespace attncore::detail
