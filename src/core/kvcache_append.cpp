// forward_kvcache and forward_kvcache_into with new keys and values (attncore/kvcache.h):
// everything is validated first, then the new rows are rotated (when rotary tables are given)
// and written into the cache, the query is rotated into a copy, and the call attends with the
// lengths after the append.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attncore/backend.h"
#include "attncore/kvcache.h"
#include "core/api.h"
#include "core/convert.h"
#include "core/cpu_info.h"
#include "core/sequence.h"
#include "core/validate.h"
#include "core/validate_checks.h"

namespace attncore {

namespace {

using detail::Checker;
using detail::Params;

// Rotary tables: cos/sin [positions, half] f32, read as table[pos * stride0 + i * stride1].
struct Rotary {
  const TensorView* cos = nullptr;
  const TensorView* sin = nullptr;
  std::int64_t half = 0;  // rotary_dim / 2
  bool interleaved = false;
};

// Rotates the first 2 * half values of row x [D] to position `pos` in place (T: f32, or f64
// for f64 caches).
template <class T>
void rotate(const Rotary& r, std::int64_t pos, T* x) {
  for (std::int64_t i = 0; i < r.half; ++i) {
    const T c = detail::load_element<T>(r.cos->data, r.cos->dtype,
                                        pos * r.cos->stride_of(0) + i * r.cos->stride_of(1));
    const T s = detail::load_element<T>(r.sin->data, r.sin->dtype,
                                        pos * r.sin->stride_of(0) + i * r.sin->stride_of(1));
    const std::int64_t a = r.interleaved ? 2 * i : i, b = r.interleaved ? 2 * i + 1 : i + r.half;
    const T x1 = x[a], x2 = x[b];
    x[a] = x1 * c - x2 * s;
    x[b] = x2 * c + x1 * s;
  }
}

// A paged append writes slot s of sequence b at row s % page_size of page
// block_table[b][s / page_size]. Refused, as it would leave a sequence attending to a key it
// did not write: a page mapped twice within the slots a sequence uses (the append would
// overwrite its own keys), and two new rows landing on one pool slot (pages two sequences share
// at the slots both append). Runs after the capacity check (every slot has a table entry);
// entries that name no page of the pool are left to the attending call's check, which names
// them. The new rows' slots are sorted (time and memory in proportion to B * L_new, a decode's
// few rows costing next to nothing); more rows than the pool holds, as broadcast inputs make
// any number of them, are scanned instead, in a bit per pool slot.
void check_append_slots(const Checker& check, const Params& p, std::int64_t num_pages,
                        std::int64_t l_new) {
  const detail::SeqInfo& seq = p.seq;
  auto table_of = [&](std::int64_t b) { return seq.block_table + b * seq.block_table_stride; };
  for (std::int64_t b = 0; b < p.batch && l_new > 0; ++b) {
    const std::int32_t* table = table_of(b);
    const std::int64_t first = (seq.cache_leftpad != nullptr ? seq.cache_leftpad[b] : 0) /
                               seq.page_size;
    const std::int64_t last = (seq.cache_seqlens[b] + l_new - 1) / seq.page_size;
    std::vector<std::pair<std::int32_t, std::int64_t>> used;  // (page, logical page)
    for (std::int64_t i = first; i <= last; ++i) {
      if (table[i] >= 0 && table[i] < num_pages) used.emplace_back(table[i], i);
    }
    std::sort(used.begin(), used.end());
    for (std::size_t i = 1; i < used.size(); ++i) {
      if (used[i].first != used[i - 1].first) continue;
      check.fail("block_table maps one page twice in a sequence that appends (block_table[" +
                 std::to_string(b) + "][" + std::to_string(used[i - 1].second) + "]=block_table[" +
                 std::to_string(b) + "][" + std::to_string(used[i].second) +
                 "]=" + std::to_string(used[i].first) +
                 ", expected distinct pages); the append would overwrite the sequence's own keys");
    }
  }
  // The pool slot new row j of sequence b lands on (-1: a page the attending call refuses).
  auto slot_of = [&](std::int64_t b, std::int64_t j) -> std::int64_t {
    const std::int64_t s = seq.cache_seqlens[b] + j, page = table_of(b)[s / seq.page_size];
    return page < 0 || page >= num_pages ? -1 : page * seq.page_size + s % seq.page_size;
  };
  auto refuse = [&](std::int64_t slot, std::int64_t row0,
                    std::int64_t row1) {  // rows b * L_new + j
    const std::int64_t b0 = row0 / l_new, b1 = row1 / l_new;
    const std::int64_t s0 = seq.cache_seqlens[b0] + row0 % l_new;
    const std::int64_t s1 = seq.cache_seqlens[b1] + row1 % l_new;
    check.fail(
        "k_new writes one pool slot twice (slot " + std::to_string(s0) + " of sequence " +
        std::to_string(b0) + " and slot " + std::to_string(s1) + " of sequence " +
        std::to_string(b1) + " are both row " + std::to_string(s0 % seq.page_size) + " of page " +
        std::to_string(slot / seq.page_size) +
        ", expected distinct slots); map distinct pages where sequences append "
        "(a paged cache's assign copies a shared page first; appends write pages as mapped)");
  };
  const std::int64_t pool = num_pages * seq.page_size;         // (the cache's own rows: it fits)
  if (p.batch == 0 || l_new <= pool / p.batch) {               // B * L_new <= pool: sorted
    std::vector<std::pair<std::int64_t, std::int64_t>> slots;  // [B * L_new]: (pool slot, row)
    slots.reserve(static_cast<std::size_t>(p.batch * l_new));
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t j = 0; j < l_new; ++j) {
        const std::int64_t slot = slot_of(b, j);
        if (slot >= 0) slots.emplace_back(slot, b * l_new + j);
      }
    }
    std::sort(slots.begin(), slots.end());
    for (std::size_t i = 1; i < slots.size(); ++i) {
      if (slots[i].first == slots[i - 1].first)
        refuse(slots[i].first, slots[i - 1].second, slots[i].second);
    }
    return;
  }
  // More new rows than pool slots: some land on no page (the attending call names it) or two on
  // one slot, the first such pair found by a bit per slot.
  std::vector<bool> taken(static_cast<std::size_t>(pool));
  for (std::int64_t row = 0; row < p.batch * l_new; ++row) {
    const std::int64_t slot = slot_of(row / l_new, row % l_new);
    if (slot < 0) return;
    if (!taken[static_cast<std::size_t>(slot)]) {
      taken[static_cast<std::size_t>(slot)] = true;
      continue;
    }
    std::int64_t first = 0;  // the row that took it (found again: the error's path)
    while (slot_of(first / l_new, first % l_new) != slot) ++first;
    refuse(slot, first, row);
  }
}

