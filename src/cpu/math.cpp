// Math backend: GEMMs for QK^T, PV and the backward products (cpu/gemm.h); score_row.h in
// between.
//
// Threads: work is cut into fixed blocks of kBlockRows query rows (or key rows in the
// backward's dK/dV pass) and every block makes the same single-threaded GEMM calls whatever the
// thread count, so results are bitwise identical for any number of threads. The products are
// our own (no BLAS), so a call changes no process-wide setting. The call's cancel flag is read
// before each block.
#include "cpu/math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/convert.h"
#include "core/dbias.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "cpu/gemm.h"
#include "policy/score_row.h"

namespace attncore::detail {

namespace {

// Query rows per block. Small enough that 2 threads get work at Lq = 256, large enough that
// the GEMMs stay efficient (a block is one A block of the GEMM: kGemmMc >= 128).
constexpr std::int64_t kBlockRows = 128;

// One thread's matrix products: the call's GEMM target and a packing buffer that grows to the
// largest product it has run (not zeroed: the GEMM writes what it reads).
template <class T>
class Products {
 public:
  explicit Products(const GemmTarget& target) : target_(&target) {}

  // C[m, n] = alpha * op(A) op(B) + beta * C, row-major; op transposes when trans_*.
  void operator()(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                  T alpha, const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c,
                  std::int64_t ldc) {
    const std::int64_t need = gemm_pack_elements(m, n, k);
    if (need > capacity_) {
      pack_.reset(new T[static_cast<std::size_t>(need)]);
      capacity_ = need;
    }
    const GemmMatrix<T> ma = trans_a ? GemmMatrix<T>{a, 1, lda} : GemmMatrix<T>{a, lda, 1};
    const GemmMatrix<T> mb = trans_b ? GemmMatrix<T>{b, 1, ldb} : GemmMatrix<T>{b, ldb, 1};
    if constexpr (sizeof(T) == 4) {
      target_->sgemm(m, n, k, alpha, ma, mb, beta, c, ldc, pack_.get());
    } else {
      target_->dgemm(m, n, k, alpha, ma, mb, beta, c, ldc, pack_.get());
    }
  }

 private:
  const GemmTarget* target_;
  std::unique_ptr<T[]> pack_;
  std::int64_t capacity_ = 0;
};

template <class T>
constexpr DType dtype_of() {
  return sizeof(T) == 4 ? DType::f32 : DType::f64;
}

// A row-major [rows, cols] matrix for the GEMMs: pointer and leading dimension.
template <class T>
struct Matrix {
  const T* data;
  std::int64_t ld;
};

// Rows [row_begin, row_begin + rows) of head (b, h) of a rank-4 view: the view's own memory
// when its dtype is T and its row stride is usable as a leading dimension (at least `cols`),
// else a converted copy in `buffer` (converted by `threads` threads; 16-bit rows to f32 by the
// target's vector widening: f16 K/V decode, B=1 Hq=32 D=128 Lk=16384, 1 thread, Zen 4, read
// 1.7 GB/s converted element by element, 6.1 this way).
template <class T>
Matrix<T> head_rows(const GemmTarget& target, const TensorView& t, std::int64_t b, std::int64_t h,
                    std::int64_t row_begin, std::int64_t rows, std::int64_t cols,
                    std::vector<T>& buffer, int threads = 1) {
  // No rows (a sequence with no keys: its gathered pages are an empty tensor, data null).
  if (rows == 0) return {static_cast<const T*>(t.data), std::max<std::int64_t>(cols, 1)};
  const std::int64_t base = offset4(t, b, h, row_begin, 0);
  if (t.dtype == dtype_of<T>() && (rows == 1 || t.stride[2] >= cols)) {
    return {static_cast<const T*>(t.data) + base, rows == 1 ? cols : t.stride[2]};
  }
  buffer.resize(static_cast<std::size_t>(rows * cols));
  if (rows * cols < kMathParallelConvertElements) threads = 1;
  parallel_for(rows, threads, [&](std::int64_t r_begin, std::int64_t r_end) {
    for (std::int64_t r = r_begin; r < r_end; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        if (t.dtype == DType::bf16 || t.dtype == DType::f16) {
          target.widen(static_cast<const std::uint16_t*>(t.data) + base + r * t.stride[2], t.dtype,
                       cols, buffer.data() + r * cols);
          continue;
        }
      }
      load_row(t.data, t.dtype, base + r * t.stride[2], cols, buffer.data() + r * cols);
    }
  });
  return {buffer.data(), cols};
}

// Writes a [rows, cols] row-major matrix into rows [row_begin, ...) of head (b, h) of a view.
// (f32 to bf16 or f16 by the call's target's vector rounding, GemmTarget::narrow.)
template <class T>
void store_rows(const GemmTarget& target, const T* src, const TensorView& t, std::int64_t b,
                std::int64_t h, std::int64_t row_begin, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t at = offset4(t, b, h, row_begin + r, 0);
    if constexpr (std::is_same_v<T, float>) {
      store_row_narrowed(target.narrow, src + r * cols, cols, t.data, t.dtype, at);
    } else {
      store_row(src + r * cols, cols, t.data, t.dtype, at);
    }
  }
}

