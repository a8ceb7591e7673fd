// What the causal and window masks mean (docs/design.md section 1.3), in three forms that agree
// (tests/mask_policy_test.cpp): per element (allowed), per query row (the visible key
// interval), per tile of rows x keys (empty, partial or full). Tensor masks (bool / additive)
// are read element by element by each backend.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/params.h"

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
  explicit CausalWindowMask(const Params& p)
      : seqlen_q_(p.seq.lq),
        seqlen_k_(p.seq.lk),
        causal_(p.causal),
        window_left_(p.window_left),
        window_right_(p.window_right) {}

  // (Every sum below stays in range for any sizes validation takes: a window edge is applied
  // only where it lies inside [0, Lk], which a window as wide as a sequence's lengths never does.)
  KeyRange row(std::int64_t i) const {
    // The lower-right diagonal of row i, i + Lk - Lq, in [Lk - Lq, Lk - 1].
    const std::int64_t diag = seqlen_k_ - (seqlen_q_ - i);
    std::int64_t begin = 0, end = seqlen_k_;
    if (causal_ == Causal::upper_left) end = std::min(end, i + 1);
    if (causal_ == Causal::lower_right) end = std::min(end, diag + 1);
    if (window_left_ >= 0 && window_left_ < diag) begin = diag - window_left_;
    if (window_right_ >= 0 && window_right_ < seqlen_q_ - 1 - i) {
      end = std::min(end, diag + window_right_ + 1);  // < Lk
    }
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

// What a set of query rows sees, for classifying key tiles: built from the rows' intervals.
enum class TileKind : std::uint8_t { empty, partial, full };

class RowSetKeys {
 public:
  void add(const KeyRange& r) {
    if (r.empty()) {
      any_empty_ = true;
      return;
    }
    min_begin_ = std::min(min_begin_, r.begin);
    max_begin_ = std::max(max_begin_, r.begin);
    min_end_ = std::min(min_end_, r.end);
    max_end_ = std::max(max_end_, r.end);
  }
  // Keys some row sees lie in [begin, end) (empty when no row sees any).
  KeyRange span() const {
    return max_end_ > min_begin_ ? KeyRange{min_begin_, max_end_} : KeyRange{};
  }
  // Keys [j_begin, j_end): seen by no row, by every row entirely, or otherwise.
  TileKind classify(std::int64_t j_begin, std::int64_t j_end) const {
    const KeyRange s = span();
    if (s.empty() || j_end <= s.begin || j_begin >= s.end) return TileKind::empty;
    if (!any_empty_ && max_begin_ <= j_begin && j_end <= min_end_) return TileKind::full;
    return TileKind::partial;
  }

 private:
  static constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::int64_t min_begin_ = kNone, max_begin_ = 0, min_end_ = kNone, max_end_ = 0;
  bool any_empty_ = false;
};

}  // namespace attncore::detail
