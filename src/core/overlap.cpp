// Whether two strided views share memory (core/overlap.h).
#include "core/overlap.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace attncore::detail {

namespace {

__extension__ typedef __int128 Wide;

// One index difference: k in [lo, hi] times `stride` bytes.
struct Term {
  Wide stride, lo, hi;
};

// Floor and ceiling of n / d for d > 0.
Wide floor_div(Wide n, Wide d) { return n >= 0 ? n / d : -((-n + d - 1) / d); }
Wide ceil_div(Wide n, Wide d) { return -floor_div(-n, d); }

// At most one term per dimension of each of two views.
constexpr int kMaxTerms = 2 * kMaxRank;

// Whether sum_t k_t * terms[t].stride, k_t in [lo_t, hi_t], can lie in [low, high], trying
// terms [t, count) (largest stride first). rest_min[t], rest_max[t]: the extremes terms
// [t, count) reach. Counts the nodes it visits in `budget`; returns true when the budget runs
// out.
bool reachable(const Term* terms, int count, const Wide* rest_min, const Wide* rest_max, int t,
               Wide low, Wide high, long& budget) {
  if (--budget < 0) return true;
  if (t == count) return low <= 0 && 0 <= high;
  const Term& term = terms[t];
  // k * stride + (what the smaller terms make) in [low, high].
  const Wide k_lo = std::max(term.lo, ceil_div(low - rest_max[t + 1], term.stride));
  const Wide k_hi = std::min(term.hi, floor_div(high - rest_min[t + 1], term.stride));
  for (Wide k = k_lo; k <= k_hi; ++k) {
    if (reachable(terms, count, rest_min, rest_max, t + 1, low - k * term.stride,
                  high - k * term.stride, budget)) {
      return true;
    }
  }
  return false;
}

std::int64_t element_bytes(const TensorView& t) {
  return static_cast<std::int64_t>(size_of(t.dtype));
}

// A sum of index differences times strides: sum_t k_t * stride_t with k_t in [lo_t, hi_t].
// Terms of equal stride merge. Held in place: the checks of every call build a few (14 of a
// decode call's 36 heap allocations were theirs).
class StrideSum {
 public:
  void add(Wide stride, Wide lo, Wide hi) {
    if (stride == 0 || (lo == 0 && hi == 0)) return;
    for (int t = 0; t < count_; ++t) {
      if (terms_[t].stride == stride) {
        terms_[t].lo += lo;
        terms_[t].hi += hi;
        return;
      }
    }
    terms_[count_++] = {stride, lo, hi};
  }

  // Whether the sum can lie in [low, high]; true also when the search runs past its budget.
  bool reaches(Wide low, Wide high) {
    std::sort(terms_.begin(), terms_.begin() + count_,
              [](const Term& x, const Term& y) { return x.stride > y.stride; });
    std::array<Wide, kMaxTerms + 1> rest_min{}, rest_max{};
    for (int t = count_; t-- > 0;) {
      rest_min[t] = rest_min[t + 1] + terms_[t].lo * terms_[t].stride;
      rest_max[t] = rest_max[t + 1] + terms_[t].hi * terms_[t].stride;
    }
    long budget = 100000;  // nodes; far more than equal or nested strides take
    return reachable(terms_.data(), count_, rest_min.data(), rest_max.data(), 0, low, high, budget);
  }

 private:
  std::array<Term, kMaxTerms> terms_{};
  int count_ = 0;
};

// Whether the dims of size > 1, by stride from the largest, each step past all of the dims
// within it (stride >= the next dim's stride x size, the next one's not 0): no two elements
// coincide then (a contiguous view, or one of permuted or padded dims), with no search.
bool nested_strides(const TensorView& t) {
  std::array<std::pair<std::int64_t, std::int64_t>, kMaxRank> dims{};  // (stride, size)
  int n = 0;
  for (int d = 0; d < t.rank; ++d) {  // inserted in order, largest stride first
    if (t.size(d) < 2) continue;
    int i = n++;
    for (; i > 0 && dims[i - 1].first < t.stride_of(d); --i) dims[i] = dims[i - 1];
    dims[i] = {t.stride_of(d), t.size(d)};
  }
  for (int i = 0; i + 1 < n; ++i) {
    const auto [inner_stride, inner_size] = dims[i + 1];
    if (inner_stride == 0 || dims[i].first / inner_size < inner_stride) return false;
  }
  return n == 0 || dims[n - 1].first > 0;
}

}  // namespace

ByteRange byte_range(const TensorView& t) {
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data);
  if (t.data == nullptr || t.numel() <= 0) return {begin, begin};
  std::int64_t extent = 0;  // the last element's offset, in elements
  for (int d = 0; d < t.rank; ++d) extent += (t.size(d) - 1) * t.stride_of(d);
  return {begin, begin + static_cast<std::uintptr_t>((extent + 1) * element_bytes(t))};
}

bool views_overlap(const TensorView& a, const TensorView& b) {
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  if (ra.begin == ra.end || rb.begin == rb.end) return false;
  if (ra.end <= rb.begin || rb.end <= ra.begin) return false;
  // Byte offsets x of a's elements and y of b's: their bytes meet iff
  // (b - a) - size_a < x - y < (b - a) + size_b. x - y is a sum of index differences times
  // strides: a's indices in [0, n - 1], b's in [-(n - 1), 0]; equal strides merge.
  StrideSum sum;
  for (int d = 0; d < a.rank; ++d) {
    sum.add(Wide{a.stride_of(d)} * element_bytes(a), 0, a.size(d) - 1);
  }
  for (int d = 0; d < b.rank; ++d) {
    sum.add(Wide{b.stride_of(d)} * element_bytes(b), -(b.size(d) - 1), 0);
  }
  const Wide delta = Wide{static_cast<std::int64_t>(rb.begin - ra.begin)};
  return sum.reaches(delta - element_bytes(a) + 1, delta + element_bytes(b) - 1);
}

bool self_overlapping(const TensorView& t) {
  if (t.data == nullptr || t.numel() <= 1) return false;
  if (nested_strides(t)) return false;
  // Two elements share an address iff some index difference d != 0 (|d_i| < size_i) has
  // sum_i d_i * stride_i = 0. Its first non-zero coordinate, p, can be taken positive.
  for (int p = 0; p < t.rank; ++p) {
    if (t.size(p) < 2) continue;
    StrideSum sum;
    if (t.stride_of(p) == 0) return true;
    sum.add(t.stride_of(p), 1, t.size(p) - 1);
    for (int d = p + 1; d < t.rank; ++d) sum.add(t.stride_of(d), -(t.size(d) - 1), t.size(d) - 1);
    if (sum.reaches(0, 0)) return true;
  }
  return false;
}

}  // namespace attncore::detail