// Checks k_new, v_new and the rotary tables against the validated cache call; returns the
// lengths after the append.
std::vector<std::int32_t> validate_append(const Checker& check, const Params& p,
                                          const TensorView& q, const TensorView& k_cache,
                                          const TensorView& v_cache, const KvCacheSeqs& seqs,
                                          const KvAppend& a, const Options& o, Rotary* rotary) {
  check.view(a.k_new, "k_new", 4, "[B, Hkv, L_new, D]");
  check.view(a.v_new, "v_new", 4, "[B, Hkv, L_new, Dv]");
  const std::int64_t l_new = a.k_new.size(2);
  const std::int64_t k_shape[4] = {p.batch, p.heads_kv, l_new, p.head_dim};
  const std::int64_t v_shape[4] = {p.batch, p.heads_kv, l_new, p.head_dim_v};
  // New rows in the cache's dtype, or in the query's when that differs (an f32 query over a
  // 16-bit cache), rounded to the cache's when written; k_new and v_new alike.
  if (a.k_new.dtype != p.kv_dtype && a.k_new.dtype != p.dtype) {
    check.fail("k_new has the wrong dtype (dtype=" + std::string(name_of(a.k_new.dtype)) +
               ", expected " + std::string(name_of(p.kv_dtype)) + " like k_cache" +
               (p.dtype != p.kv_dtype ? " or " + std::string(name_of(p.dtype)) + " like query"
                                      : std::string()) +
               ")");
  }
  check.dtype(a.v_new, "v_new", a.k_new.dtype, " like k_new");
  check.shape(a.k_new, "k_new", k_shape, "[B, Hkv, L_new, D]");
  check.shape(a.v_new, "v_new", v_shape, "[B, Hkv, L_new, Dv] like k_new");
  check.unit_last_stride(a.k_new, "k_new");
  check.unit_last_stride(a.v_new, "v_new");
  check.writable(k_cache, "k_cache");
  check.writable(v_cache, "v_cache");
  const detail::SeqInfo& seq = p.seq;
  const std::int64_t capacity = seq.lk;  // dense: slots per row; paged: pages per seq * page_size
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(p.batch));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    // (0 <= cache_seqlens[b] <= capacity, checked: the sum is formed only where it fits)
    if (l_new > capacity - seq.cache_seqlens[b]) {
      check.fail("k_new does not fit in the cache (cache_seqlens[" + std::to_string(b) + "]=" +
                 std::to_string(seq.cache_seqlens[b]) + " + L_new=" + std::to_string(l_new) +
                 ", expected <= capacity=" + std::to_string(capacity) + ")");
    }
    const std::int64_t end = seq.cache_seqlens[b] + l_new;
    if (end > INT32_MAX) {  // (a block table's pages may hold more slots than int32 counts)
      check.fail("k_new makes a sequence too long (cache_seqlens[" + std::to_string(b) +
                 "]=" + std::to_string(seq.cache_seqlens[b]) + " + L_new=" + std::to_string(l_new) +
                 ", expected <= 2147483647: lengths are int32)");
    }
    lengths[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(end);
  }
  if (seq.cache_batch != nullptr) {  // distinct rows: sorted (row, sequence) pairs, O(B log B)
    std::vector<std::pair<std::int64_t, std::int64_t>> rows(static_cast<std::size_t>(p.batch));
    for (std::int64_t b = 0; b < p.batch; ++b)
      rows[static_cast<std::size_t>(b)] = {seq.cache_batch[b], b};
    std::sort(rows.begin(), rows.end());
    for (std::size_t i = 1; i < rows.size(); ++i) {
      if (rows[i].first == rows[i - 1].first) {
        check.fail("cache_batch_idx repeats a row when appending (cache_batch_idx[" +
                   std::to_string(rows[i - 1].second) + "]=cache_batch_idx[" +
                   std::to_string(rows[i].second) + "]=" + std::to_string(rows[i].first) +
                   ", expected distinct rows)");
      }
    }
  }
  if (a.rotary_cos.has_value() != a.rotary_sin.has_value()) {
    check.fail("rotary_cos and rotary_sin go together (rotary_cos=" +
               std::string(a.rotary_cos ? "given" : "none") +
               ", rotary_sin=" + std::string(a.rotary_sin ? "given" : "none") +
               ", expected both or neither)");
  }
  if (a.rotary_cos.has_value()) {  // (each view whole before separate measures its bytes)
    check.view(*a.rotary_cos, "rotary_cos", 2, "[positions, rotary_dim / 2]");
    check.view(*a.rotary_sin, "rotary_sin", 2, "[positions, rotary_dim / 2]");
  }
  // The caches are written: neither may share a byte with the other (the values would
  // overwrite the keys) or with an array the call reads (an index array inside a cache would
  // change under the append, which then writes where it no longer checked).
  check.separate({{&k_cache, "k_cache"}, {&v_cache, "v_cache"}},
                 {{&q, "query"},
                  {&a.k_new, "k_new"},
                  {&a.v_new, "v_new"},
                  {a.rotary_cos ? &*a.rotary_cos : nullptr, "rotary_cos"},
                  {a.rotary_sin ? &*a.rotary_sin : nullptr, "rotary_sin"},
                  detail::alibi_view(o),
                  {&seqs.cache_seqlens, "cache_seqlens"},
                  {seqs.cache_batch_idx ? &*seqs.cache_batch_idx : nullptr, "cache_batch_idx"},
                  {seqs.cache_leftpad ? &*seqs.cache_leftpad : nullptr, "cache_leftpad"},
                  {seqs.block_table ? &*seqs.block_table : nullptr, "block_table"}});
  if (seq.paged()) check_append_slots(check, p, k_cache.size(0), l_new);
  if (!a.rotary_cos.has_value()) return lengths;
  const TensorView& cos = *a.rotary_cos;
  const TensorView& sin = *a.rotary_sin;
  check.dtype(cos, "rotary_cos", DType::f32, "");
  check.dtype(sin, "rotary_sin", DType::f32, "");
  check.shape(sin, "rotary_sin", cos.shape.data(), "like rotary_cos");
  const std::int64_t half = cos.size(1);
  if (half < 1 || half > p.head_dim / 2) {
    check.fail("rotary_cos has the wrong width (rotary_dim / 2=" + std::to_string(half) +
               ", expected 1 <= rotary_dim / 2 <= D / 2=" + std::to_string(p.head_dim / 2) +
               ": tables [positions, rotary_dim / 2] with an even rotary_dim <= D)");
  }
  // The largest position rotated: a new key's, or a query row's (base + rotated - 1, at most
  // INT64_MAX: a broadcast query's Lq may be any int64).
  const bool aligned = o.causal != Causal::none || o.window_left >= 0 || o.window_right >= 0;
  const std::int64_t rotated = std::max(l_new, aligned ? q.size(2) : std::int64_t{1});
  std::int64_t last = -1;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t start = seq.cache_leftpad != nullptr ? seq.cache_leftpad[b] : 0;
    const std::int64_t base = seq.cache_seqlens[b] - start;  // (0 <= base <= capacity)
    last = std::max(last, rotated > INT64_MAX - base ? INT64_MAX : base + rotated - 1);
  }
  if (last >= cos.size(0)) {
    check.fail("rotary_cos has too few positions (positions=" + std::to_string(cos.size(0)) +
               ", expected > " + std::to_string(last) + ", the largest position rotated)");
  }
  *rotary = Rotary{&cos, &sin, half, a.rotary_interleaved};
  return lengths;
}

