// DirectKvProducts, for one SIMD target: P . V of decode-shaped work items (DirectKv,
// flash_direct_kv-inl.h), V read where it lies and widened in registers, and the prefetching of
// V that goes with it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/params.h"
#include "cpu/decode_plan.h"
#include "cpu/flash_direct_kv_scores-inl.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// V rows of a one-head item prefetched this many keys ahead of P . V, into L1 (8 KiB of 16-bit
// rows at D = 128): bench --decode, [B, Hkv, L, D], 1 thread, % of the probe, Lk=4096/16384:
// MHA bf16 71/76 without, 83/85 at 32 keys, 89/82 at 48, 84/81 at 64; f16 70/74 without, 86/81
// at 32; GQA (Hkv=8) f32 62/54 without, 77/57 at 32, 76/56 at 64; bf16 66/60 -> 74/71; f16
// 57/54 -> 65/62 (measured into L1 on Zen 5; into L2 on Zen 4: decode_plan.h, v_into_l1).
// One f32 row (MHA) has its own lead, the core's (decode_plan.h).
constexpr std::int64_t kVLead = 32;
// V bytes of each head prefetched ahead of P . V in a multi-head item (into L2; AVX2: none,
// DirectKv::head_chunk): bench
// --decode, BLHD Hkv=32 Lk=4096/16384, 1 thread, GB/s: bf16 8 KiB (32 keys) 25.6-26.5, 4 KiB
// 22.4-26.8, none 19.6-21.2; f32 8 KiB (16 keys) 24.2-26.4, 16 KiB 21.4-25.0, none 24.4-26.2.
constexpr std::int64_t kHeadVAhead = 8192;
// Each of those rows prefetched by at most this many chunks of keys (the ones furthest from it),
// not by every chunk whose window it is in; but a tile's first chunk also takes the rows the tile
// before could not reach (none resolves more than kRowLead rows past its end: 16-bit rows of D =
// 32, 128 in a window, separate processes in turn, 7 rounds, 1.03; D = 128 0.995-1.015). Zen 4,
// MHA, 1 thread, in one process, the calls in turn, 5 rounds, median speed ratio against every
// chunk: D = 64 (a window of 32 f32 rows or 64 16-bit rows, prefetched up to 8 and 4 times), Hkv =
// 8, Lk = 65536, [B, L, Hkv, D]: f32 1.28, bf16 1.13, f16 1.14, p16 f32 1.29, and Hkv = 32, Lk =
// 16384, f32 1.39 (each row once: f32 1.31, bf16 1.15; 4 times: 1.20, 1.00); D = 128 (16 f32 rows,
// 4 times before; 32 16-bit rows, twice, as still), Hkv = 32, Lk = 16384: f32 [B, L, Hkv, D] 1.03,
// p16 1.04, bf16 and f16 0.99-1.01 (once: f32 0.93, bf16 p16 0.94). A GQA group's 16-bit rows over
// several heads at D = 128 prefetch as before (chunks of 16 keys, 32 rows a window); their f32
// rows, now in chunks of 8 keys (head_chunk), ask for each of their 16 rows twice; other head sizes
// there, Zen 5 and Intel's cores: not measured.
constexpr std::int64_t kHeadVTimes = 2;

// How far ahead of P . V the V rows of a one-head item are prefetched, in keys: into L1 and
// into L2 (`ahead`, the rows known, for none; on AVX2 a group's rows use `l1` only, also over
// several heads: DirectKv::accumulate); whether the item is one head's (its V one sequential
// stream); whether the prefetches `l1` names (and, on AVX-512, GQA's column slices') go
// into L1, or into L2 instead where the core's decode plan says so (v_into_l1); and whether a
// GQA group's column slices prefetch their lines 16 keys on (AVX-512: DirectKv::accumulate).
struct VLead {
  std::int64_t l1, l2;
  bool one_head;
  bool into_l1;
  bool slices;
};

