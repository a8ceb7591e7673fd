// Whether two strided views share memory (core/overlap.h).
#include "core/overlap.h"

#include <algorithm>
#include <cstdint>
#include <vector>

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

// Whether sum_t k_t * terms[t].stride, k_t in [lo_t, hi_t], can lie in [low, high], trying
// terms [t, end) (largest stride first). rest_min[t], rest_max[t]: the extremes terms [t, end)
// reach. Counts the nodes it visits in `budget`; returns true when the budget runs out.
bool reachable(const std::vector<Term>& terms, const std::vector<Wide>& rest_min,
               const std::vector<Wide>& rest_max, std::size_t t, Wide low, Wide high,
               long& budget) {
  if (--budget < 0) return true;
  if (t == terms.size()) return low <= 0 && 0 <= high;
  const Term& term = terms[t];
  // k * stride + (what the smaller terms make) in [low, high].
  const Wide k_lo = std::max(term.lo, ceil_div(low - rest_max[t + 1], term.stride));
  const Wide k_hi = std::min(term.hi, floor_div(high - rest_min[t + 1], term.stride));
  for (Wide k = k_lo; k <= k_hi; ++k) {
    if (reachable(terms, rest_min, rest_max, t + 1, low - k * term.stride, high - k * term.stride,
                  budget)) {
      return true;
    }
  }
  return false;
}

std::int64_t element_bytes(const TensorView& t) {
  return static_cast<std::int64_t>(size_of(t.dtype));
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
  std::vector<Term> terms;
  auto add = [&terms](Wide stride, Wide lo, Wide hi) {
    if (stride == 0 || (lo == 0 && hi == 0)) return;
    for (Term& t : terms) {
      if (t.stride == stride) {
        t.lo += lo;
        t.hi += hi;
        return;
      }
    }
    terms.push_back({stride, lo, hi});
  };
  for (int d = 0; d < a.rank; ++d) {
    add(Wide{a.stride_of(d)} * element_bytes(a), 0, a.size(d) - 1);
  }
  for (int d = 0; d < b.rank; ++d) {
    add(Wide{b.stride_of(d)} * element_bytes(b), -(b.size(d) - 1), 0);
  }
  std::sort(terms.begin(), terms.end(),
            [](const Term& x, const Term& y) { return x.stride > y.stride; });
  std::vector<Wide> rest_min(terms.size() + 1, 0), rest_max(terms.size() + 1, 0);
  for (std::size_t t = terms.size(); t-- > 0;) {
    rest_min[t] = rest_min[t + 1] + terms[t].lo * terms[t].stride;
    rest_max[t] = rest_max[t + 1] + terms[t].hi * terms[t].stride;
  }
  const Wide delta = Wide{static_cast<std::int64_t>(rb.begin - ra.begin)};
  long budget = 100000;  // nodes; far more than equal or nested strides take
  return reachable(terms, rest_min, rest_max, 0, delta - element_bytes(a) + 1,
                   delta + element_bytes(b) - 1, budget);
}

}  // namespace attncore::detail