// Writes the new rows into the cache and, with rotary, the rotated query into `rotated`;
// T: f32, or f64 for f64 inputs (no rounding beyond the cache's own dtype: f32 new rows for a
// 16-bit cache are rotated in f32, then rounded once, to nearest even, when stored).
template <class T>
void append_rows(const Params& p, const TensorView& q, const TensorView& k_cache,
                 const TensorView& v_cache, const KvAppend& append, const Rotary& rotary,
                 bool aligned, Tensor* rotated) {
  const detail::SeqInfo& seq = p.seq;
  const std::int64_t l_new = append.k_new.size(2), d = p.head_dim, dv = p.head_dim_v;
  // (No row to write: no buffer either, whatever D, as when B = 0.)
  if (append.k_new.numel() == 0 && (rotary.cos == nullptr || q.numel() == 0)) return;
  std::vector<T> row(static_cast<std::size_t>(std::max(d, dv)));  // [max(D, Dv)]
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t slot0 = seq.cache_seqlens[b];
    const std::int64_t base = slot0 - (seq.cache_leftpad != nullptr ? seq.cache_leftpad[b] : 0);
    // Sequence b's keys (its cache row, or its pages): new key j is its key base + j.
    const auto s = detail::resolve_sequence(p, detail::ForwardArgs{q, k_cache, v_cache, {}, {}}, b);
    for (std::int64_t h = 0; h < p.heads_kv; ++h) {
      for (std::int64_t j = 0; j < l_new; ++j) {
        detail::load_row(append.k_new.data, append.k_new.dtype,
                         detail::offset4(append.k_new, b, h, j, 0), d, row.data());
        if (rotary.cos != nullptr) rotate(rotary, base + j, row.data());
        detail::store_row(row.data(), d, s.a.k.data, k_cache.dtype,
                          detail::kv_offset(s.p, s.a.k, 0, h, base + j));
        detail::load_row(append.v_new.data, append.v_new.dtype,
                         detail::offset4(append.v_new, b, h, j, 0), dv, row.data());
        detail::store_row(row.data(), dv, s.a.v.data, v_cache.dtype,
                          detail::kv_offset(s.p, s.a.v, 0, h, base + j));
      }
    }
    if (rotary.cos == nullptr) continue;
    for (std::int64_t h = 0; h < p.heads_q; ++h) {  // the query, rotated into [B, Hq, Lq, D]
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        detail::load_row(q.data, q.dtype, detail::offset4(q, b, h, i, 0), d, row.data());
        rotate(rotary, aligned ? base + i : base, row.data());
        detail::store_row(row.data(), d, rotated->data(), q.dtype,
                          detail::offset4(rotated->view(), b, h, i, 0));
      }
    }
  }
}

