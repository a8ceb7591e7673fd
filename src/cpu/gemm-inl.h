// The math backend's GEMM (cpu/gemm.h) for one SIMD target: A and B packed into panels, a
// register-tiled micro-kernel of kTileRows x kTileVectors vectors (broadcast one A element,
// multiply-add a row of B), the classic three-level blocking (Goto; BLIS's loop order).
//
// Compiled once per target by src/cpu/gemm_<target>.cpp, which includes the flash kernels'
// target_<target>.h (flash_layout-inl.h describes its macros; here ATTNCORE_TARGET_NS,
// ATTNCORE_TARGET, ATTNCORE_LANES, ATTNCORE_TILE_ROWS and ATTNCORE_TILE_VECTORS are read) and
// flash_simd-inl.h (widen_row, GemmTarget::widen). Every function carries ATTNCORE_TARGET and
// lives in the target's namespace.
//
// Order of operations, fixed by the operands alone: element (i, j) of a chunk of kGemmKc
// products is sum_p a(i, p) b(p, j) accumulated in p order (multiply-adds, fused where the ISA
// has FMA: the files compile with -ffp-contract=fast); chunk results are added to C in order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/gemm.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

template <class T>
struct GemmVec;
template <>
struct GemmVec<float> {
  typedef float type __attribute__((vector_size(ATTNCORE_LANES * 4)));
};
template <>
struct GemmVec<double> {
  typedef double type __attribute__((vector_size(ATTNCORE_LANES * 4)));
};

// Products of at most this many rows of A read B in place (gemm_few_rows): at Lq = 1 (decode)
// packing B took 1.5x the time of the product.
constexpr std::int64_t kGemmFewRows = 2;

// Micro-tile: kMr rows of A times kNr columns of B, kMr * kTileVectors accumulators.
constexpr int kMr = ATTNCORE_TILE_ROWS;
constexpr int kNv = ATTNCORE_TILE_VECTORS;
template <class T>
constexpr int kGemmLanes = ATTNCORE_LANES * 4 / static_cast<int>(sizeof(T));
template <class T>
constexpr int kNr = kNv* kGemmLanes<T>;
static_assert(kGemmMc % kMr == 0 && kMr <= kGemmMaxTileRows, "an A block is whole micro-panels");
static_assert(kGemmNc % kNr<float> == 0 && kGemmNc % kNr<double> == 0 &&
                  kNr<float> <= kGemmMaxTileCols,
              "a B block is whole micro-panels");

// Rows [i0, i0 + mc) x columns [p0, p0 + kc) of A into micro-panels [mc / kMr][kc][kMr],
// rows past mc zero.
template <class T>
ATTNCORE_TARGET void pack_a(const GemmMatrix<T>& a, std::int64_t i0, std::int64_t mc,
                            std::int64_t p0, std::int64_t kc, T* out) {
  for (std::int64_t ir = 0; ir < mc; ir += kMr) {
    const std::int64_t rows = std::min<std::int64_t>(kMr, mc - ir);
    T* panel = out + ir * kc;
    const T* src = a.data + (i0 + ir) * a.row_stride + p0 * a.col_stride;
    for (std::int64_t p = 0; p < kc; ++p) {
      for (std::int64_t r = 0; r < rows; ++r) {
        panel[p * kMr + r] = src[r * a.row_stride + p * a.col_stride];
      }
      for (std::int64_t r = rows; r < kMr; ++r) panel[p * kMr + r] = T(0);
    }
  }
}

// Rows [p0, p0 + kc) x columns [j0, j0 + nc) of B into micro-panels [nc / kNr][kc][kNr],
// columns past nc zero. Walks B along its unit stride: rows of B (x V) or its columns (x K^T).
template <class T>
ATTNCORE_TARGET void pack_b(const GemmMatrix<T>& b, std::int64_t p0, std::int64_t kc,
                            std::int64_t j0, std::int64_t nc, T* out) {
  constexpr int nr = kNr<T>;
  for (std::int64_t jr = 0; jr < nc; jr += nr) {
    const std::int64_t cols = std::min<std::int64_t>(nr, nc - jr);
    T* panel = out + jr * kc;
    const T* src = b.data + p0 * b.row_stride + (j0 + jr) * b.col_stride;
    if (b.col_stride == 1) {
      for (std::int64_t p = 0; p < kc; ++p) {
        std::memcpy(panel + p * nr, src + p * b.row_stride, sizeof(T) * cols);
        std::fill(panel + p * nr + cols, panel + (p + 1) * nr, T(0));
      }
    } else {
      for (std::int64_t c = 0; c < nr; ++c) {
        for (std::int64_t p = 0; p < kc; ++p) {
          panel[p * nr + c] = c < cols ? src[c * b.col_stride + p * b.row_stride] : T(0);
        }
      }
    }
  }
}

