// The causal / window mask policy (src/policy/mask.h): its per-element, per-row and per-tile
// forms against an independent element predicate written from docs/design.md section 1.3, for
// every causal alignment and every window (-1 .. 64 on each side) at lengths up to 64.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "policy/mask.h"

namespace attncore::detail {
namespace {

// docs/design.md section 1.3, literally.
bool visible(Causal causal, std::int64_t wl, std::int64_t wr, std::int64_t lq, std::int64_t lk,
             std::int64_t i, std::int64_t j) {
  if (causal == Causal::upper_left && j > i) return false;
  if (causal == Causal::lower_right && j > i + lk - lq) return false;
  if (wl >= 0 && j < i + lk - lq - wl) return false;
  if (wr >= 0 && j > i + lk - lq + wr) return false;
  return true;
}

// Checks one configuration; returns the number of failures (and records the first ones).
int check(Causal causal, std::int64_t wl, std::int64_t wr, std::int64_t lq, std::int64_t lk) {
  detail::Params p;
  p.seq.lq = lq;
  p.seq.lk = lk;
  p.causal = causal;
  p.window_left = wl;
  p.window_right = wr;
  const CausalWindowMask mask(p);
  const std::string where = std::string(name_of(causal)) + " window " + std::to_string(wl) +
                            "," + std::to_string(wr) + " Lq=" + std::to_string(lq) +
                            " Lk=" + std::to_string(lk);
  // want[i][j]: the element form, independently.
  std::vector<std::vector<bool>> want(static_cast<std::size_t>(lq),
                                      std::vector<bool>(static_cast<std::size_t>(lk)));
  int failures = 0;
  for (std::int64_t i = 0; i < lq; ++i) {
    const KeyRange row = mask.row(i);
    if (row.begin < 0 || row.end > lk || row.begin > row.end) {
      ADD_FAILURE() << where << ": row " << i << " range [" << row.begin << ", " << row.end << ")";
      return 1;
    }
    for (std::int64_t j = 0; j < lk; ++j) {
      const bool v = visible(causal, wl, wr, lq, lk, i, j);
      want[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] = v;
      if (mask.allowed(i, j) != v || row.contains(j) != v) {
        if (++failures <= 3) ADD_FAILURE() << where << ": element (" << i << ", " << j << ")";
      }
    }
  }
  // Tiles: row blocks of 1, 3 and 8 rows against key tiles of 1, 5 and 16 keys.
  for (std::int64_t rows : {1, 3, 8}) {
    for (std::int64_t keys : {1, 5, 16}) {
      for (std::int64_t i0 = 0; i0 < lq; i0 += rows) {
        RowSetKeys seen;
        const std::int64_t i1 = std::min(lq, i0 + rows);
        for (std::int64_t i = i0; i < i1; ++i) seen.add(mask.row(i));
        for (std::int64_t j0 = 0; j0 < lk; j0 += keys) {
          const std::int64_t j1 = std::min(lk, j0 + keys);
          std::int64_t count = 0;
          for (std::int64_t i = i0; i < i1; ++i) {
            for (std::int64_t j = j0; j < j1; ++j) {
              count += want[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)];
            }
          }
          const TileKind expected = count == 0                          ? TileKind::empty
                                    : count == (i1 - i0) * (j1 - j0) ? TileKind::full
                                                                     : TileKind::partial;
          if (seen.classify(j0, j1) != expected) {
            if (++failures <= 3) {
              ADD_FAILURE() << where << ": tile rows [" << i0 << ", " << i1 << ") keys [" << j0
                            << ", " << j1 << ")";
            }
          }
        }
      }
    }
  }
  return failures;
}

TEST(MaskPolicy, ElementRowAndTileFormsAgree) {
  const std::int64_t lengths[] = {1, 7, 33, 64};
  int failures = 0;
  for (Causal causal : {Causal::none, Causal::upper_left, Causal::lower_right}) {
    for (std::int64_t lq : lengths) {
      for (std::int64_t lk : lengths) {
        for (std::int64_t wl = -1; wl <= 64; ++wl) {
          for (std::int64_t wr = -1; wr <= 64; ++wr) {
            failures += check(causal, wl, wr, lq, lk);
            if (failures > 10) return;
          }
        }
      }
    }
  }
}

// Every length pair up to 64 (no window, and a few windows), all alignments.
TEST(MaskPolicy, EveryLengthUpTo64) {
  int failures = 0;
  for (Causal causal : {Causal::none, Causal::upper_left, Causal::lower_right}) {
    for (std::int64_t lq = 0; lq <= 64; ++lq) {
      for (std::int64_t lk = 0; lk <= 64; ++lk) {
        for (const auto& [wl, wr] : {std::pair{-1, -1}, {0, 0}, {3, -1}, {-1, 2}, {5, 9}}) {
          failures += check(causal, wl, wr, lq, lk);
          if (failures > 10) return;
        }
      }
    }
  }
}

}  // namespace
}  // namespace attncore::detail