// The rotated query's copy [B, Hq, Lq, D], refused first as the call's where the process may not
// hold it (a broadcast query costs its caller nothing).
Tensor rotated_query(const Params& p, DType dtype) {
  detail::refuse_past_memory_limit(
      static_cast<double>(p.batch) * static_cast<double>(p.heads_q) *
          static_cast<double>(p.seq.lq) * static_cast<double>(p.head_dim) *
          static_cast<double>(size_of(dtype)),
      "forward: the query rotated for the append, a copy,", "reduce the sizes");
  return Tensor(dtype, {p.batch, p.heads_q, p.seq.lq, p.head_dim});
}

// The validated append's call: its parameters, rotary tables and the sequences' lengths after
// the append (i32 [B], which `after` reads).
struct Appending {
  Params p;
  Rotary rotary;
  Tensor lengths;
  KvCacheSeqs after;
};

// With `out` (forward_kvcache_into), the outputs are checked here too: a named backend that
// cannot run the call is asked before the rotated query's copy (attend_after_append), after
// every check of the arguments (out's last stride was refused as Unsupported by flash for f64,
// InvalidArgument by the reference backend: found by the fuzzer).
Appending validate(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                   const KvCacheSeqs& seqs, const KvAppend& append, const Options& options,
                   Backend backend, const TensorView* out = nullptr,
                   const std::optional<TensorView>& lse = std::nullopt) {
  const Checker check("forward");
  const detail::ForwardArgs args{q, k_cache, v_cache, out != nullptr ? *out : TensorView{},
                                 lse.value_or(TensorView{})};
  Appending a{
      detail::validate_kvcache_forward(args, seqs, options, backend, out != nullptr), {}, {}, seqs};
  const std::vector<std::int32_t> lengths =
      validate_append(check, a.p, q, k_cache, v_cache, seqs, append, options, &a.rotary);
  a.lengths = Tensor(DType::i32, {a.p.batch});
  std::copy(lengths.begin(), lengths.end(), static_cast<std::int32_t*>(a.lengths.data()));
  a.after.cache_seqlens = a.lengths.view();
  return a;
}

