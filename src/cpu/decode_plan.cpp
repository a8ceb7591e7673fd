#include "cpu/decode_plan.h"

#include <atomic>
#include <cstdlib>
#include <iterator>
#include <limits>

#include "attncore/error.h"
#include "attncore/info.h"

namespace attncore::detail {

namespace {

// Each plan as measured on its core: bench --decode, 1 thread, % of the read probe, Lk =
// 4096/16384, B = 1, interleaved passes of the two plans on the same machine (Intel: in one
// process, the plans' calls in turn).
const DecodePlan kPlans[] = {
    // Zen 4 (AMD family 0x19, which also holds Zen 3), and every CPU not named below (not
    // measured). AVX-512 runs some of AVX2's schemes here: key groups over several heads for
    // f32 rows (and on bf16 pairs, which AVX2 lacks), and a group's K prefetches spread among its
    // products; the others ran slower on Zen 4 (below; not measured on Zen 5). On Zen
    // 3 (AVX2, probe 18-20 GB/s) the plans tried (this one, zen5's, no near
    // K, no V leads, near K into L1) read within the run-to-run noise of each other (5-10
    // points), bound by the AVX2 kernels' instructions as much as by memory: it keeps this
    // one; the AVX2 kernels' whole tiles of one row and multi-head items prefetch less anyway
    // (flash_direct_kv*-inl.h). Near K rows into L2, f32 rows also 12 KiB ahead; an f32 row's V
    // 8 keys ahead; every one-head item's V also 64 keys ahead into L2; no V into L1.
    // Built up in steps, each against the step before:
    // - Against the zen5 plan, 5 passes, near K into L2 once and an f32 row's V 8 keys ahead
    //   into L1: MHA [B, Hkv, L, D] f32 47/45 -> 57/58, bf16 60/59 -> 78/78, f16 55/55 ->
    //   75/73; GQA (Hkv = 8) f32 35/36 -> 43/43, bf16 38/37 -> 49/49, f16 33/32 -> 46/44.
    //   (Near K into L1 once: f32 MHA 49/47 with no V lead; not prefetched at all: 35/35; an
    //   f32 row's V into L1 0, 8, 16, 32 keys ahead: 55, 77, 74, 66-69 in one run. Tiles of
    //   512 keys instead of 128, so that K and V alternate less often: within noise.)
    // - f32 K also 12 KiB ahead, each such prefetch just before the one 6 KiB ahead, and an f32
    //   row's V also 32 keys ahead into L2, 5 passes: MHA f32 60/62 -> 70/72, GQA f32 46/45 ->
    //   49/49, the rest within noise (with all of a block's 12 KiB prefetches first 65/65; in
    //   7-pass runs: 8 KiB 74/76 against 12 KiB's 79/79, K alone 71/72).
    // - Every one-head item's V also 64 keys ahead into L2, 5 passes: GQA f32 51/47 -> 65/61,
    //   bf16 50/49 -> 61/61, f16 44/43 -> 53/53 (48 and 40 keys: 2-9 points less than 64 in
    //   another run); MHA bf16 81/79 -> 84/85, f16 73/72 -> 80/78; one f32 row equal at 32, 48
    //   or 64 keys (7 passes).
    // - V prefetched into L2 instead of L1 (L1 prefetches cost on this core: a plain stream read
    //   31 GB/s, 23-25 with prefetcht0 1-16 KiB ahead). A group's (GQA, kVLead keys ahead and
    //   each column slice's 16), Hkv=8, 9 passes, Lk=4096/16384: f32 [B, Hkv, L, D] 59/60 ->
    //   66/66, [B, L, Hkv, D] 68/63 -> 73/70, p16 71/64 -> 73/65, p256 74/66 -> 75/69; bf16
    //   [B, Hkv, L, D] 57/56 -> 60/59, f16 49/50 -> 52/53, [B, L, Hkv, D] and p16 within 2 (the
    //   slice's alone into L2: within noise). One 16-bit row's (MHA [B, Hkv, L, D], kVLead keys
    //   ahead), three runs of 9-11 passes: bf16 78/78 -> 76/81, 76/82 -> 85/86, 79/81 -> 83/82;
    //   f16 74/74 -> 84/85, 78/79 -> 75/83, 79/76 -> 82/76. One f32 row's (8 keys ahead), 9 and
    //   11 passes: 73/74 -> 81/83, 71/71 -> 78/80 (4 or 16 keys into L2 as 8; earlier kernels
    //   had read no more with it in L2).
    // - One f32 row per head over several heads (MHA [B, L, Hkv, D], pages) scored 4 keys at a
    //   time head after head (heads_key_groups_f32; AVX-512 kernels, Hq = Hkv = 32, 1 thread, the
    //   two in turn in one process, median speed ratio of 9 rounds): Lk = 16384 [B, L, Hkv, D]
    //   1.07, p16 1.09; Lk = 4096 1.07, 1.10. 16-bit K widened so ran slower (f16 0.95-0.97),
    //   and the one pass of P . V across heads (heads_one_pass) too (0.86-0.91, f32 and bf16).
    //   bf16 pairs so (heads_key_groups_pairs; against each key's score of every head in turn,
    //   a reduce_sum each), the same A/B: Lk = 16384 [B, L, Hkv, D] 1.05, p16 1.06, p256 1.06;
    //   Lk = 4096 [B, L, Hkv, D] 1.04.
    //   Then the f32 rows' K prefetched 32 keys on into L2, line by line through the key groups
    //   (heads_f32_k_lead), against none, the same A/B, 5 rounds: D = 128, Lk = 16384: [B, L,
    //   Hkv, D] 1.06-1.08, p16 1.06-1.07, p256 1.05; Lk = 4096: 1.07, p16 1.07; D = 64, Hkv = 8,
    //   Lk = 65536: 1.31-1.33 (8, 16, 24, 48 and 64 keys within 0.03 of 32 at D = 128).
    // - A GQA group's K over several heads (GQA [B, L, Hkv, D], pages) prefetched line by line
    //   through the products (group_k_spread), the same A/B, Hq = 32, Hkv = 8, Lk = 16384: f32
    //   [B, L, Hkv, D] 1.06-1.07, p16 1.07; f16 1.04, 1.04 (in separate processes f32 1.08,
    //   1.08, f16 1.02, 1.03); bf16 pairs (once their scores took the prefetch too) 1.02-1.03
    //   (in separate processes 1.05, 1.03); f32 rows of one head ([B, Hkv, L, D]) spreading their
    //   block's K prefetches over the rows' scores likewise (DirectKvScores::scores) 1.02-1.07;
    //   then 6 KiB or 8 KiB ahead instead of 4: 1.00-1.04, 2 KiB 0.93-0.95. A group's rows over
    //   one head as 4 streams (rows_streams, GQA [B, Hkv, L, D]): f32 0.93, f16 0.88, bf16 1.00;
    //   with their P . V run with the next tile's streams (rows_overlap) 0.70, 0.82, 1.00.
    // - (Before the plans, on Zen 3, AVX2's kernels:) 16-bit K of one row per head over several
    //   heads, scored key by key, prefetched 16 keys on into L2 (heads_16bit_lead): bench
    //   --decode MHA Hkv = 32, 1 thread, % of the probe, Lk = 4096/16384, 7 interleaved passes,
    //   against none: bf16 [B, L, Hkv, D] 69/70 -> 74/74, p16 69/59 -> 79/65; f16 66/64 ->
    //   67/65, p16 61/54 -> 64/58 (8 and 32 keys within noise of 16).
    {.name = "zen4",
     .near_k_into_l1 = false,
     .near_k_f32_also_bytes = 12288,
     .near_k_f32_also_interleaved = true,
     .f32_row_v_lead = 8,
     .v_far = 64,
     .v_into_l1 = false,
     .one_row_streams = false,
     .one_row_paired = false,
     .heads_key_groups_f32 = true,
     .heads_key_groups_16bit = false,
     .heads_key_groups_pairs = true,
     .heads_one_pass = false,
     .heads_f32_k_lead = 32,
     .heads_16bit_lead = 16,
     .heads_16bit_into_l1 = false,
     .heads_v_by_key = false,
     .rows_streams = false,
     .rows_overlap = false,
     .heads_overlap = false,
     .group_v_next_chunk = true,
     .group_k_ahead_bytes = 4096,
     .group_k_spread = true,
     .group_f32_near_spread = true,
     .group_k_into_l1 = false,
     .group_16bit_v_next_at_jumps = false,
     .group_f32_next_v_into_l1 = false,
     .group_by_key = false,
     .group_widened_by_key_small_pages = false},
    // Zen 5 (AMD family 0x1A and later). Near K rows into L1, f32 rows also 3 KiB ahead, a
    // block's first (MHA f32 82/81 -> 88/86, GQA f32 76/65 -> 80/72 and 68/62 -> 78/73 in two
    // runs of 9 passes against once; 16-bit rows ran slower twice: bf16 97/92 -> 89/88); no V
    // prefetch for an f32 row (80/79 against 78/76 at 8 keys); other V into L1 (as measured
    // there before the plans). Then, on Zen 5 (family 0x1A model 2, probe 36.7 GB/s on 1 thread),
    // Hq = 32, 1 thread, in one process with 256 MiB read before each call, 7 rounds, median speed
    // ratio, Lk = 4096/16384:
    // - Zen 4's schemes added: one f32 row per head over several heads scored 4 keys at a time
    //   head after head (heads_key_groups_f32), its P . V with the next tile's scores
    //   (heads_overlap), and a GQA group's K over several heads, and its 16-bit rows over one
    //   head, prefetched line by line through the products (group_k_spread): MHA f32 [B, L, Hkv,
    //   D] 1.49/1.55, p16 1.56/1.57, p256 1.55/1.56 (key groups alone 1.24-1.25, then the overlap
    //   1.13-1.20 on them, the one pass instead 1.15-1.16); GQA (Hkv = 8) f16 1.10-1.17 but p16
    //   1.04/0.99, bf16 [B, L, Hkv, D] 1.04/1.06, p16 1.14/1.08, p256 1.02/1.11, f32 0.97-1.04;
    //   the rest 0.98-1.03. A GQA group's f32 rows over one head ([B, Hkv, L, D]) spreading
    //   their K prefetches (group_f32_near_spread, Zen 4's): 0.98/0.93, 0.91-0.93 in two earlier
    //   runs, not kept; the f32 key groups' K lead (heads_f32_k_lead) 8 to 64 keys: 0.91-0.95;
    //   16-bit key groups or the one pass: f16 0.85-0.94, bf16 0.92-1.03; bf16 pairs 0.95-1.01.
    //   Each of the zen4 plan's other prefetches (MHA [B, Hkv, L, D]: near K into L2, V into L2
    //   or 64 keys on, an f32 row's V 8 keys on, f32 K not also 3 KiB on): 0.93-1.05 of this
    //   one, inside this machine's noise then (this plan against itself: 0.94-1.09).
    // - One row of one head ([B, Hkv, L, D]) scored key by key, each key followed by the previous
    //   tile's P . V of the same key (one_row_paired; K and V read as one stream each, at once,
    //   each prefetched 2 KiB ahead into L1): Lk = 16384, 9 rounds: f32 1.09, bf16 1.19, f16
    //   1.22 (flash_direct_kv_streams-inl.h: the A/Bs behind its order and its prefetches). One
    //   row's 4 streams (one_row_streams) instead: f32 0.94, bf16 0.94, f16 0.86.
    // - A GQA group's K over several heads, prefetched line by line through its scores, and its
    //   next chunk of V rows, into L1 instead of L2 (group_k_into_l1, group_f32_next_v_into_l1;
    //   Hq = 32, Hkv = 8, 9-11 rounds): f32 [B, L, Hkv, D] 1.21-1.22 (K alone 1.12, V alone 1.08),
    //   p256 1.21, p16 1.09 (1.02 in a first run); Lk = 4096: 1.21, p16 1.17; 2 threads 1.07-1.10;
    //   from L2 and L3 1.00 (what it gains is the loads' overlap with the arithmetic); over one
    //   head ([B, Hkv, L, D]) 0.99-1.01. 16-bit groups: K so 0.99-1.03, V so 0.97-0.99 (f32 rows
    //   only). (A prefetcht1 costs here where a prefetcht0 does not: a scratch loop of 4
    //   multiply-adds per line read from L2 or L3 at 0.74-0.78 of its speed with a prefetcht1 per
    //   line 4 KiB ahead, or 8 KiB with a prefetcht0 2 KiB ahead, and at 1.01-1.14 with a
    //   prefetcht0 4 KiB ahead.) The next chunk of V for one row per head (16-bit MHA over several
    //   heads) into L1 read 0.93, and stays in L2.
    // - A GQA group's 16-bit rows over several heads prefetching their next chunk of V only where
    //   its rows do not go on evenly from the chunk's (group_16bit_v_next_at_jumps; 9 rounds): bf16
    //   [B, L, Hkv, D] 1.09, p256 1.08, p16 1.00; f16 1.10, 1.07, 1.03. (Not at all: the same where
    //   rows go on evenly, p16 0.98-0.99; f32 rows need it: 0.85-0.88 without.) Then each such row
    //   prefetched by one chunk, not two (11 rounds): p16 bf16 1.03, f16 1.03, from L3 1.06 (the
    //   flag's whole effect, against the plan without it: p256 1.08-1.09). The three flags for
    //   groups of 3 or more rows only: groups of 8 (Hq = 32, Hkv = 4), all three against none, 9
    //   rounds: f32 [B, L, Hkv, D] 1.16, p16 1.21; bf16 1.09, 1.06; f16 1.10, 1.04; groups of 2
    //   (Hq = 16, Hkv = 8), whose products prefetch no column slices: f16 [B, L, Hkv, D] 0.69, bf16
    //   0.73 with the next chunk of V left to them, and with K and f32 V into L1 0.96-1.01.
    // - One row per head over several heads (MHA [B, L, Hkv, D], pages): P . V key after key,
    //   every head's output in L1, V read in address order and prefetched only at page jumps
    //   (heads_v_by_key), f32 scores' key groups no longer run with P . V (heads_overlap off),
    //   16-bit K 4 keys on into L2 instead of 16 (heads_16bit_lead; 2 to 4 alike, none
    //   0.62-0.75 for f16, 0.92-1.00 for bf16 pairs): Hq = Hkv = 32, Lk = 16384, 7 rounds, against
    //   the plan before: f32 [B, L, Hkv, D] 1.11, p16 1.07, p256 1.14; bf16 1.18, 1.11, 1.17;
    //   f16 1.12, 1.05, 1.22 (flash_direct_kv_heads-inl.h: accumulate_by_key). Then that K 1 key
    //   on into L1 (heads_16bit_into_l1; 9 rounds): f16 [B, L, Hkv, D] 1.05, p16 1.04, p256
    //   1.09, from L3 (Lk = 512) 1.07; bf16 1.05, 1.05, from L3 1.03 (2 keys into L1 0.99-1.05,
    //   into L2 0.95-1.03); then their V so too (7 rounds): bf16 1.04, 1.09, p256 1.07; f16
    //   1.03, 1.07-1.09, p256 1.04. A GQA group's P . V so, key after key (1, 2 or 4 keys at a
    //   time, each head's 4 rows' outputs through L1, no V prefetch): f32 [B, L, Hkv, D] 0.72-0.90,
    //   f16 0.76-0.89, bf16 0.76-0.91, not kept. Its f32 scores key by key (group_by_key):
    //   Hkv = 8, [B, L, Hkv, D] 1.20-1.21, p16 1.25, p256 1.20-1.21 (DirectKvHeads::
    //   score_rows_by_key); its scores by key groups across heads (4 keys, 4 rows, as
    //   heads_overlap's) instead: f32 1.03-1.05, f16 0.99-1.02. Its bf16 scores on pairs key by
    //   key too: [B, L, Hkv, D] 1.05, p16 1.16, p256 1.09; its f16 scores key by key over pages
    //   of 32 keys or fewer (group_widened_by_key_small_pages): p16 1.12, p32 1.05 (p64 1.00,
    //   [B, L, Hkv, D] and p256 0.94-0.95: not there); 16-bit groups of 8 rows 0.90-0.97: not so.
    {.name = "zen5",
     .near_k_into_l1 = true,
     .near_k_f32_also_bytes = 3072,
     .near_k_f32_also_interleaved = false,
     .f32_row_v_lead = 0,
     .v_far = 0,
     .v_into_l1 = true,
     .one_row_streams = false,
     .one_row_paired = true,
     .heads_key_groups_f32 = true,
     .heads_key_groups_16bit = false,
     .heads_key_groups_pairs = false,
     .heads_one_pass = false,
     .heads_f32_k_lead = 0,
     .heads_16bit_lead = 1,
     .heads_16bit_into_l1 = true,
     .heads_v_by_key = true,
     .rows_streams = false,
     .rows_overlap = false,
     .heads_overlap = false,
     .group_v_next_chunk = true,
     .group_k_ahead_bytes = 4096,
     .group_k_spread = true,
     .group_f32_near_spread = false,
     .group_k_into_l1 = true,
     .group_16bit_v_next_at_jumps = true,
     .group_f32_next_v_into_l1 = true,
     .group_by_key = true,
     .group_widened_by_key_small_pages = true},
    // Intel (GenuineIntel; measured on one Xeon with AVX512-FP16 and AMX, family 6 model 0xA7
    // as its hypervisor reports it, probe 16 GB/s on 1 thread). Zen 4's prefetches: no placement
    // moved decode there (the zen5 plan and none at all within 0.93-1.04 of them, MHA and GQA,
    // both layouts), the three schemes AVX2 runs for MHA, and a group's rows read likewise. Hq =
    // 32, Lk = 16384 unless said, 1 thread, 7-9 rounds of the calls in turn in one process with 1
    // GiB read before each call, median speed ratio:
    // - The three against none (the zen4 plan, each on the target this CPU now runs, avx512, and
    //   on the one it ran before, avx512bf16): MHA f32 [B, Hkv, L, D] 1.16, [B, L, Hkv, D] 1.19,
    //   p16 1.17; bf16 1.18, 1.04, 1.07; f16 1.22, 1.12, 1.14. GQA (Hkv = 8), which none of them
    //   reads differently: 0.98-1.06.
    // - One row's streams alone, [B, Hkv, L, D]: f32 1.15-1.16, bf16 1.13-1.15, f16 1.13-1.17
    //   (its V 4 to 32 keys ahead into L1 or L2, or not prefetched: 0.97-1.03). A bf16 query over
    //   a bf16 cache on bf16 pair dots (the avx512bf16 target) keeps its own scores.
    // - Several heads, [B, L, Hkv, D], avx512: key groups alone f32 1.09, bf16 1.06, f16 1.07;
    //   the one pass alone 1.12, 1.07, 1.08; both 1.20, 1.12, 1.17 (then 16-bit with P . V in
    //   chunks of 8 or 32 keys instead of 16, K prefetched 32 keys on or not at all: 1.01-1.05,
    //   within the noise; 16-bit chunks are 8 keys since, as measured on Zen 4: head_chunk).
    //   Several heads' one pass run chunk by chunk with the next tile's
    //   scores of each 16-key block: 0.98-1.04, not kept.
    // - A GQA group's rows (Hkv = 8, [B, Hkv, L, D], avx512), their K as 4 streams: f32 1.07,
    //   bf16 1.13, f16 1.15 (from L2, Hq = 4 Hkv = 1 Lk = 512-1024 in a loop: bf16 1.10, f32
    //   1.25); then their P . V with the next tile's streams, Lk = 4096/16384: f32 1.07/1.00,
    //   bf16 1.14/1.07, f16 1.07/1.08 (from L2 bf16 0.93: more work, read at once); with
    //   RowsProduct's weights and fields in locals and whole groups tested once, Lk = 16384:
    //   f32 1.06, bf16 1.18, f16 1.17 (from L2 bf16 1.13-1.25x what it was).
    // - Several heads' P . V run with the next tile's scores head by head, each head's 4 keys
    //   after its 4 scored keys (heads_overlap; K and V then read at once, as 4 streams each),
    //   against the one pass after the scores, [B, L, Hkv, D] and p16: f32 1.07, 1.06; bf16
    //   1.13, 1.15; f16 1.11, 1.18 (on Zen 3 the same order, with AVX2's kernels, read f32 BLHD
    //   at 78-93% of the probe against 91-101: docs/decode.md). Half an hour later, while the
    //   same decode read 57-77% of the probe instead of 66-88 (the probe the same, 16 GB/s), the
    //   two ran equal: 0.96-1.04 in 4 runs of 5 rounds. A GQA group's rows read so (4 rows per
    //   head): 0.81-0.96, not kept.
    // - A GQA group's P . V over several heads ([B, L, Hkv, D], pages; Hkv = 8, 7 and 5 rounds)
    //   without its head's next chunk of V prefetched (each column slice's lines 16 keys on
    //   still are): bf16 1.07-1.11, f16 1.09-1.12, f32 0.995-1.007; without the slices' instead
    //   bf16 1.00-1.01, f16 1.00-1.02, f32 0.93-0.94; without both 0.74-0.77 (16-bit), 0.90-0.91.
    //   Then its K prefetched 2 KiB of each head ahead instead of 4 (two runs of 5 rounds): bf16
    //   1.02-1.04, f16 1.01-1.05, f32 1.01-1.03 (1 KiB and 3 KiB within 2% of 2; 8 KiB 0.92-0.99,
    //   none 0.77-0.79 and 0.93-0.94; the slices' V 8 keys on instead of 16 0.86 and 1.00, 32
    //   keys 0.97-1.00).
    // - That K (K/V on huge pages from here on, as bench --decode takes them) prefetched line by
    //   line through the products (group_k_spread) 4 KiB of each head ahead (16 keys of 16-bit
    //   rows, 8 of f32), against each block's rows 2 KiB ahead before its scores, two runs of 5
    //   rounds: bf16 [B, L, Hkv, D] 1.065, 1.063; f16 p16 1.034; f32 BLHD 1.013 (spread 3 KiB
    //   ahead 1.044, 6 KiB 1.05, 8 KiB 1.053 and f32 0.99, 12 KiB f32 0.98; 1 KiB 0.94, 0.5 KiB
    //   0.85; a burst per group of 4 keys before it, as AVX2 prefetches, 2 KiB ahead 1.00-1.01).
    //   bench --decode against the commit before, separate processes in turn, 4 rounds, median
    //   ratio, Lk = 4096/16384: bf16 BLHD 1.02/1.05, p16 1.04/1.04; f16 BLHD 1.06/1.07, p16
    //   1.05/1.03; f32 BLHD 1.01/1.01, p16 0.98/1.00.
    // - (2026-12-02, probe 16.1-17.3 GB/s.) One row of one head scored key by key with the tile
    //   before's P . V of the same key (one_row_paired, Zen 5's; taken before the streams), MHA
    //   [B, Hkv, L, D], 9 rounds, Lk = 4096/16384: bf16 1.03/1.05, f16 1.02/1.02, f32 1.00/0.99;
    //   2 threads bf16 1.04, f32 0.99; from L3 (Lk = 512) f16 1.02. Zen 5's other schemes, each
    //   against this plan (5 rounds, Lk = 16384): MHA [B, L, Hkv, D] and p16 P . V key by key
    //   (heads_v_by_key, without heads_overlap) 0.86-0.95, with its 16-bit leads 0.85-0.95; GQA
    //   (Hkv = 8) f32 scores key by key (group_by_key) [B, L, Hkv, D] 1.02, p16 0.90; f16 and bf16
    //   so over p16 0.98-1.00; a group's K into L1 (group_k_into_l1) 0.97-1.01; its next chunk of V
    //   (group_v_next_chunk, with or without group_16bit_v_next_at_jumps) 0.98-1.01; the zen5 plan
    //   whole 0.72-1.03 (GQA [B, Hkv, L, D] 0.72-0.75). Without heads_overlap, GQA 16-bit [B, L,
    //   Hkv, D] 0.87-0.88, p16 0.92-0.94: a group's rows keep it here.
    {.name = "intel",
     .near_k_into_l1 = false,
     .near_k_f32_also_bytes = 12288,
     .near_k_f32_also_interleaved = true,
     .f32_row_v_lead = 8,
     .v_far = 64,
     .v_into_l1 = false,
     .one_row_streams = true,
     .one_row_paired = true,
     .heads_key_groups_f32 = true,
     .heads_key_groups_16bit = true,
     .heads_key_groups_pairs = false,
     .heads_one_pass = true,
     .heads_f32_k_lead = 0,
     .heads_16bit_lead = 16,
     .heads_16bit_into_l1 = false,
     .heads_v_by_key = false,
     .rows_streams = true,
     .rows_overlap = true,
     .heads_overlap = true,
     .group_v_next_chunk = false,
     .group_k_ahead_bytes = 4096,
     .group_k_spread = true,
     .group_f32_near_spread = true,
     .group_k_into_l1 = false,
     .group_16bit_v_next_at_jumps = false,
     .group_f32_next_v_into_l1 = false,
     .group_by_key = false,
     .group_widened_by_key_small_pages = false},
};

std::atomic<const DecodePlan*> scoped{nullptr};

// Every field of DecodePlan but its name, each a flag or a number.
struct Field {
  const char* name;
  bool DecodePlan::*flag;
  int DecodePlan::*number;
};
constexpr Field kFields[] = {
    {"near_k_into_l1", &DecodePlan::near_k_into_l1, nullptr},
    {"near_k_f32_also_bytes", nullptr, &DecodePlan::near_k_f32_also_bytes},
    {"near_k_f32_also_interleaved", &DecodePlan::near_k_f32_also_interleaved, nullptr},
    {"f32_row_v_lead", nullptr, &DecodePlan::f32_row_v_lead},
    {"v_far", nullptr, &DecodePlan::v_far},
    {"v_into_l1", &DecodePlan::v_into_l1, nullptr},
    {"one_row_streams", &DecodePlan::one_row_streams, nullptr},
    {"one_row_paired", &DecodePlan::one_row_paired, nullptr},
    {"heads_key_groups_f32", &DecodePlan::heads_key_groups_f32, nullptr},
    {"heads_key_groups_16bit", &DecodePlan::heads_key_groups_16bit, nullptr},
    {"heads_key_groups_pairs", &DecodePlan::heads_key_groups_pairs, nullptr},
    {"heads_one_pass", &DecodePlan::heads_one_pass, nullptr},
    {"heads_f32_k_lead", nullptr, &DecodePlan::heads_f32_k_lead},
    {"heads_16bit_lead", nullptr, &DecodePlan::heads_16bit_lead},
    {"heads_16bit_into_l1", &DecodePlan::heads_16bit_into_l1, nullptr},
    {"heads_v_by_key", &DecodePlan::heads_v_by_key, nullptr},
    {"rows_streams", &DecodePlan::rows_streams, nullptr},
    {"rows_overlap", &DecodePlan::rows_overlap, nullptr},
    {"heads_overlap", &DecodePlan::heads_overlap, nullptr},
    {"group_v_next_chunk", &DecodePlan::group_v_next_chunk, nullptr},
    {"group_k_ahead_bytes", nullptr, &DecodePlan::group_k_ahead_bytes},
    {"group_k_spread", &DecodePlan::group_k_spread, nullptr},
    {"group_f32_near_spread", &DecodePlan::group_f32_near_spread, nullptr},
    {"group_k_into_l1", &DecodePlan::group_k_into_l1, nullptr},
    {"group_16bit_v_next_at_jumps", &DecodePlan::group_16bit_v_next_at_jumps, nullptr},
    {"group_f32_next_v_into_l1", &DecodePlan::group_f32_next_v_into_l1, nullptr},
    {"group_by_key", &DecodePlan::group_by_key, nullptr},
    {"group_widened_by_key_small_pages", &DecodePlan::group_widened_by_key_small_pages, nullptr},
};

std::string plan_names() {
  std::string names;
  for (const DecodePlan& plan : kPlans) names += std::string(names.empty() ? "" : ", ") + plan.name;
  return names;
}

}  // namespace

DecodePlan decode_plan_from_spec(const std::string& spec) {
  const std::size_t end = spec.find(',');
  const std::string base = spec.substr(0, end);
  const DecodePlan* found = nullptr;
  for (const DecodePlan& plan : kPlans) {
    if (base == plan.name) found = &plan;
  }
  if (found == nullptr) {
    throw InvalidArgument("decode_plan_from_spec: plan '" + base +
                          "' is not one of the machines' plans (spec=" + spec +
                          ", expected one of " + plan_names() + ")");
  }
  DecodePlan plan = *found;
  for (std::size_t at = end; at != std::string::npos;) {
    const std::size_t next = spec.find(',', at + 1);
    const std::string item = spec.substr(at + 1, next == std::string::npos ? next : next - at - 1);
    at = next;
    const std::size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    const Field* field = nullptr;
    for (const Field& f : kFields) {
      if (name == f.name) field = &f;
    }
    if (field == nullptr || eq == std::string::npos) {
      throw InvalidArgument("decode_plan_from_spec: item '" + item +
                            "' is not field=value with a field of DecodePlan (spec=" + spec +
                            ", expected fields of decode_plan.h, e.g. v_far=64)");
    }
    const std::string text = item.substr(eq + 1);
    char* parsed_end = nullptr;
    const long value = std::strtol(text.c_str(), &parsed_end, 10);
    const long most = field->flag != nullptr ? 1 : std::numeric_limits<int>::max();
    if (text.empty() || *parsed_end != '\0' || value < 0 || value > most) {
      throw InvalidArgument("decode_plan_from_spec: " + name + " is out of range (" + name + "=" +
                            text + ", expected an integer from 0 to " + std::to_string(most) + ")");
    }
    if (field->flag != nullptr) {
      plan.*(field->flag) = value != 0;
    } else {
      plan.*(field->number) = static_cast<int>(value);
    }
  }
  return plan;
}

std::vector<std::string> decode_plan_field_names() {
  std::vector<std::string> names;
  for (const Field& field : kFields) names.emplace_back(field.name);
  return names;
}

const DecodePlan& decode_plan_for(const std::string& vendor, int family) {
  if (vendor == "AuthenticAMD" && family >= 0x1A) return kPlans[1];
  if (vendor == "GenuineIntel") return kPlans[2];
  return kPlans[0];
}

const DecodePlan& decode_plan() {
  if (const DecodePlan* plan = scoped.load(std::memory_order_relaxed)) return *plan;
  static const DecodePlan* const machine = [] {
    const CpuInfo cpu = cpu_info();
    return &decode_plan_for(cpu.vendor, cpu.family);
  }();
  return *machine;
}

const DecodePlan* decode_plans(int* count) {
  *count = static_cast<int>(std::size(kPlans));
  return kPlans;
}

ScopedDecodePlan::ScopedDecodePlan(const DecodePlan& plan) : previous_(scoped.exchange(&plan)) {}
ScopedDecodePlan::~ScopedDecodePlan() { scoped.store(previous_); }

}  // namespace attncore::detail
