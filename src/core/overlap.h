// Whether two strided views share memory: the test behind the rule that an output may share no
// byte with another output or with an input (core/validate_checks.h, Checker::separate).
#pragma once

#include "attncore/tensor.h"

namespace attncore::detail {

// Whether some byte belongs to an element of both views (views already validated: sizes and
// strides non-negative, extents within int64). Empty views and views without data share
// nothing. The answer is exact: element addresses are a + sum_d i_d * stride_a[d] * size_a and
// b + sum_d j_d * stride_b[d] * size_b, and the search looks for i, j whose elements' bytes meet,
// dimension by dimension from the largest stride down, keeping only the index differences the
// smaller dimensions can still make up. Equal strides (the packed [total, 3, H, D] gradients)
// merge into one term, so the search takes a few steps; should it ever need more than a fixed
// budget (strides that interleave with no common structure), the views are reported as
// overlapping: a conservative answer.
bool views_overlap(const TensorView& a, const TensorView& b);

// Whether two elements of one view share an address (a zero stride, or rows that overlap like
// [L, D] with strides [1, 1]). Exact by the same search (conservative past its budget).
bool self_overlapping(const TensorView& t);

// The bytes [begin, end) a view's elements lie within: its first element's address to its last
// element's end (begin == end for an empty view).
struct ByteRange {
  std::uintptr_t begin, end;
};
ByteRange byte_range(const TensorView& t);

}  // namespace attncore::detail
