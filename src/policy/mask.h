// What the causal and window masks mean (DESIGN.md section 1.3), in two forms that agree: the
// visible key interval of a query row, and the per-element test built on it. Tensor masks
// (bool / additive) are read element by element by each backend.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/problem.h"

namespace attncore::detail {

// Keys [begin, end) are visible to query row i under causal and window masks.
struct KeyRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  bool empty() const { return begin >= end; }
  bool contains(std::int64_t j) const { return begin <= j && j < end; }
};

class CausalWindowMask {
 public:
  explicit CausalWindowMask(const Problem& p)
      : seqlen_q_(p.seqlen_q), seqlen_k_(p.seqlen_k), causal_(p.causal),
        window_left_(p.window_left), window_right_(p.window_right) {}

  KeyRange row(std::int64_t i) const {
    const std::int64_t diag = i + seqlen_k_ - seqlen_q_;  // the lower-right diagonal of row i
    std::int64_t begin = 0, end = seqlen_k_;
    if (causal_ == Causal::upper_left) end = std::min(end, i + 1);
    if (causal_ == Causal::lower_right) end = std::min(end, diag + 1);
    if (window_left_ >= 0) begin = std::max(begin, diag - window_left_);
    if (window_right_ >= 0) end = std::min(end, diag + window_right_ + 1);
    return {begin, std::max(begin, end)};
  }

  bool allowed(std::int64_t i, std::int64_t j) const { return row(i).contains(j); }

  // Visible (query, key) pairs of one (batch, head): the FLOP count's pair count.
  std::int64_t visible_pairs() const {
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < seqlen_q_; ++i) {
      const KeyRange r = row(i);
      n += r.end - r.begin;
    }
    return n;
  }

 private:
  std::int64_t seqlen_q_, seqlen_k_;
  Causal causal_;
  std::int64_t window_left_, window_right_;
};

}  // namespace attncore::detail