// P . V of DirectKv items: one row, a group's rows, or one row per head over several heads,
// against a tile's V rows, chunk by chunk.
struct DirectKvProducts : DirectKvScores {
  // Keys per chunk of P . V across the kv heads of a multi-head item (flash_tile_loop-inl.h),
  // each chunk prefetching the next kHeadVAhead bytes of its head's V rows (so each row is
  // prefetched kHeadVAhead / row bytes / chunk times, up to kHeadVTimes: more ran faster than
  // once at D = 128, where f32 rows were prefetched 4 times): bench
  // --decode, 1 thread, % of the probe, Lk=4096/16384, interleaved, MHA f32 [B, L, Hkv, D]
  // 69/71 with 16 keys, 67/78 with 4, 67/66 with 2; p16 66/65 -> 78/74, p256 71/70 -> 77/77;
  // bf16 BLHD 73/69 -> 52/51 and f16 66/61 -> 50/48 with 4 (also with each row prefetched
  // once: 70/71, 64/67); GQA f32 BLHD 59/53 -> 53/50. AVX2 prefetches no next chunk (the
  // hardware prefetcher streams the chunks' rows, read in address order; but a group's 16-bit
  // rows prefetch their head's next chunk in accumulate: tile_accumulate) and
  // takes one row's 16-bit V 8 keys at a time: Zen 3, 1 thread, % of the probe, Lk=16384, 3
  // runs of 3 interleaved passes: f32 (4 keys) BLHD 64/74/62 -> 88/96/98, p16 57/73/67 ->
  // 95/87/83; bf16 BLHD 55/55/48 with 16 keys and the prefetch -> 59/72/73 with 4 keys, none,
  // and against that 82/94/62 with 8, 75/72/59 with 16; f16 BLHD 75/79/64 (4) -> 84/88/66 (8),
  // bf16 p16 74/74/56 -> 79/87/59, f16 p16 75/66/76 -> 83/83/63. GQA BLHD (Hkv=8) within the
  // noise either way with that prefetch (f32 59/55/47 without it, 44/48/58 with); a 16-bit
  // group's rows now prefetch their head's next chunk in accumulate instead (tile_accumulate).
  // AVX-512 too takes one row's 16-bit V 8 keys at a time since each row's next-chunk prefetch
  // is capped (kHeadVTimes): Zen 4, Hkv = 32, in one process, the calls in turn, median speed
  // ratio against 16 keys, Lk = 16384, 9 rounds: bf16 [B, L, Hkv, D] 1.03, p16 1.07, f16 p256
  // 1.03; Lk = 4096 bf16 [B, L, Hkv, D] and f16 p16 1.00; 5 rounds: f16 [B, L, Hkv, D] 1.02,
  // p16 1.04-1.13 (4 keys 0.97-1.02, 32 keys 0.82-0.83; 8 keys with the prefetch of every
  // chunk's whole window, 4 times a row, 0.93-1.01). A GQA group's f32 rows likewise take 8
  // keys on AVX-512 (16-bit rows 16): Zen 4, Hq = 32, Hkv = 8, the same A/B, 9 rounds, Lk =
  // 16384: [B, L, Hkv, D] 1.06-1.08, p16 1.06-1.07, p256 1.07; Lk = 4096: 1.06, p16 1.07 (4
  // keys 1.02-1.03, 32 keys 0.92; 16-bit rows in 8 keys 0.97, in 32 0.95-0.96).
  ATTNCORE_TARGET static std::int64_t head_chunk(DType dtype, std::int64_t rows) {
    if (rows > 1) return kLanes == 16 && dtype == DType::f32 ? 8 : 16;
    return dtype == DType::f32 ? 4 : 8;
  }

  // V rows c < count of one head (at v + v_at[c]) into L2: the next chunk of P . V with
  // several heads.
  template <class T>
  ATTNCORE_TARGET __attribute__((always_inline)) static void prefetch_rows(const Params& p,
                                                                           const T* v,
                                                                           const std::int64_t* v_at,
                                                                           std::int64_t count,
                                                                           bool into_l1) {
    if (into_l1) {
      for (std::int64_t c = 0; c < count; ++c) prefetch_lines<3>(v + v_at[c], p.head_dim_v);
    } else {
      for (std::int64_t c = 0; c < count; ++c) prefetch_lines<2>(v + v_at[c], p.head_dim_v);
    }
  }

  // O [R][dv_pad] = alpha O + P . V[j0 .. j0 + keys) for the first R rows: V rows read once per
  // kVectors-vector slice of the columns, which fills the registers with R rows' accumulators
  // and the slice of a V row (the whole row for R <= 2 and Dv <= 128 on AVX-512). Each output
  // element is out * alpha plus its keys' products in key order, whatever the slice: the same
  // bits for any R.
  // Vectors per column slice of accumulate<R>: R accumulators and the V slice per vector in
  // the registers.
  static constexpr int kRegisters = kLanes == 16 ? 32 : 16;  // vector registers
  static constexpr int slice_vectors(int r) {
    const int fit = (kRegisters - 1) / (r + 1);
    // AVX2, one row: 8 vectors, whose accumulators and V no longer all fit the registers (8
    // independent multiply-add chains; 4 left the loop waiting on their latency): Zen 3, 1
    // thread, MHA f32 [B, Hkv, L, D] from L3 (Lk=256) 20-32 -> 29-34 GB/s in noisy runs; with
    // the other AVX2 changes of its commit (16-bit K and V), two runs of 5 interleaved passes,
    // % of the probe, Lk=4096/16384: f32 67/67, 66/65 -> 71/70, 70/70; bf16 51/53, 50/56 ->
    // 66/65, 61/61; f16 56/56, 59/57 -> 66/67, 62/64.
    if (r == 1 && kLanes == 8) return 8;
    return r == kTileRows ? kTileVectors : std::max(kTileVectors, fit >= 8 ? 8 : fit >= 4 ? 4 : 2);
  }