// C[rows, cols] of one micro-tile (rows <= kMr, cols <= kNr) from kc products of a packed A
// micro-panel and B micro-panel: C = alpha * AB + beta * C when `first` (beta = 0: C not
// read), else C += alpha * AB.
template <class T>
ATTNCORE_TARGET inline typename GemmVec<T>::type load_vec(const T* p) {
  typename GemmVec<T>::type v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
ATTNCORE_TARGET inline void store_vec(T* p, typename GemmVec<T>::type v) {
  std::memcpy(p, &v, sizeof v);
}

// C[rows, cols] of one micro-tile (rows <= kMr, cols <= kNr) from kc products of a packed A
// micro-panel and B micro-panel: C = alpha * AB + beta * C when `first` (beta = 0: C not
// read), else C += alpha * AB. The accumulators are never addressed, so they stay in registers.
template <class T>
ATTNCORE_TARGET void micro_tile(std::int64_t kc, const T* ap, const T* bp, T* c, std::int64_t ldc,
                                int rows, int cols, T alpha, T beta, bool first) {
  using V = typename GemmVec<T>::type;
  constexpr int lanes = kGemmLanes<T>, nr = kNr<T>;
  V acc[kMr][kNv] = {};
  for (std::int64_t p = 0; p < kc; ++p) {
    V b[kNv];
    for (int v = 0; v < kNv; ++v) b[v] = load_vec(bp + p * nr + v * lanes);
    for (int r = 0; r < kMr; ++r) {
      const V a = ap[p * kMr + r] - V{};  // broadcast (x - +0 is x)
      for (int v = 0; v < kNv; ++v) acc[r][v] += a * b[v];
    }
  }
  const bool read_c = !first || beta != T(0);
  const T c_scale = first ? beta : T(1);
  const bool whole = rows == kMr && cols == nr;
  T tile[kNv * kGemmLanes<T>];  // one row of a partial tile
  for (int r = 0; r < rows; ++r) {
    T* at = c + r * ldc;
    for (int v = 0; v < kNv; ++v) {
      V x = acc[r][v] * alpha;
      if (whole) {
        if (read_c) x = load_vec(at + v * lanes) * c_scale + x;
        store_vec(at + v * lanes, x);
      } else {
        store_vec(tile + v * lanes, x);
      }
    }
    if (!whole) {
      for (int j = 0; j < cols; ++j) at[j] = read_c ? at[j] * c_scale + tile[j] : tile[j];
    }
  }
}

// C = alpha * AB + beta * C (beta = 0: C not read) for one element from its accumulated sum.
template <class T>
ATTNCORE_TARGET inline void put(T* at, T sum, T alpha, T beta) {
  *at = beta == T(0) ? sum * alpha : *at * beta + sum * alpha;
}

// Products with few rows of A (decode: one query row), where packing B would cost as much as
// the product: B read in place along its unit stride. Returns false, doing nothing, when
// neither operand is laid out for it. Sums: B's columns contiguous (x K^T), one dot product
// per element, kLanes-wide partial sums over p then added across lanes; B's rows contiguous
// (x V), each element accumulated in p order.
template <class T>
ATTNCORE_TARGET bool gemm_few_rows(std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                                   const GemmMatrix<T>& a, const GemmMatrix<T>& b, T beta, T* c,
                                   std::int64_t ldc) {
  using V = typename GemmVec<T>::type;
  constexpr int lanes = kGemmLanes<T>;
  if (a.col_stride == 1 && b.row_stride == 1) {
    for (std::int64_t i = 0; i < m; ++i) {
      const T* x = a.data + i * a.row_stride;
      for (std::int64_t j = 0; j < n; ++j) {
        const T* y = b.data + j * b.col_stride;
        V acc[4] = {};
        std::int64_t p = 0;
        for (; p + 4 * lanes <= k; p += 4 * lanes) {
          for (int u = 0; u < 4; ++u)
            acc[u] += load_vec(x + p + u * lanes) * load_vec(y + p + u * lanes);
        }
        for (; p + lanes <= k; p += lanes) acc[0] += load_vec(x + p) * load_vec(y + p);
        const V total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        T sum = T(0);
        for (int l = 0; l < lanes; ++l) sum += total[l];
        for (; p < k; ++p) sum += x[p] * y[p];
        put(c + i * ldc + j, sum, alpha, beta);
      }
    }
    return true;
  }
  if (b.col_stride == 1) {
    constexpr int width = 4 * lanes;  // columns per pass over B's rows
    for (std::int64_t i = 0; i < m; ++i) {
      const T* x = a.data + i * a.row_stride;
      std::int64_t j = 0;
      for (; j + width <= n; j += width) {
        V acc[4] = {};
        for (std::int64_t p = 0; p < k; ++p) {
          const V xp = x[p * a.col_stride] - V{};
          const T* y = b.data + p * b.row_stride + j;
          for (int u = 0; u < 4; ++u) acc[u] += xp * load_vec(y + u * lanes);
        }
        for (int u = 0; u < 4; ++u) {
          for (int l = 0; l < lanes; ++l)
            put(c + i * ldc + j + u * lanes + l, acc[u][l], alpha, beta);
        }
      }
      for (; j < n; ++j) {
        T sum = T(0);
        for (std::int64_t p = 0; p < k; ++p)
          sum += x[p * a.col_stride] * b.data[p * b.row_stride + j];
        put(c + i * ldc + j, sum, alpha, beta);
      }
    }
    return true;
  }
  return false;
}

template <class T>
ATTNCORE_TARGET void gemm(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, GemmMatrix<T> a,
                          GemmMatrix<T> b, T beta, T* c, std::int64_t ldc, T* pack) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // C = beta * C
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        T& x = c[i * ldc + j];
        x = beta == T(0) ? T(0) : beta * x;
      }
    }
    return;
  }
  if (m <= kGemmFewRows && gemm_few_rows(m, n, k, alpha, a, b, beta, c, ldc)) return;
  constexpr int nr = kNr<T>;
  // Within gemm_pack_elements(m, n, k): B's block [nc / nr][kc][nr], then A's [mc / kMr][kc][kMr].
  const std::int64_t b_cols = std::min(kGemmNc, (n + nr - 1) / nr * nr);
  T* bp = pack;
  T* ap = pack + std::min(kGemmKc, k) * b_cols;
  for (std::int64_t jc = 0; jc < n; jc += kGemmNc) {
    const std::int64_t nc = std::min(kGemmNc, n - jc);
    for (std::int64_t pc = 0; pc < k; pc += kGemmKc) {
      const std::int64_t kc = std::min(kGemmKc, k - pc);
      pack_b(b, pc, kc, jc, nc, bp);
      for (std::int64_t ic = 0; ic < m; ic += kGemmMc) {
        const std::int64_t mc = std::min(kGemmMc, m - ic);
        pack_a(a, ic, mc, pc, kc, ap);
        // A B micro-panel (kc x nr) stays in L1 while the A micro-panels pass under it.
        for (std::int64_t jr = 0; jr < nc; jr += nr) {
          const int cols = static_cast<int>(std::min<std::int64_t>(nr, nc - jr));
          for (std::int64_t ir = 0; ir < mc; ir += kMr) {
            const int rows = static_cast<int>(std::min<std::int64_t>(kMr, mc - ir));
            micro_tile(kc, ap + ir * kc, bp + jr * kc, c + (ic + ir) * ldc + jc + jr, ldc, rows,
                       cols, alpha, beta, pc == 0);
          }
        }
      }
    }
  }
}

ATTNCORE_TARGET inline void sgemm(std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                                  GemmMatrix<float> a, GemmMatrix<float> b, float beta, float* c,
                                  std::int64_t ldc, float* pack) {
  gemm<float>(m, n, k, alpha, a, b, beta, c, ldc, pack);
}
ATTNCORE_TARGET inline void dgemm(std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                                  GemmMatrix<double> a, GemmMatrix<double> b, double beta,
                                  double* c, std::int64_t ldc, double* pack) {
  gemm<double>(m, n, k, alpha, a, b, beta, c, ldc, pack);
}

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