std::int64_t lse_offset(const TensorView& lse, std::int64_t b, std::int64_t h, std::int64_t i) {
  return b * lse.stride[0] + h * lse.stride[1] + i * lse.stride[2];
}

std::int64_t num_blocks(std::int64_t rows) { return (rows + kBlockRows - 1) / kBlockRows; }

// Runs body(task) for tasks [0, n) on the call's threads; each thread first makes its own
// workspace with make_workspace() and passes it to every task it runs. The cancel flag is read
// before each task.
template <class MakeWorkspace, class Body>
void for_each_task(std::int64_t n, const Launch& launch, MakeWorkspace&& make_workspace,
                   Body&& body) {
  parallel_for(n, launch.threads, [&](std::int64_t begin, std::int64_t end) {
    auto workspace = make_workspace();
    for (std::int64_t task = begin; task < end; ++task) {
      launch.check_cancel();
      body(task, workspace);
    }
  });
}

// Keys a row's band hides (docs/design.md section 1.11) whose row of m ([Lk, width]) holds inf
// or NaN: the GEMMs multiply whole blocks, so they take m with these rows zeroed (`clean`, a
// copy in `buffer`) and add the rows back to the queries whose band holds them. Empty when the
// call has no band or every row is finite (then `clean` is m).
template <class T>
std::vector<std::int64_t> hidden_nonfinite_rows(const Params& p, const Matrix<T>& m,
                                                std::int64_t lk, std::int64_t width,
                                                std::vector<T>& buffer, Matrix<T>& clean) {
  std::vector<std::int64_t> bad;
  clean = m;
  if (p.causal == Causal::none && p.window_left < 0 && p.window_right < 0) return bad;
  for (std::int64_t j = 0; j < lk; ++j) {
    T zero = T(0);  // x * 0 is 0 for finite x, NaN for inf and NaN
    for (std::int64_t e = 0; e < width; ++e) zero += m.data[j * m.ld + e] * T(0);
    if (zero != T(0)) bad.push_back(j);
  }
  if (bad.empty()) return bad;
  buffer.resize(static_cast<std::size_t>(lk * width));
  for (std::int64_t j = 0; j < lk; ++j) {
    std::copy_n(m.data + j * m.ld, width, buffer.begin() + j * width);
  }
  for (std::int64_t j : bad) std::fill_n(buffer.begin() + j * width, width, T(0));
  clean = {buffer.data(), width};
  return bad;
}

// out[r][e] += factor * weight[r][j] * m[j][e] for the rows r of [row0, row0 + rows) whose band
// holds key j, for each j in `bad`: the share of the rows hidden_nonfinite_rows left out.
template <class T>
void add_hidden_rows(const CausalWindowMask& band, const std::vector<std::int64_t>& bad,
                     const Matrix<T>& m, std::int64_t width, std::int64_t row0, std::int64_t rows,
                     const T* weight, std::int64_t ld_weight, T factor, T* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const KeyRange visible = band.row(row0 + r);
    for (std::int64_t j : bad) {
      if (!visible.contains(j)) continue;
      const T w = factor * weight[r * ld_weight + j];
      for (std::int64_t e = 0; e < width; ++e) out[r * width + e] += w * m.data[j * m.ld + e];
    }
  }
}

