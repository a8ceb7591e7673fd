// Math backend: BLAS GEMMs for QK^T, PV and the backward products; score_row.h in between.
#include "cpu/math.h"

#include <cblas.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/convert.h"
#include "core/dbias.h"
#include "core/threadpool.h"
#include "policy/score_row.h"

namespace attncore::detail {

namespace {

// C[m, n] = alpha * op(A) op(B) + beta * C, row-major.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
          const double* a, std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c,
          std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

template <class T>
constexpr DType dtype_of() {
  return sizeof(T) == 4 ? DType::f32 : DType::f64;
}

// One head of a rank-4 view as a row-major [rows, cols] matrix for BLAS: the view's own memory
// when its dtype is T and its row stride is usable as a leading dimension, else a converted
// copy in `buffer`.
template <class T>
struct Matrix {
  const T* data;
  std::int64_t ld;
};

template <class T>
Matrix<T> head_matrix(const TensorView& t, std::int64_t b, std::int64_t h, std::int64_t rows,
                      std::int64_t cols, std::vector<T>& buffer) {
  const std::int64_t base = offset4(t, b, h, 0, 0);
  if (t.dtype == dtype_of<T>() && (rows == 1 || t.stride[2] >= cols)) {
    return {static_cast<const T*>(t.data) + base, rows == 1 ? cols : t.stride[2]};
  }
  buffer.resize(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    load_row(t.data, t.dtype, base + r * t.stride[2], cols, buffer.data() + r * cols);
  }
  return {buffer.data(), cols};
}

// Writes a [rows, cols] row-major matrix into one head of a rank-4 view.
template <class T>
void store_head(const T* src, const TensorView& t, std::int64_t b, std::int64_t h,
                std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    store_row(src + r * cols, cols, t.data, t.dtype, offset4(t, b, h, r, 0));
  }
}

template <class T>
T load_lse(const TensorView& lse, std::int64_t b, std::int64_t h, std::int64_t i) {
  return load_element<T>(lse.data, lse.dtype, b * lse.stride[0] + h * lse.stride[1] + i * lse.stride[2]);
}

// BLAS threads follow the call's thread count (OpenBLAS's setting is process-wide).
void set_blas_threads(int threads) { openblas_set_num_threads(threads); }

template <class T>
void forward_impl(const Problem& p, const ForwardArgs& a) {
  const CausalWindowMask causal_window(p);
  const std::int64_t lq = p.seqlen_q, lk = p.seqlen_k, d = p.head_dim, dv = p.head_dim_v;
  std::vector<T> q_buf, k_buf, v_buf;
  std::vector<T> scores(static_cast<std::size_t>(lq * lk));  // [Lq, Lk]: S, then P
  std::vector<T> out(static_cast<std::size_t>(lq * dv));     // [Lq, Dv]
  std::vector<T> lse(static_cast<std::size_t>(lq));          // [Lq]
  set_blas_threads(p.threads);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.heads_kv; ++kv_head) {
      const Matrix<T> k = head_matrix<T>(a.k, b, kv_head, lk, d, k_buf);  // [Lk, D]
      const Matrix<T> v = head_matrix<T>(a.v, b, kv_head, lk, dv, v_buf);  // [Lk, Dv]
      for (std::int64_t h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
        if (lk > 0) {
          const Matrix<T> q = head_matrix<T>(a.q, b, h, lq, d, q_buf);  // [Lq, D]
          gemm(false, true, lq, lk, d, T(1), q.data, q.ld, k.data, k.ld, T(0), scores.data(), lk);
        }
        parallel_for(lq, p.threads, [&](std::int64_t i_begin, std::int64_t i_end) {
          for (std::int64_t i = i_begin; i < i_end; ++i) {
            T* row = scores.data() + i * lk;
            finish_scores<T>(p, causal_window, b, h, i, row, nullptr);
            lse[static_cast<std::size_t>(i)] = softmax_row(row, lk);
            const DropoutRow dropout(p, b, h, i);
            if (dropout.active()) {
              for (std::int64_t j = 0; j < lk; ++j) row[j] *= dropout.factor<T>(j);
            }
          }
        });
        if (lk > 0) {
          gemm(false, false, lq, dv, lk, T(1), scores.data(), lk, v.data, v.ld, T(0), out.data(), dv);
        } else {
          std::fill(out.begin(), out.end(), T(0));
        }
        store_head(out.data(), a.out, b, h, lq, dv);
        if (a.lse.data != nullptr) {
          for (std::int64_t i = 0; i < lq; ++i) {
            store_element(a.lse.data, a.lse.dtype, b * a.lse.stride[0] + h * a.lse.stride[1] + i * a.lse.stride[2],
                          lse[static_cast<std::size_t>(i)]);
          }
        }
      }
    }
  }
}