  template <class T, int R>
  ATTNCORE_TARGET static void accumulate(const Params& p, const T* v, const std::int64_t* v_at,
                                         std::int64_t ahead, VLead lead, DType dtype,
                                         std::int64_t keys, const float* probs, std::int64_t dv_pad,
                                         const float* alpha, float* out) {
    constexpr int kVectors = slice_vectors(R);
    constexpr std::int64_t kCols = kVectors * kLanes;
    constexpr bool kWidenedOneByOne = R == 1 && sizeof(T) == 2 && 2 * kVectors + 1 > kRegisters;
    const std::int64_t dv = p.head_dim_v;
    for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kCols) {
      const std::int64_t vectors = std::min<std::int64_t>(kVectors, (dv_pad - e0) / kLanes);
      Vec acc[R][kVectors];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec scale = splat(alpha[r]);
#pragma GCC unroll 8
        for (int x = 0; x < kVectors; ++x) {
          acc[r][x] = x < vectors ? load(out + r * dv_pad + e0 + x * kLanes) * scale : Vec{};
        }
      }
      // The key loop, with whole vectors (the common case: no tail, no test per load) or not.
      int width[kVectors];  // elements of each vector of the slice within Dv
      for (int x = 0; x < kVectors; ++x) {
        width[x] = x < vectors
                       ? static_cast<int>(std::clamp<std::int64_t>(dv - e0 - x * kLanes, 0, kLanes))
                       : 0;
      }
      // AVX2, several rows (GQA): no prefetch in the key loop. Each column slice first
      // prefetches its share of the chunk's `keys` rows lead.l1 keys on (one head: 32 keys on;
      // several heads: the head's next chunk, or none where lead.l1 is `ahead`:
      // tile_accumulate), and nothing lead.l2 keys on. With a prefetch of the slice's lines 16
      // keys on, the row lead.l1 keys on and the one lead.l2 (64) keys on in the loop, the
      // loop's branches and prefetches took a third of P . V: Zen 3, GQA 4 rows over one kv head
      // [B, Hkv, L, D] Lk=8192 from L3, TSC ticks per key, best of 2000 calls: f16 123 -> 103,
      // f32 157 -> 133; from memory (Hq=32 Hkv=8 Lk=16384, the variants in turn in one process,
      // median/best): f16 (25 rounds) 242/164 -> 171/136 (with the lead.l2 prefetch too:
      // 201/134), f32 (15 rounds) 357/286 -> 306/273 (316/296). Groups of 6 rows (Hq=48 Hkv=8,
      // R = kTileRows) with this and the 8-key f32 chunks below, against the version before, 3
      // runs each, best of 3: f32 345-355 -> 286-291, f16 190-255 -> 149-200.
      constexpr bool kSlicedLead = kLanes == 8 && R > 2;
      if constexpr (kSlicedLead) {
        const std::int64_t slices = (dv_pad + kCols - 1) / kCols;
        const std::int64_t per = (keys + slices - 1) / slices;
        const std::int64_t from = lead.l1 + e0 / kCols * per;
        for (std::int64_t c = from; c < std::min({from + per, lead.l1 + keys, ahead}); ++c) {
          if (lead.into_l1) {
            prefetch_lines<3>(v + v_at[c], dv);
          } else {
            prefetch_lines<2>(v + v_at[c], dv);
          }
        }
      }
      // known: the dtype as a constant (an integral_constant), or `dtype`, tested per load.
      auto keys_loop = [&](auto whole, auto known) ATTNCORE_TARGET {
        for (std::int64_t c = 0; c < keys; ++c) {
          const T* row = v + v_at[c] + e0;
          if constexpr (!kSlicedLead) {
            // GQA: this slice's lines of the row 16 keys on. (Each branch written out: through a
            // lambda, GCC 12 ran decode 2x slower.)
            if (R > 2 && lead.slices && c + 16 < ahead) {
              if (lead.into_l1) {
                prefetch_slice_lines<3>(v + v_at[c + 16] + e0,
                                        std::min<std::int64_t>(kCols, dv - e0), e0 == 0);
              } else {
                prefetch_slice_lines<2>(v + v_at[c + 16] + e0,
                                        std::min<std::int64_t>(kCols, dv - e0), e0 == 0);
              }
            }
            if (e0 == 0 && c + lead.l1 < ahead) {
              if (lead.into_l1) {
                prefetch_lines<3>(v + v_at[c + lead.l1], dv);
              } else {
                prefetch_lines<2>(v + v_at[c + lead.l1], dv);
              }
            }
            if (e0 == 0 && c + lead.l2 < ahead) prefetch_lines<2>(v + v_at[c + lead.l2], dv);
          }
          Vec vrow[kVectors];
#pragma GCC unroll 8
          for (int x = 0; x < kVectors; ++x) {
            if constexpr (decltype(whole)::value) {
              vrow[x] = load_part(row + x * kLanes, kLanes, known);
            } else {
              vrow[x] = width[x] > 0 ? load_part(row + x * kLanes, width[x], known) : Vec{};
            }
            // One row of 16-bit V with no registers for the whole slice (AVX2: 8 accumulators,
            // 8 widened vectors and the weight): each vector's product as it is widened, or GCC
            // 12 widens all of them first and keeps an accumulator on the stack. (f32 vectors
            // are read by the multiply-adds themselves.)
            if constexpr (kWidenedOneByOne) {
              acc[0][x] = fmadd(splat(probs[c]), vrow[x], acc[0][x]);
            }
          }
          if constexpr (kWidenedOneByOne) continue;
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            const Vec weight = splat(probs[r * kKeyTile + c]);
#pragma GCC unroll 8
            for (int x = 0; x < kVectors; ++x) acc[r][x] = fmadd(weight, vrow[x], acc[r][x]);
          }
        }
      };
      // The dtype a constant in the loop: no test per load (16-bit: bf16 or f16). bench
      // --decode, 1 thread, % of the probe, Lk=4096/16384, interleaved, against the test per
      // load: MHA f16 [B, L, Hkv, D] 75/73 -> 81/78, bf16 73/72 -> 76/75, GQA 16-bit 2-4 more;
      // AVX2 GQA f16 38/39 -> 43/44. But one head's one row (MHA [B, Hkv, L, D], whose V
      // prefetch distances were measured with the test) keeps the test: without it, 7 passes,
      // bf16 92/85 -> 89/80, f16 86/83 -> 78/76, and 24 or 48 keys of V lead, or V 96 keys on
      // into L2, did not recover that. (With this dispatch in a second lambda, GCC 12 ran
      // AVX-512 GQA 1.4x slower.)
      const bool whole = vectors == kVectors && e0 + kCols <= dv;
      if constexpr (sizeof(T) == 4) {
        if (whole) {
          keys_loop(std::true_type{}, F32{});
        } else {
          keys_loop(std::false_type{}, F32{});
        }
      } else if (R == 1 && lead.one_head && kLanes == 16) {  // (AVX2: the known dtype, faster)
        if (whole) {
          keys_loop(std::true_type{}, dtype);
        } else {
          keys_loop(std::false_type{}, dtype);
        }
      } else if (dtype == DType::f16) {
        if (whole) {
          keys_loop(std::true_type{}, F16{});
        } else {
          keys_loop(std::false_type{}, F16{});
        }
      } else if (whole) {
        keys_loop(std::true_type{}, Bf16{});
      } else {
        keys_loop(std::false_type{}, Bf16{});
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int x = 0; x < kVectors; ++x) {
          if (x < vectors) store(out + r * dv_pad + e0 + x * kLanes, acc[r][x]);
        }
      }
    }
  }

  // accumulate<R> for the item's rows. With several column slices (GQA), keys in chunks of 32
  // so that a chunk's V rows stay in L1 from one slice to the next (a 128-key f32 tile does
  // not fit: GQA f32 decode read 14-16 GB/s against 19-24 for 8 rows in 4 slices); the
  // accumulator is rescaled by the first chunk only (the same bits as one pass). AVX2, a
  // group's f32 rows over one head: chunks of 8 keys (a slice of 2 vectors reads one line of
  // each row; 8 rows' lines per slice from memory ran near the memory's pace where 32 did not):
  // Zen 3, 4 rows, P . V alone over 64 MiB of V, TSC ticks per key (V at the probe: 68), 11
  // rounds in turn, median: 32 keys 120, 16 keys 112, 8 keys 85-88 (the sliced lead 8 to 32
  // keys alike); f16 (two slices a line) 48 at 32 keys, 46-50 at 16, 88-90 at 8. Whole decode,
  // GQA Hq=32 Hkv=8 Lk=16384 [B, Hkv, L, D], median/best of 15 rounds: 318/288 -> 280/248,
  // 275/246 -> 226/211 in another run of 11 ([B, L, Hkv, D] and pages, whose chunks are a
  // head's 16 keys: 8 within noise, and kept at 16; their cut tiles, run head by head with
  // lead.one_head set, take 8). Every target likewise (on AVX-512, 4 rows: a slice of 4 vectors,
  // the lines of 4 of each row; the generic target not measured): Zen 4, Hkv = 8, [B, Hkv, L, D],
  // in one process, the calls in turn, 9 rounds, median speed ratio against 32 keys: Hq = 32 Lk =
  // 16384 1.15, Lk = 4096 1.14; Hq = 48 1.10, Hq = 64 1.09 (16 keys 0.96, 64 keys 1.00; 16-bit rows
  // in 8 keys 0.94-0.96, 16 keys 0.99-1.01).
  template <class T, int R>
  ATTNCORE_TARGET static void accumulate_chunks(const Params& p, const T* v,
                                                const std::int64_t* v_at, std::int64_t ahead,
                                                VLead lead, DType dtype, std::int64_t keys,
                                                const float* probs, std::int64_t dv_pad,
                                                const float* alpha, float* out) {
    const std::int64_t chunk = sizeof(T) == 4 && R > 2 && lead.one_head ? 8 : 32;
    // More rows than a micro-tile's (kDirectRows: AVX2's 8): each chunk for the first half of
    // the rows, then the second (its V rows from L1, prefetched by the first). Zen 3, Hq=8 Hkv=1
    // over 384 keys (L2), 1 thread, 7 rounds in turn, median: f32 0.056 ms with 8 rows at once
    // (column slices of one vector: 8 weights loaded per V vector) against 0.039 in halves, bf16
    // 0.035 either way; Hq=64 Hkv=8 over 16384 keys, 5 rounds: f32 14.5 -> 13.8 ms, bf16 11.5
    // either way.
    constexpr int kRows = R > kTileRows ? R / 2 : R;  // rows per pass
    if (kRows == R && (slice_vectors(R) * kLanes >= dv_pad || keys <= chunk)) {
      return accumulate<T, R>(p, v, v_at, ahead, lead, dtype, keys, probs, dv_pad, alpha, out);
    }
    float ones[kRows];
    std::fill_n(ones, kRows, 1.0f);
    for (std::int64_t c = 0; c < keys; c += chunk) {
      const VLead none{ahead - c, ahead - c, lead.one_head, lead.into_l1, lead.slices};
      for (int r = 0; r < R; r += kRows) {
        accumulate<T, kRows>(p, v, v_at + c, ahead - c, r == 0 ? lead : none, dtype,
                             std::min(chunk, keys - c), probs + r * kKeyTile + c, dv_pad,
                             c == 0 ? alpha + r : ones, out + r * dv_pad);
      }
    }
  }

  template <class T>
  ATTNCORE_TARGET static void accumulate_rows(const Params& p, const T* v, const std::int64_t* v_at,
                                              std::int64_t ahead, VLead lead, DType dtype,
                                              std::int64_t keys, std::int64_t rows,
                                              const float* probs, std::int64_t dv_pad,
                                              const float* alpha, float* out) {
    switch (rows_computed(rows)) {
      case 1:
        return accumulate_chunks<T, 1>(p, v, v_at, ahead, lead, dtype, keys, probs, dv_pad, alpha,
                                       out);
      case 2:
        return accumulate_chunks<T, 2>(p, v, v_at, ahead, lead, dtype, keys, probs, dv_pad, alpha,
                                       out);
      case 4:
        if constexpr (kTileRows > 4) {
          return accumulate_chunks<T, 4>(p, v, v_at, ahead, lead, dtype, keys, probs, dv_pad, alpha,
                                         out);
        }
        [[fallthrough]];
      case kTileRows:
        return accumulate_chunks<T, kTileRows>(p, v, v_at, ahead, lead, dtype, keys, probs, dv_pad,
                                               alpha, out);
      default:
        if constexpr (kDirectRows > kTileRows) {
          return accumulate_chunks<T, kDirectRows>(p, v, v_at, ahead, lead, dtype, keys, probs,
                                                   dv_pad, alpha, out);
        }
    }
  }

  // Whether a multi-head item's P . V takes a chunk of keys for all its heads in one pass
  // (accumulate_heads): AVX2 (AVX-512 where the decode plan says: heads_one_pass), one row per
  // head (MHA), Dv a whole number of 8-vector slices, its chunks within kMaxChunk and a head's V
  // row within kHeadVAhead (wider rows, which tile_accumulate prefetches as one head's, keep
  // that path).
  static constexpr std::int64_t kMaxChunk = 16;
  // Whether it takes the tile's keys one after another instead, every head's output in L1
  // (DirectKvHeads::accumulate_by_key): AVX-512 where the decode plan says (heads_v_by_key),
  // one row per head, Dv a whole number of vectors.
  ATTNCORE_TARGET static bool heads_by_key(const Params& p, std::int64_t heads, std::int64_t rows,
                                           std::int64_t dv_pad) {
    return kLanes == 16 && decode_plan().heads_v_by_key && heads > 1 &&
           rows_computed(rows) == 1 && p.head_dim_v == dv_pad;
  }
  ATTNCORE_TARGET static bool heads_in_one_pass(const Params& p, DType v_dtype, std::int64_t heads,
                                                std::int64_t rows, std::int64_t dv_pad) {
    return (kLanes == 8 || decode_plan().heads_one_pass) && heads > 1 && rows_computed(rows) == 1 &&
           p.head_dim_v == dv_pad && dv_pad % (slice_vectors(1) * kLanes) == 0 &&
           head_chunk(v_dtype, rows) <= kMaxChunk &&
           dv_pad * static_cast<std::int64_t>(size_of(v_dtype)) <= kHeadVAhead;
  }

  // P . V of one row per head for every head of a multi-head item, over keys [begin, begin +
  // keys) of the tile (keys <= kMaxChunk): head x's out [dv] (out + x * head_floats) = its
  // alpha (alpha + x * head_floats; with alpha null, 1) times out plus its P (probs + x *
  // head_floats) times its V rows (v_rows of the item's first head, x * a.v.stride[1]
  // elements on), each element's products in key order, as accumulate<T, 1> forms them (the
  // same bits; a rescale by 1 is left out, which changes no bit). The keys' rows are found once
  // for all the heads, and nothing is prefetched (as there). One call per head and chunk
  // instead cost about 107 TSC ticks (Zen 3: P . V alone from L2, MHA [B, L, Hkv, D] bf16, Hkv
  // = 32, ticks per key and head, 8 / 16 / 32 keys per call: 31.5 / 24.8 / 20.4, 18 of them the
  // products), a third of P . V's time; in one pass 17.7-18.4 (8 keys), from memory (64 MiB)
  // 37.5/35.2 against 50.8/46.7 (best of 5, two runs; V at the probe's pace: 34.8).
  template <class T, class Known>
  ATTNCORE_TARGET static void accumulate_heads(const T* v, const std::int64_t* v_at,
                                               std::int64_t keys, std::int64_t heads,
                                               std::int64_t v_step, std::int64_t dv,
                                               const float* probs, float* out, const float* alpha,
                                               std::int64_t head_floats) {
    constexpr int kVectors = slice_vectors(1);
    constexpr std::int64_t kCols = kVectors * kLanes;
    const T* rows[kMaxChunk];
    for (std::int64_t c = 0; c < keys; ++c) rows[c] = v + v_at[c];
    for (std::int64_t x = 0; x < heads; ++x) {
      const float* px = probs + x * head_floats;
      float* ox = out + x * head_floats;
      const std::int64_t at = x * v_step;
      for (std::int64_t e0 = 0; e0 < dv; e0 += kCols) {
        Vec acc[kVectors];
#pragma GCC unroll 8
        for (int i = 0; i < kVectors; ++i) acc[i] = load(ox + e0 + i * kLanes);
        if (alpha != nullptr) {
          const Vec scale = splat(alpha[x * head_floats]);
#pragma GCC unroll 8
          for (int i = 0; i < kVectors; ++i) acc[i] *= scale;
        }
        for (std::int64_t c = 0; c < keys; ++c) {
          const T* row = rows[c] + at + e0;
          const Vec weight = splat(px[c]);
#pragma GCC unroll 8
          for (int i = 0; i < kVectors; ++i) {
            acc[i] = fmadd(weight, load_part(row + i * kLanes, kLanes, Known{}), acc[i]);
          }
        }
#pragma GCC unroll 8
        for (int i = 0; i < kVectors; ++i) store(ox + e0 + i * kLanes, acc[i]);
      }
    }
  }
  // accumulate_heads for the input's dtype (heads_in_one_pass): probs, out and alpha those of
  // the item's first head, each head's head_floats floats after the one before.
  ATTNCORE_TARGET static void tile_accumulate_heads(const Params& p, const ForwardArgs& a,
                                                    const TileRows& v_rows, std::int64_t begin,
                                                    std::int64_t keys, std::int64_t heads,
                                                    const float* probs, float* out,
                                                    const float* alpha, std::int64_t head_floats) {
    const std::int64_t* at = v_rows.at + begin;
    const std::int64_t v_step = a.v.stride[1], dv = p.head_dim_v;
    if (a.v.dtype == DType::f32) {
      accumulate_heads<float, F32>(static_cast<const float*>(a.v.data), at, keys, heads, v_step, dv,
                                   probs, out, alpha, head_floats);
    } else if (a.v.dtype == DType::f16) {
      accumulate_heads<std::uint16_t, F16>(static_cast<const std::uint16_t*>(a.v.data), at, keys,
                                           heads, v_step, dv, probs, out, alpha, head_floats);
    } else {
      accumulate_heads<std::uint16_t, Bf16>(static_cast<const std::uint16_t*>(a.v.data), at, keys,
                                            heads, v_step, dv, probs, out, alpha, head_floats);
    }
  }

  // A tile's P . V over its keys [0, keys) for `heads` kv heads (P, alpha and out those of the
  // first head, each head's head_floats floats after the one before): one head's in one call;
  // several heads' key by key where the decode plan says (heads_by_key), else in chunks of
  // head_chunk keys, each chunk for every head (V read in order
  // with the heads inside a key's row; heads_in_one_pass: in one pass, accumulate_heads), the
  // head's next chunk of V prefetched (tile_accumulate), each head's accumulator rescaled by
  // its first chunk only: the same sums in the same order as one call.
  ATTNCORE_TARGET static void tile_accumulate_chunks(const Params& p, const ForwardArgs& a,
                                                     const TileRows& v_rows, std::int64_t keys,
                                                     std::int64_t heads, std::int64_t rows,
                                                     const float* probs, std::int64_t dv_pad,
                                                     const float* alpha, float* out,
                                                     std::int64_t head_floats) {
    if (heads_by_key(p, heads, rows, dv_pad)) {
      const std::int64_t* at = v_rows.at;
      const std::int64_t ahead = v_rows.count, v_step = a.v.stride[1], dv = dv_pad;
      const DecodePlan& plan = decode_plan();
      const std::int64_t lead = plan.heads_16bit_lead;
      const bool l1 = plan.heads_16bit_into_l1;
      if (a.v.dtype == DType::f32) {
        accumulate_by_key<float, F32>(static_cast<const float*>(a.v.data), at, keys, ahead, heads,
                                      v_step, dv, probs, out, alpha, head_floats, 0, false);
      } else if (a.v.dtype == DType::f16) {
        accumulate_by_key<std::uint16_t, F16>(static_cast<const std::uint16_t*>(a.v.data), at,
                                              keys, ahead, heads, v_step, dv, probs, out, alpha,
                                              head_floats, lead, l1);
      } else {
        accumulate_by_key<std::uint16_t, Bf16>(static_cast<const std::uint16_t*>(a.v.data), at,
                                               keys, ahead, heads, v_step, dv, probs, out, alpha,
                                               head_floats, lead, l1);
      }
      return;
    }
    float ones[kDirectRows];
    std::fill_n(ones, kDirectRows, 1.0f);
    const std::int64_t v_ahead =
        kHeadVAhead / (p.head_dim_v * static_cast<std::int64_t>(size_of(a.v.dtype)));
    const std::int64_t step = heads > 1 ? head_chunk(a.v.dtype, rows) : kKeyTile;
    const bool one_pass = heads_in_one_pass(p, a.v.dtype, heads, rows, dv_pad);
    for (std::int64_t c = 0; c == 0 || c < keys; c += step) {
      const std::int64_t chunk = std::min(step, keys - c);
      if (one_pass) {
        tile_accumulate_heads(p, a, v_rows, c, chunk, heads, probs + c, out,
                              c == 0 ? alpha : nullptr, head_floats);
        continue;
      }
      for (std::int64_t x = 0; x < heads; ++x) {
        const std::int64_t at = x * head_floats;
        tile_accumulate(p, a, v_rows, x * a.v.stride[1], c, chunk, heads > 1 ? v_ahead : 0, rows,
                        probs + at + c, dv_pad, c == 0 ? alpha + at : ones, out + at);
      }
    }
  }

  // A key tile's P . V for the rows of one head, V rows resolved (TileRows) of the item's first
  // kv head in the input's dtype and the head's lying v_shift elements after them: keys [begin,
  // begin + keys) of the tile, the `next` keys after them prefetched.
  ATTNCORE_TARGET static void tile_accumulate(const Params& p, const ForwardArgs& a,
                                              const TileRows& v_rows, std::int64_t v_shift,
                                              std::int64_t begin, std::int64_t keys,
                                              std::int64_t next, std::int64_t rows,
                                              const float* probs, std::int64_t dv_pad,
                                              const float* alpha, float* out) {
    const std::int64_t* at = v_rows.at + begin;
    const std::int64_t ahead = v_rows.count - begin;
    // The next chunk's rows of this head (several heads), into L2 (a group's f32 rows into L1
    // where the core's decode plan says: group_f32_next_v_into_l1), here, except for a group's 3
    // or more rows where the plan says not (group_v_next_chunk; accumulate's
    // column slices prefetch their lines 16 keys on anyway); AVX2: none here, for one row per
    // head or a group's rows alike (head_chunk; a 16-bit group's rows prefetch it in
    // accumulate: group_lead below).
    // A group's 3 or more 16-bit rows, where the plan says (group_16bit_v_next_at_jumps), only
    // where the next chunk's rows do not go on evenly from this chunk's (a page boundary between
    // them, or in the next chunk): where they do, the column slices' prefetches 16 keys on cover
    // them (accumulate; 2 rows have none).
    const DecodePlan& plan = decode_plan();
    const std::int64_t window = std::clamp<std::int64_t>(ahead - keys, 0, next);
    const bool at_jumps =
        rows > 2 && a.v.dtype != DType::f32 && plan.group_16bit_v_next_at_jumps;
    const bool skip = (rows > 2 && !plan.group_v_next_chunk) ||
                      (at_jumps && window > 0 && keys >= 2 &&
                       at[keys + window - 1] - at[0] == (keys + window - 1) * (at[1] - at[0]));
    const std::int64_t prefetched = kLanes == 8 || skip ? 0 : window;
    const bool group_l1 = rows > 2 && a.v.dtype == DType::f32 && plan.group_f32_next_v_into_l1;
    // Of them, the far end's, the rows fewer than kHeadVTimes chunks (at_jumps: one) have asked
    // for before; a tile's first chunk also those kRowLead or more rows into the tile, past what
    // the tile before it resolved.
    const std::int64_t far = next - (at_jumps ? 1 : kHeadVTimes) * keys;
    const std::int64_t from =
        std::max<std::int64_t>(begin == 0 ? std::min(far, kRowLead - keys) : far, 0);
    // One head per item, nothing prefetched for the next chunk (V one sequential stream): V rows
    // kVLead keys on, into L1 (or L2: the core's decode plan), as P . V runs (one f32 row, MHA:
    // as far as the plan says), and into L2 as far as the plan says (decode_plan.h; 0: not).
    auto keys_or_none = [&](int n) { return n > 0 ? std::int64_t{n} : ahead; };
    // Several heads: on AVX2, a group's 16-bit rows (GQA) prefetch their head's next chunk as
    // they go (accumulate's sliced lead), f32 rows and one row per head nothing (GQA Hq=32
    // Hkv=8 Lk=16384, Zen 3, 1 thread, TSC ticks per key and head, 15 rounds of both in turn in
    // one process, median/best: f16 [B, L, Hkv, D] 204/161 -> 184/142, p16 237/190 -> 202/154;
    // bf16 BLHD 202/161 -> 173/142, p16 242/233 -> 204/186; f32 BLHD 246/212 -> 256/229 and
    // 238/210 -> 248/215, p16 (Lk=4096) 250/203 -> 251/211).
    const bool group_lead = kLanes == 8 && rows > 2 && a.v.dtype != DType::f32;
    // A group's 16-bit rows over one head whose rows lie together, on AVX-512 where the plan
    // prefetches V far ahead into L2 (v_far; the slices' then go into L2 too), leave their
    // column slices' prefetches out: the far one has brought those lines into L2 already (Zen
    // 4, Hq = 32, Hkv = 8, [B, Hkv, L, D], 1 thread, in one process with 256 MiB read before
    // each call, 7 rounds, median speed ratio: f16 Lk = 16384 1.016, 4096 1.015; bf16 1.047,
    // 1.033; without the 32-key lead too 0.86-0.93; f32, which keeps them, 1.01-1.03, and 0.97
    // from L3; over several heads, [B, L, Hkv, D] and p16: 1.00-1.01, f32 0.99-1.00).
    const bool together = ahead < 2 || at[1] - at[0] == p.head_dim_v;
    const bool far_covers_slices = kLanes == 16 && next <= 0 && a.v.dtype != DType::f32 &&
                                   plan.v_far != 0 && !plan.v_into_l1 && together;
    const bool slices = !far_covers_slices;
    const VLead lead =
        next > 0 ? VLead{group_lead ? keys : ahead, ahead, false, plan.v_into_l1, slices}
                 : VLead{rows > 1 || a.v.dtype != DType::f32 ? kVLead
                                                             : keys_or_none(plan.f32_row_v_lead),
                         keys_or_none(plan.v_far), true, plan.v_into_l1, slices};
    if (a.v.dtype == DType::f32) {
      const float* v = static_cast<const float*>(a.v.data) + v_shift;
      if (prefetched > from) prefetch_rows(p, v, at + keys + from, prefetched - from, group_l1);
      accumulate_rows(p, v, at, ahead, lead, a.v.dtype, keys, rows, probs, dv_pad, alpha, out);
    } else {
      const std::uint16_t* v = static_cast<const std::uint16_t*>(a.v.data) + v_shift;
      if (prefetched > from) prefetch_rows(p, v, at + keys + from, prefetched - from, group_l1);
      accumulate_rows(p, v, at, ahead, lead, a.v.dtype, keys, rows, probs, dv_pad, alpha, out);
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