template <class T>
void forward_impl(const Params& p, const Launch& launch, const GemmTarget& target,
                  const ForwardArgs& a, std::int64_t b_begin, std::int64_t b_end) {
  const int threads = launch.threads;
  const CausalWindowMask causal_window(p);
  const std::int64_t lq = p.seq.lq, lk = p.seq.lk, d = p.head_dim, dv = p.head_dim_v;
  const std::int64_t blocks = num_blocks(lq);
  struct Workspace {
    std::vector<T> q, scores, out;  // [rows, D], [rows, Lk] (S, then P), [rows, Dv]
    std::vector<bool> unseen;       // [rows]: the row sees no key
    Products<T> gemm;
  };
  std::vector<T> k_buf, v_buf, v_clean_buf;
  if (lq == 0) return;  // no query row: nothing to write (and no K/V to gather)
  for (std::int64_t b = b_begin; b < b_end; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.heads_kv; ++kv_head) {
      launch.check_cancel();  // (a head's gathers copy up to all of its K and V)
      const Matrix<T> k =
          head_rows<T>(target, a.k, b, kv_head, 0, lk, d, k_buf, threads);  // [Lk, D]
      const Matrix<T> v =
          head_rows<T>(target, a.v, b, kv_head, 0, lk, dv, v_buf, threads);  // [Lk, Dv]
      Matrix<T> v_clean = v;  // [Lk, Dv]: v without the rows in bad_v
      const std::vector<std::int64_t> bad_v =
          hidden_nonfinite_rows(p, v, lk, dv, v_clean_buf, v_clean);
      // Tasks: (query head of the group, block of query rows).
      for_each_task(
          p.group * blocks, launch,
          [&] {
            Workspace w{{}, {}, {}, {}, Products<T>(target)};
            w.scores.resize(static_cast<std::size_t>(std::min(lq, kBlockRows) * lk));
            w.out.resize(static_cast<std::size_t>(std::min(lq, kBlockRows) * dv));
            w.unseen.resize(static_cast<std::size_t>(std::min(lq, kBlockRows)));
            return w;
          },
          [&](std::int64_t task, Workspace& w) {
            const std::int64_t h = kv_head * p.group + task / blocks;
            const std::int64_t row0 = (task % blocks) * kBlockRows;
            const std::int64_t rows = std::min(kBlockRows, lq - row0);
            if (lk > 0) {
              const Matrix<T> q = head_rows<T>(target, a.q, b, h, row0, rows, d, w.q);  // [rows, D]
              w.gemm(false, true, rows, lk, d, T(1), q.data, q.ld, k.data, k.ld, T(0),
                     w.scores.data(), lk);
            }
            for (std::int64_t r = 0; r < rows; ++r) {
              const std::int64_t i = row0 + r;
              T* row = w.scores.data() + r * lk;
              finish_scores<T>(p, causal_window, b, h, i, row, nullptr);
              const T lse = softmax_row(row, lk);
              w.unseen[static_cast<std::size_t>(r)] = lse == -std::numeric_limits<T>::infinity();
              const DropoutRow dropout(p, b, h, i);
              if (dropout.active()) {
                for (std::int64_t j = 0; j < lk; ++j) row[j] *= dropout.factor<T>(j);
              }
              if (a.lse.data != nullptr)
                store_element(a.lse.data, a.lse.dtype, lse_offset(a.lse, b, h, i), lse);
            }
            if (lk > 0) {
              w.gemm(false, false, rows, dv, lk, T(1), w.scores.data(), lk, v_clean.data,
                     v_clean.ld, T(0), w.out.data(), dv);
              add_hidden_rows(causal_window, bad_v, v, dv, row0, rows, w.scores.data(), lk, T(1),
                              w.out.data());
            }
            // Rows that see no key are exactly 0 (0 weights times inf or NaN in V are not).
            for (std::int64_t r = 0; r < rows; ++r) {
              if (lk == 0 || w.unseen[static_cast<std::size_t>(r)]) {
                std::fill_n(w.out.begin() + r * dv, dv, T(0));
              }
            }
            store_rows(target, w.out.data(), a.out, b, h, row0, rows, dv);
          });
    }
  }
}