template <class T>
void backward_impl(const Problem& p, const BackwardArgs& a) {
  const CausalWindowMask causal_window(p);
  DbiasAccumulator dbias(p);
  const std::int64_t lq = p.seqlen_q, lk = p.seqlen_k, d = p.head_dim, dv = p.head_dim_v;
  const bool dropout_on = p.dropout_p > 0.0, softcap_on = p.softcap != 0.0;
  std::vector<T> q_buf, k_buf, v_buf, do_buf, o_buf;
  std::vector<T> probs(static_cast<std::size_t>(lq * lk));                           // [Lq, Lk] P
  std::vector<T> dprobs(static_cast<std::size_t>(lq * lk));                          // [Lq, Lk] dP -> dS
  std::vector<T> kept(dropout_on ? static_cast<std::size_t>(lq * lk) : 0);           // [Lq, Lk] P * M
  std::vector<T> dcap(softcap_on ? static_cast<std::size_t>(lq * lk) : 0);           // [Lq, Lk]
  std::vector<T> dq(static_cast<std::size_t>(lq * d));                               // [Lq, D]
  std::vector<T> dk(static_cast<std::size_t>(lk * d)), dvv(static_cast<std::size_t>(lk * dv));  // [Lk, D], [Lk, Dv]
  // Rows of one head add into the same dbias row when the mask broadcasts over Lq.
  const int row_threads = dbias.active() && p.mask.stride[2] == 0 ? 1 : p.threads;
  set_blas_threads(p.threads);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.heads_kv; ++kv_head) {
      std::fill(dk.begin(), dk.end(), T(0));
      std::fill(dvv.begin(), dvv.end(), T(0));
      const Matrix<T> k = head_matrix<T>(a.k, b, kv_head, lk, d, k_buf);  // [Lk, D]
      const Matrix<T> v = head_matrix<T>(a.v, b, kv_head, lk, dv, v_buf);  // [Lk, Dv]
      for (std::int64_t h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
        if (lk == 0 || lq == 0) {
          std::fill(dq.begin(), dq.end(), T(0));
          store_head(dq.data(), a.dq, b, h, lq, d);
          continue;
        }
        const Matrix<T> q = head_matrix<T>(a.q, b, h, lq, d, q_buf);         // [Lq, D]
        const Matrix<T> dout = head_matrix<T>(a.dout, b, h, lq, dv, do_buf);  // [Lq, Dv]
        const Matrix<T> out = head_matrix<T>(a.out, b, h, lq, dv, o_buf);     // [Lq, Dv]
        gemm(false, true, lq, lk, d, T(1), q.data, q.ld, k.data, k.ld, T(0), probs.data(), lk);
        gemm(false, true, lq, lk, dv, T(1), dout.data, dout.ld, v.data, v.ld, T(0), dprobs.data(), lk);
        parallel_for(lq, row_threads, [&](std::int64_t i_begin, std::int64_t i_end) {
          for (std::int64_t i = i_begin; i < i_end; ++i) {
            T* prob = probs.data() + i * lk;
            T* dprob = dprobs.data() + i * lk;
            T* cap = softcap_on ? dcap.data() + i * lk : nullptr;
            finish_scores<T>(p, causal_window, b, h, i, prob, cap);
            const T lse = load_lse<T>(a.lse, b, h, i);
            T delta = 0;  // Delta_i = <dO_i, O_i>
            for (std::int64_t e = 0; e < dv; ++e) delta += dout.data[i * dout.ld + e] * out.data[i * out.ld + e];
            const DropoutRow dropout(p, b, h, i);
            double* dbias_row = dbias.active() ? dbias.row(b, h, i) : nullptr;
            for (std::int64_t j = 0; j < lk; ++j) {
              // P = exp(s - LSE); a row with LSE = -inf has no visible key and P = 0.
              const T pr = lse == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(prob[j] - lse);
              const T keep = dropout.factor<T>(j);
              if (dropout_on) kept[static_cast<std::size_t>(i * lk + j)] = pr * keep;
              prob[j] = pr;
              const T dscore = pr == T(0) ? T(0) : pr * (keep * dprob[j] - delta);  // dS = P (dP - Delta)
              if (dbias_row) dbias_row[j * dbias.column_stride()] += static_cast<double>(dscore);
              dprob[j] = dscore * static_cast<T>(p.scale) * (cap ? cap[j] : T(1));  // d/d<q_i, k_j>
            }
          }
        });
        const T* weights = dropout_on ? kept.data() : probs.data();
        gemm(true, false, lk, dv, lq, T(1), weights, lk, dout.data, dout.ld, T(1), dvv.data(), dv);  // dV += (P M)^T dO
        gemm(false, false, lq, d, lk, T(1), dprobs.data(), lk, k.data, k.ld, T(0), dq.data(), d);    // dQ = dS K
        gemm(true, false, lk, d, lq, T(1), dprobs.data(), lk, q.data, q.ld, T(1), dk.data(), d);     // dK += dS^T Q
        store_head(dq.data(), a.dq, b, h, lq, d);
      }
      store_head(dk.data(), a.dk, b, kv_head, lk, d);
      store_head(dvv.data(), a.dv, b, kv_head, lk, dv);
    }
  }
  dbias.store(a.dbias);
}

}  // namespace

void math_forward(const Problem& p, const ForwardArgs& a) {
  if (p.dtype == DType::f64) {
    forward_impl<double>(p, a);
  } else {
    forward_impl<float>(p, a);
  }
}

void math_backward(const Problem& p, const BackwardArgs& a) {
  if (p.dtype == DType::f64) {
    backward_impl<double>(p, a);
  } else {
    backward_impl<float>(p, a);
  }
}

}  // namespace attncore::detail