// The validated append's call: attend(query, write) with the query it attends with (rotated into
// a copy when rotary tables are given) and `write`, which writes the new rows into the cache (and
// the rotated query), for the attending call to run after every check: a refused call writes
// nothing.
template <class Attend>
void attend_after_append(const Appending& a, const TensorView& q, const TensorView& k_cache,
                         const TensorView& v_cache, const KvAppend& append, const Options& options,
                         Backend backend, Attend&& attend) {
  const Params& p = a.p;
  const bool aligned =
      options.causal != Causal::none || options.window_left >= 0 || options.window_right >= 0;
  Tensor rotated;
  if (a.rotary.cos != nullptr) {
    // A named backend that cannot run the call refuses it before the copy is made.
    if (backend != Backend::automatic) {
      (void)explain_forward_kvcache(q, k_cache, v_cache, a.after, options, backend);
    }
    rotated = rotated_query(p, q.dtype);
  }
  attend(a.rotary.cos != nullptr ? rotated.view() : q, [&] {
    if (p.dtype == DType::f64) {
      append_rows<double>(p, q, k_cache, v_cache, append, a.rotary, aligned, &rotated);
    } else {
      append_rows<float>(p, q, k_cache, v_cache, append, a.rotary, aligned, &rotated);
    }
  });
}

}  // namespace

Explanation explain_forward_kvcache(const TensorView& q, const TensorView& k_cache,
                                    const TensorView& v_cache, const KvCacheSeqs& seqs,
                                    const KvAppend& append, const Options& options,
                                    Backend backend) {
  const Appending a = validate(q, k_cache, v_cache, seqs, append, options, backend);
  return explain_forward_kvcache(q, k_cache, v_cache, a.after, options, backend);
}

ForwardResult forward_kvcache(const TensorView& q, const TensorView& k_cache,
                              const TensorView& v_cache, const KvCacheSeqs& seqs,
                              const KvAppend& append, const Options& options, Backend backend) {
  const Appending a = validate(q, k_cache, v_cache, seqs, append, options, backend);
  ForwardResult r;
  attend_after_append(a, q, k_cache, v_cache, append, options, backend,
                      [&](const TensorView& query, const std::function<void()>& write) {
                        r = detail::forward_kvcache_with(query, k_cache, v_cache, a.after, options,
                                                         backend, write);
                      });
  return r;
}

void forward_kvcache_into(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                          const KvCacheSeqs& seqs, const KvAppend& append, const TensorView& out,
                          const std::optional<TensorView>& lse, const Options& options,
                          Backend backend) {
  const Appending a = validate(q, k_cache, v_cache, seqs, append, options, backend, &out, lse);
  attend_after_append(
      a, q, k_cache, v_cache, append, options, backend,
      [&](const TensorView& query, const std::function<void()>& write) {
        detail::forward_kvcache_into_with(
            query, k_cache, v_cache, a.after, out, lse, options, backend, [&] {
              // The outputs (checked against the attending call's arrays) share no byte
              // with the arrays only the append reads either.
              Checker("forward").separate(
                  {{&out, "out"}, {lse ? &*lse : nullptr, "lse"}},
                  {{&q, "query"},
                   {&append.k_new, "k_new"},
                   {&append.v_new, "v_new"},
                   {append.rotary_cos ? &*append.rotary_cos : nullptr, "rotary_cos"},
                   {append.rotary_sin ? &*append.rotary_sin : nullptr, "rotary_sin"},
                   {&seqs.cache_seqlens, "cache_seqlens"}});
              write();
            });
      });
}

}  // namespace attncore