template <class T>
void backward_impl(const Params& p, const Launch& launch, const GemmTarget& target,
                   const BackwardArgs& a, std::int64_t b_begin, std::int64_t b_end) {
  const int threads = launch.threads;
  const CausalWindowMask causal_window(p);
  DbiasAccumulator dbias(p);
  const std::int64_t lq = p.seq.lq, lk = p.seq.lk, d = p.head_dim, dv = p.head_dim_v;
  const bool softcap_on = p.softcap != 0.0;
  const T scale = static_cast<T>(p.scale);
  const std::int64_t q_blocks = num_blocks(lq), k_blocks = num_blocks(lk);
  const auto area = static_cast<std::size_t>(lq * lk);
  std::vector<T> weights(area);                // [Lq, Lk] P * M (M: dropout factor): dV's weights
  std::vector<T> dscores(area);                // [Lq, Lk] dS = P (M dP - Delta)
  std::vector<T> dcap(softcap_on ? area : 0);  // [Lq, Lk] softcap derivative
  std::vector<T> k_buf, v_buf, q_buf, do_buf, k_clean_buf;
  std::vector<T> dk(static_cast<std::size_t>(lk * d)),
      dvv(static_cast<std::size_t>(lk * dv));  // [Lk, D], [Lk, Dv]
  struct Workspace {
    std::vector<T> q, dout, out, dq;  // [rows, D], [rows, Dv], [rows, Dv], [rows, D]
    Products<T> gemm;
  };
  auto make_workspace = [&] { return Workspace{{}, {}, {}, {}, Products<T>(target)}; };
  for (std::int64_t b = b_begin; b < b_end; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.heads_kv; ++kv_head) {
      std::fill(dk.begin(), dk.end(), T(0));
      std::fill(dvv.begin(), dvv.end(), T(0));
      launch.check_cancel();  // (a head's gathers copy up to all of its K and V)
      // No query row: dK and dV stay 0, and no key is gathered or read.
      const std::int64_t keys = lq > 0 ? lk : 0;
      const Matrix<T> k = head_rows<T>(target, a.k, b, kv_head, 0, keys, d, k_buf, threads);
      const Matrix<T> v = head_rows<T>(target, a.v, b, kv_head, 0, keys, dv, v_buf, threads);
      Matrix<T> k_clean = k;  // [keys, D]: k without the rows in bad_k (for dQ)
      const std::vector<std::int64_t> bad_k =
          hidden_nonfinite_rows(p, k, keys, d, k_clean_buf, k_clean);
      for (std::int64_t h = kv_head * p.group; h < (kv_head + 1) * p.group && lq > 0; ++h) {
        if (lk == 0) {
          std::vector<T> zeros(static_cast<std::size_t>(lq * d), T(0));
          store_rows(target, zeros.data(), a.dq, b, h, 0, lq, d);
          continue;
        }
        // Pass 1, blocks of query rows: S = Q K^T and dP = dO V^T, then P * M and dS per row.
        for_each_task(q_blocks, launch, make_workspace, [&](std::int64_t blk, Workspace& w) {
          const std::int64_t row0 = blk * kBlockRows, rows = std::min(kBlockRows, lq - row0);
          const Matrix<T> q = head_rows<T>(target, a.q, b, h, row0, rows, d, w.q);  // [rows, D]
          const Matrix<T> dout =
              head_rows<T>(target, a.dout, b, h, row0, rows, dv, w.dout);  // [rows, Dv]
          const Matrix<T> out =
              head_rows<T>(target, a.out, b, h, row0, rows, dv, w.out);  // [rows, Dv]
          T* s_rows = weights.data() + row0 * lk;
          T* ds_rows = dscores.data() + row0 * lk;
          w.gemm(false, true, rows, lk, d, T(1), q.data, q.ld, k.data, k.ld, T(0), s_rows, lk);
          w.gemm(false, true, rows, lk, dv, T(1), dout.data, dout.ld, v.data, v.ld, T(0), ds_rows,
                 lk);
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::int64_t i = row0 + r;
            T* s = s_rows + r * lk;
            T* ds = ds_rows + r * lk;
            finish_scores<T>(p, causal_window, b, h, i, s,
                             softcap_on ? dcap.data() + i * lk : nullptr);
            const T lse = load_element<T>(a.lse.data, a.lse.dtype, lse_offset(a.lse, b, h, i));
            T delta = 0;  // Delta_i = <dO_i, O_i>
            for (std::int64_t e = 0; e < dv; ++e)
              delta += dout.data[r * dout.ld + e] * out.data[r * out.ld + e];
            const DropoutRow dropout(p, b, h, i);
            for (std::int64_t j = 0; j < lk; ++j) {
              // P = exp(s - LSE); a row with LSE = -inf has no visible key and P = 0.
              constexpr T kNegInf = -std::numeric_limits<T>::infinity();
              const T prob = lse == kNegInf || s[j] == kNegInf ? T(0) : std::exp(s[j] - lse);
              const T keep = dropout.factor<T>(j);
              s[j] = prob * keep;
              ds[j] = prob == T(0) ? T(0) : prob * (keep * ds[j] - delta);
            }
          }
        });
        // Pass 2, blocks of key columns: dbias += dS (columns are owned by one task unless the
        // mask broadcasts over keys).
        if (dbias.active()) {
          const int column_threads = dbias.column_stride() == 0 ? 1 : threads;
          parallel_for(lk, column_threads, [&](std::int64_t j_begin, std::int64_t j_end) {
            for (std::int64_t i = 0; i < lq; ++i) {
              double* row = dbias.row(b, h, i);
              for (std::int64_t j = j_begin; j < j_end; ++j) {
                row[j * dbias.column_stride()] +=
                    static_cast<double>(dscores[static_cast<std::size_t>(i * lk + j)]);
              }
            }
          });
        }
        // Pass 3, blocks of query rows: dS times the softcap derivative is d/d(scale q.k);
        // dQ = scale * dS K.
        for_each_task(q_blocks, launch, make_workspace, [&](std::int64_t blk, Workspace& w) {
          const std::int64_t row0 = blk * kBlockRows, rows = std::min(kBlockRows, lq - row0);
          T* ds_rows = dscores.data() + row0 * lk;
          if (softcap_on) {
            const T* cap = dcap.data() + row0 * lk;
            for (std::int64_t e = 0; e < rows * lk; ++e) ds_rows[e] *= cap[e];
          }
          w.dq.resize(static_cast<std::size_t>(rows * d));
          w.gemm(false, false, rows, d, lk, scale, ds_rows, lk, k_clean.data, k_clean.ld, T(0),
                 w.dq.data(), d);
          add_hidden_rows(causal_window, bad_k, k, d, row0, rows, ds_rows, lk, scale, w.dq.data());
          store_rows(target, w.dq.data(), a.dq, b, h, row0, rows, d);
        });
        // Pass 4, blocks of key rows: dV += (P M)^T dO and dK += scale * dS^T Q over all rows.
        const Matrix<T> q = head_rows<T>(target, a.q, b, h, 0, lq, d, q_buf, threads);  // [Lq, D]
        const Matrix<T> dout =
            head_rows<T>(target, a.dout, b, h, 0, lq, dv, do_buf, threads);  // [Lq, Dv]
        parallel_for(k_blocks, threads, [&](std::int64_t blk_begin, std::int64_t blk_end) {
          Products<T> gemm(target);
          for (std::int64_t blk = blk_begin; blk < blk_end; ++blk) {
            launch.check_cancel();
            const std::int64_t col0 = blk * kBlockRows, cols = std::min(kBlockRows, lk - col0);
            gemm(true, false, cols, dv, lq, T(1), weights.data() + col0, lk, dout.data, dout.ld,
                 T(1), dvv.data() + col0 * dv, dv);
            gemm(true, false, cols, d, lq, scale, dscores.data() + col0, lk, q.data, q.ld, T(1),
                 dk.data() + col0 * d, d);
          }
        });
      }
      store_rows(target, dk.data(), a.dk, b, kv_head, 0, lk, d);
      store_rows(target, dvv.data(), a.dv, b, kv_head, 0, lk, dv);
    }
  }
  dbias.store(a.dbias);
}

}  // namespace

