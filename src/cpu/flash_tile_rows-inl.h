// TileRows, for one SIMD target: where the K or V rows of one key tile lie, resolved once per
// tile from a plain view or a paged cache's pages (docs/design.md section 1, KV cache), so that
// the products and the packing read rows through offsets and never see a page; and the
// prefetch of a row's cache lines (prefetch_lines), of a block's rows ahead (prefetch_block), and
// of one line at a place among the products (prefetch_after).
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/params.h"
#include "cpu/flash_layout-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// Keys past a tile whose rows are resolved with it: what its prefetches reach ahead (at most).
constexpr std::int64_t kRowLead = 64;

// The cache lines that start within the n elements from p, and with `first` also the one that
// holds p: a row prefetched slice by slice (first for its first slice) has each line prefetched
// once, where whole-range prefetches would prefetch a line two slices share twice. Always
// inlined, as prefetch_lines: GCC 12's interprocedural analysis takes a call of them, which
// reads and writes no memory, for one with no effect, and deleted such calls where they were not
// inlined first (a GQA group's V prefetches in score_tile_streams<2> and <4> vanished from the
// avx512 build after code around them moved, f32 GQA [B, Hkv, L, D] decode reading 0.88 of
// what it read before, bench --decode on the Intel Xeon).
template <int kLocality, class T>
ATTNCORE_TARGET __attribute__((always_inline)) inline void prefetch_slice_lines(const T* p,
                                                                                std::int64_t n,
                                                                                bool first) {
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  const auto end = reinterpret_cast<std::uintptr_t>(p + n);
  constexpr std::uintptr_t kLine = 63;
  for (std::uintptr_t line = first ? begin & ~kLine : (begin + kLine) & ~kLine; line < end;
       line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, kLocality);
  }
}

// A prefetch of the line holding p into L1 (kLocality 3) or L2 (2), issued after the
// instruction that last wrote `after` and before the next that reads it (the register ties it
// there: GCC gathers plain prefetches beside the loads). On the Intel Xeon prefetches issued
// together lose much of their effect: a scratch loop reading 256 MiB, 64 multiply-adds per 256
// bytes, each line prefetched 4 KiB ahead, read 10.3-10.9 GB/s with each 256 bytes' 4
// prefetches together and 17.8-18.6 with each after its quarter of the products (8 no-ops
// between them: 16.5-16.9, 1: 11.0-11.3; probe 16.9, no prefetch 8.7). In decode the gain is
// smaller, and only where measured (RowsProduct).
template <int kLocality, class T, class V>
ATTNCORE_TARGET __attribute__((always_inline)) inline void prefetch_after(const T* p, V& after) {
  static_assert(kLocality == 2 || kLocality == 3, "into L1 or L2");
#if defined(__x86_64__)
  const char& line = *reinterpret_cast<const char*>(p);
  if constexpr (kLocality == 3) {
    asm volatile("prefetcht0 %1" : "+v"(after) : "m"(line));
  } else {
    asm volatile("prefetcht1 %1" : "+v"(after) : "m"(line));
  }
#else
  (void)after;
  __builtin_prefetch(p, 0, kLocality);
#endif
}

// A prefetch of the line holding p into L1, or into L2 where into_l1 is false (a level the
// decode plan chooses at run time).
template <class T>
ATTNCORE_TARGET __attribute__((always_inline)) inline void prefetch_line(const T* p, bool into_l1) {
  if (into_l1) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 2);
  }
}

// The cache lines of n elements from p, each once (by address), into L1 (kLocality 3) or L2 (2).
template <int kLocality, class T>
ATTNCORE_TARGET __attribute__((always_inline)) inline void prefetch_lines(const T* p,
                                                                          std::int64_t n) {
  prefetch_slice_lines<kLocality>(p, n, true);
}

// The prefetches of keys c0 + j (from <= j < to) of a block's head (rows at kx + k_at[..]):
// the row `lead` keys on, and the plan's `also` keys on (0: none), each just before the
// first (interleaved) or all of them before the others; into L1 or L2 (near_l1); never a
// key at or past `ahead`. (Written out: through a lambda, GCC 12 ran every decode 2x slower.)
// (f32 rows far apart prefetched twice, into L2: within noise.)
template <class T>
ATTNCORE_TARGET __attribute__((always_inline)) inline void prefetch_block(
    const T* kx, const std::int64_t* k_at, std::int64_t c0, std::int64_t from, std::int64_t to,
    std::int64_t lead, std::int64_t also, bool interleaved, bool near_l1, std::int64_t ahead,
    std::int64_t d) {
  for (std::int64_t j = from; also > 0 && !interleaved && j < to; ++j) {
    if (c0 + also + j < ahead) {
      if (near_l1) {
        prefetch_lines<3>(kx + k_at[c0 + also + j], d);
      } else {
        prefetch_lines<2>(kx + k_at[c0 + also + j], d);
      }
    }
  }
  for (std::int64_t j = from; j < to; ++j) {
    if (also > 0 && interleaved && c0 + also + j < ahead) {
      if (near_l1) {
        prefetch_lines<3>(kx + k_at[c0 + also + j], d);
      } else {
        prefetch_lines<2>(kx + k_at[c0 + also + j], d);
      }
    }
    if (c0 + lead + j < ahead) {
      if (near_l1) {
        prefetch_lines<3>(kx + k_at[c0 + lead + j], d);
      } else {
        prefetch_lines<2>(kx + k_at[c0 + lead + j], d);
      }
    }
  }
}

// at[c]: the element offset into the view's data of key j0 + c of (b, kv head h), for
// c < count = min(kKeyTile + kRowLead, Lk - j0) (never a key past the sequence).
struct TileRows {
  std::int64_t at[kKeyTile + kRowLead];
  std::int64_t count;
};

ATTNCORE_TARGET inline void resolve_rows(const Params& p, const TensorView& t, std::int64_t b,
                                         std::int64_t h, std::int64_t j0, TileRows& rows) {
  rows.count = std::clamp<std::int64_t>(p.seq.lk - j0, 0, kKeyTile + kRowLead);
  if (!p.kv_pages.paged()) {
    const std::int64_t base = b * t.stride[0] + h * t.stride[1] + j0 * t.stride[2];
    for (std::int64_t c = 0; c < rows.count; ++c) rows.at[c] = base + c * t.stride[2];
    return;
  }
  // Page by page: slot s of the sequence is row s % page_size of page pages[s / page_size].
  const std::int64_t page_size = p.kv_pages.page_size;
  for (std::int64_t c = 0; c < rows.count;) {
    const std::int64_t slot = p.kv_pages.first + j0 + c;
    const std::int64_t in_page = slot % page_size;
    const std::int64_t base =
        p.kv_pages.pages[slot / page_size] * t.stride[0] + h * t.stride[1] + in_page * t.stride[2];
    const std::int64_t n = std::min(rows.count - c, page_size - in_page);
    for (std::int64_t i = 0; i < n; ++i) rows.at[c + i] = base + i * t.stride[2];
    c += n;
  }
}

// The stride of rows at[0 .. n) when they are evenly spaced (n >= 2), else 0.
ATTNCORE_TARGET inline std::int64_t even_stride(const std::int64_t* at, std::int64_t n) {
  if (n < 2) return 0;
  const std::int64_t ld = at[1] - at[0];
  for (std::int64_t j = 2; j < n; ++j) {
    if (at[j] - at[j - 1] != ld) return 0;
  }
  return ld;
}

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