void math_forward(const Params& p, const Launch& launch, const ForwardArgs& a) {
  const GemmTarget& target = gemm_target_chosen();
  Tensor k_rows, v_rows;  // a paged sequence's K/V, gathered: [1, Hkv, Lk, D], [1, Hkv, Lk, Dv]
  for_each_sequence(
      p, a,
      [&](const Params& paged_p, const ForwardArgs& paged_a, std::int64_t b0, std::int64_t b1) {
        const auto [sp, sa] = gather_kv_pages(paged_p, paged_a, &k_rows, &v_rows);
        if (p.dtype == DType::f64) {
          forward_impl<double>(sp, launch, target, sa, b0, b1);
        } else {
          forward_impl<float>(sp, launch, target, sa, b0, b1);
        }
      });
}

void math_backward(const Params& p, const Launch& launch, const BackwardArgs& a) {
  const GemmTarget& target = gemm_target_chosen();
  for_each_sequence(
      p, a, [&](const Params& sp, const BackwardArgs& sa, std::int64_t b0, std::int64_t b1) {
        if (p.dtype == DType::f64) {
          backward_impl<double>(sp, launch, target, sa, b0, b1);
        } else {
          backward_impl<float>(sp, launch, target, sa, b0, b1);
        }
      });
}

}  // namespace attncore::detail
