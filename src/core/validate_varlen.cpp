// Input validation of variable-length calls (attncore/varlen.h): the packed views, the int32
// sequence arrays and their values, then the options as for dense calls. Messages follow
// docs/design.md section 4.
#include <climits>
#include <cstdint>
#include <string>

#include "attncore/error.h"
#include "core/validate.h"
#include "core/validate_checks.h"

namespace attncore::detail {

namespace {

// A packed [rows, H, D] view in the rank-4 form [1, H, rows, D] (batch stride 0).
TensorView as_rank4(const TensorView& t) {
  TensorView r = t;
  r.rank = 4;
  r.shape = {1, t.shape[1], t.shape[0], t.shape[2]};
  r.stride = {0, t.stride[1], t.stride[0], t.stride[2]};
  return r;
}

// An LSE [H, rows] in the rank-3 form [1, H, rows].
TensorView lse_as_rank3(const TensorView& t) {
  TensorView r = t;
  r.rank = 3;
  r.shape = {1, t.shape[0], t.shape[1], 0};
  r.stride = {0, t.stride[0], t.stride[1], 0};
  return r;
}

// An int32 [n] index array, contiguous: the library reads it in place.
void check_index_array(const Checker& check, const TensorView& t, const char* name,
                       std::int64_t n, const char* layout) {
  check.structure(t, name);
  if (t.dtype != DType::i32) {
    check.fail(std::string(name) + " has the wrong dtype (dtype=" + std::string(name_of(t.dtype)) +
               ", expected i32)");
  }
  if (t.rank != 1) {
    check.fail(std::string(name) + " has the wrong rank (rank=" + std::to_string(t.rank) +
               ", expected 1: " + layout + ")");
  }
  if (n >= 0 && t.size(0) != n) {
    check.fail(std::string(name) + " has shape " + t.shape_string() + ", expected [" +
               std::to_string(n) + "] (" + layout + ")");
  }
  if (t.size(0) > 1 && t.stride_of(0) != 1) {
    check.fail(std::string(name) + " is not contiguous (stride[0]=" +
               std::to_string(t.stride_of(0)) + ", expected 1); pass a contiguous copy");
  }
}

// cu_seqlens: [B + 1] offsets from 0, non-decreasing, ending within the buffer's rows.
// Returns the longest sequence.
std::int64_t check_offsets(const Checker& check, const std::int32_t* cu, std::int64_t batch,
                           const char* name, std::int64_t rows, const char* buffer) {
  if (cu[0] != 0) {
    check.fail(std::string(name) + " does not start at 0 (" + name + "[0]=" +
               std::to_string(cu[0]) + ", expected 0)");
  }
  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      check.fail(std::string(name) + " is decreasing (" + name + "[" + std::to_string(b + 1) +
                 "]=" + std::to_string(cu[b + 1]) + " < " + name + "[" + std::to_string(b) +
                 "]=" + std::to_string(cu[b]) + ", expected non-decreasing offsets)");
    }
    longest = std::max<std::int64_t>(longest, std::int64_t{cu[b + 1]} - cu[b]);
  }
  if (cu[batch] > rows) {
    check.fail(std::string(name) + " ends past the rows of " + buffer + " (" + name + "[" +
               std::to_string(batch) + "]=" + std::to_string(cu[batch]) + ", expected <= " +
               std::to_string(rows) + ")");
  }
  return longest;
}

void check_max(const Checker& check, std::int64_t max, std::int64_t longest, const char* name) {
  if (max > INT32_MAX) {  // lengths are int32 offsets
    check.fail(std::string(name) + " is too large (" + name + "=" + std::to_string(max) +
               ", expected <= 2147483647)");
  }
  if (max < longest) {
    check.fail(std::string(name) + " is smaller than a sequence (" + name + "=" +
               std::to_string(max) + ", expected >= the longest sequence's " +
               std::to_string(longest) + ")");
  }
}

// The checks of q, k, v, the sequences and the options; q, k, v are turned into rank-4 form
// (page pools into a paged cache's).
Params resolve_varlen(const Checker& check, TensorView& q, TensorView& k, TensorView& v,
                      const VarlenSeqs& s, const Options& o, Backend backend) {
  check.backend(backend);
  const bool paged = s.block_table.has_value();
  const char* const k_layout = paged ? "[num_pages, page_size, Hkv, D]" : "[total_k, Hkv, D]";
  check.view(q, "query", 3, "[total_q, Hq, D]");
  check.view(k, "key", paged ? 4 : 3, k_layout);
  check.view(v, "value", paged ? 4 : 3,
             paged ? "[num_pages, page_size, Hkv, Dv]" : "[total_k, Hkv, Dv]");
  Params p;
  p.dtype = q.dtype;
  if (paged) {
    p.kv_dtype = cache_dtype(check, q, k, v, "key", "value");
    check.unit_last_stride(q, "query");
    check.unit_last_stride(k, "key");
    check.unit_last_stride(v, "value");
  } else {
    check.inputs(q, k, v);
    p.kv_dtype = q.dtype;
  }
  const int heads_dim = k.rank - 2;  // of k and v
  p.heads_q = q.size(1);
  p.head_dim = q.size(2);
  p.heads_kv = k.size(heads_dim);
  p.head_dim_v = v.size(heads_dim + 1);
  check.dims(p);
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0 || k.size(heads_dim + 1) != p.head_dim) {
    check.fail("key has shape " + k.shape_string() + ", expected " +
               (paged ? "[num_pages, page_size, Hkv, " : "[total_k, Hkv, ") +
               std::to_string(p.head_dim) + "] with Hq % Hkv == 0 (Hq=" +
               std::to_string(p.heads_q) + ", Hkv=" + std::to_string(p.heads_kv) + ")");
  }
  check.group(p, o);
  if (paged) {
    const std::int64_t v_expected[4] = {k.size(0), k.size(1), p.heads_kv, p.head_dim_v};
    check.shape(v, "value", v_expected, "[num_pages, page_size, Hkv, Dv] like key");
  } else {
    const std::int64_t v_expected[3] = {k.size(0), p.heads_kv, p.head_dim_v};
    check.shape(v, "value", v_expected, "[total_k, Hkv, Dv] like key");
  }

  // The sequences.
  check.structure(s.cu_seqlens_q, "cu_seqlens_q");
  if (s.cu_seqlens_q.rank != 1 || s.cu_seqlens_q.size(0) < 1) {
    check_index_array(check, s.cu_seqlens_q, "cu_seqlens_q", 1, "[B + 1] with B >= 0");
  }
  check_index_array(check, s.cu_seqlens_q, "cu_seqlens_q", -1, "[B + 1]");
  p.batch = s.cu_seqlens_q.size(0) - 1;
  check_index_array(check, s.cu_seqlens_k, "cu_seqlens_k", p.batch + 1,
                    "[B + 1] like cu_seqlens_q");
  SeqInfo& seq = p.seq;
  seq.cu_q = static_cast<const std::int32_t*>(s.cu_seqlens_q.data);
  seq.cu_k = static_cast<const std::int32_t*>(s.cu_seqlens_k.data);
  seq.rows_q = q.size(0);
  seq.rows_k = paged ? 0 : k.size(0);  // (keys over pages: in no buffer of rows)
  seq.longest_q = check_offsets(check, seq.cu_q, p.batch, "cu_seqlens_q", seq.rows_q, "query");
  seq.longest_k = check_offsets(check, seq.cu_k, p.batch, "cu_seqlens_k",
                                paged ? INT64_MAX : seq.rows_k, "key");
  if (s.seqused_k.has_value()) {
    check_index_array(check, *s.seqused_k, "seqused_k", p.batch, "[B]");
    const auto* used = static_cast<const std::int32_t*>(s.seqused_k->data);
    seq.longest_k = 0;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t room = std::int64_t{seq.cu_k[b + 1]} - seq.cu_k[b];
      if (used[b] < 0 || used[b] > room) {
        check.fail("seqused_k is out of range (seqused_k[" + std::to_string(b) +
                   "]=" + std::to_string(used[b]) + ", expected 0 <= seqused_k[b] <= " +
                   std::to_string(room) + ", the keys of sequence " + std::to_string(b) + ")");
      }
      seq.longest_k = std::max<std::int64_t>(seq.longest_k, used[b]);
    }
    seq.used_k = used;
  }
  if (paged) {  // every key of every sequence in a page of the pool
    const std::int64_t page_size = k.size(1);
    block_table_of(check, *s.block_table, p.batch, page_size, "key", k.shape_string(),
                   "[num_pages, page_size, Hkv, D]", seq);
    const std::int64_t capacity = s.block_table->size(1) * page_size;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t keys = seq.at(b).lk;
      if (keys > capacity) {
        const std::string bs = std::to_string(b), next = std::to_string(b + 1);
        check.fail(std::string(s.seqused_k ? "seqused_k" : "cu_seqlens_k") + " gives sequence " +
                   bs + " more keys than its pages hold (" +
                   (s.seqused_k ? "seqused_k[" + bs + "]="
                                : "cu_seqlens_k[" + next + "] - cu_seqlens_k[" + bs + "]=") +
                   std::to_string(keys) +
                   ", expected <= max_pages_per_seq * page_size=" + std::to_string(capacity) + ")");
      }
      check_pages(check, seq, b, 0, keys, k.size(0), "pool");
    }
  }
  check_max(check, s.max_seqlen_q, seq.longest_q, "max_seqlen_q");
  check_max(check, s.max_seqlen_k, seq.longest_k, "max_seqlen_k");
  seq.lq = s.max_seqlen_q;
  seq.lk = s.max_seqlen_k;
  p.dropout.rows = seq.lq;
  p.dropout.cols = seq.lk;
  // Dropout addresses B * Hq * max_seqlen_q * max_seqlen_k elements: they must fit in 2^63.
  const double elements = static_cast<double>(p.batch) * static_cast<double>(p.heads_q) *
                          static_cast<double>(seq.lq) * static_cast<double>(seq.lk);
  if (o.dropout_p > 0.0 && !paged && elements >= 0x1p63) {  // (over pools: Unsupported below)
    check.fail("dropout addresses too many elements (B * Hq * max_seqlen_q * max_seqlen_k=" +
               fmt_double(elements) + ", expected < 2^63)");
  }

  // (Page pools [num_pages, page_size, H, D] as a paged cache's views, [num_pages, H, page_size,
  // D].)
  q = as_rank4(q);
  k = paged ? k.transposed(1, 2) : as_rank4(k);
  v = paged ? v.transposed(1, 2) : as_rank4(v);
  resolve_variant(check, o, p);  // (a dropout_p out of range first, as invalid)
  if (paged && o.dropout_p != 0.0) {
    check.unsupported("dropout is not supported over page pools (dropout_p=" +
                      fmt_double(o.dropout_p) + ", expected 0 with block_table)");
  }
  return p;
}

void check_packed(const Checker& check, TensorView& t, const char* name, DType dtype,
                  std::int64_t rows, std::int64_t heads, std::int64_t dim, const char* layout) {
  check.view(t, name, 3, layout);
  check.dtype(t, name, dtype, "");
  const std::int64_t expected[3] = {rows, heads, dim};
  check.shape(t, name, expected, layout);
  check.unit_last_stride(t, name);
  t = as_rank4(t);
}

void check_packed_lse(const Checker& check, TensorView& t, const Params& p, const char* name) {
  check.view(t, name, 2, "[Hq, total_q]");
  check.dtype(t, name, p.dtype == DType::f64 ? DType::f64 : DType::f32,
              " (f64 only for f64 inputs)");
  const std::int64_t expected[2] = {p.heads_q, p.seq.rows_q};
  check.shape(t, name, expected, "[Hq, total_q]");
  t = lse_as_rank3(t);
}

}  // namespace

Params validate_varlen_forward(ForwardArgs& a, const VarlenSeqs& seqs, const Options& options,
                               Backend backend, bool check_outputs) {
  const Checker check("forward");
  Params p = resolve_varlen(check, a.q, a.k, a.v, seqs, options, backend);
  p.compute_dbias = false;
  if (!check_outputs) {
    check.count("out would have too many elements", "total_q * Hq * Dv",
                {p.seq.rows_q, p.heads_q, p.head_dim_v});
    return p;
  }
  check_packed(check, a.out, "out", p.dtype, p.seq.rows_q, p.heads_q, p.head_dim_v,
               "[total_q, Hq, Dv]");
  check.writable(a.out, "out");
  if (a.lse.data != nullptr || a.lse.rank != 0) {
    check_packed_lse(check, a.lse, p, "lse");
    check.writable(a.lse, "lse");
  }
  check.separate({{&a.out, "out"}, {&a.lse, "lse"}},
                 {{&a.q, "query"},
                  {&a.k, "key"},
                  {&a.v, "value"},
                  alibi_view(options),
                  {&seqs.cu_seqlens_q, "cu_seqlens_q"},
                  {&seqs.cu_seqlens_k, "cu_seqlens_k"},
                  {seqs.seqused_k ? &*seqs.seqused_k : nullptr, "seqused_k"},
                  {seqs.block_table ? &*seqs.block_table : nullptr, "block_table"}});
  return p;
}

Params validate_varlen_backward(BackwardArgs& a, const VarlenSeqs& seqs, const Options& options,
                                Backend backend, bool check_outputs) {
  const Checker check("backward");
  if (seqs.block_table.has_value()) {
    check.unsupported(
        "block_table is not supported (block_table=given, expected none); attention over page "
        "pools is forward only");
  }
  Params p = resolve_varlen(check, a.q, a.k, a.v, seqs, options, backend);
  check_packed(check, a.dout, "dout", p.dtype, p.seq.rows_q, p.heads_q, p.head_dim_v,
               "[total_q, Hq, Dv]");
  check_packed(check, a.out, "out", p.dtype, p.seq.rows_q, p.heads_q, p.head_dim_v,
               "[total_q, Hq, Dv]");
  check_packed_lse(check, a.lse, p, "lse");
  if (!check_outputs) return p;
  check_packed(check, a.dq, "dq", p.dtype, p.seq.rows_q, p.heads_q, p.head_dim,
               "[total_q, Hq, D] like query");
  check_packed(check, a.dk, "dk", p.dtype, p.seq.rows_k, p.heads_kv, p.head_dim,
               "[total_k, Hkv, D] like key");
  check_packed(check, a.dv, "dv", p.dtype, p.seq.rows_k, p.heads_kv, p.head_dim_v,
               "[total_k, Hkv, Dv] like value");
  check.writable(a.dq, "dq");
  check.writable(a.dk, "dk");
  check.writable(a.dv, "dv");
  check.separate({{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}},
                 {{&a.dout, "dout"},
                  {&a.q, "query"},
                  {&a.k, "key"},
                  {&a.v, "value"},
                  {&a.out, "out"},
                  {&a.lse, "lse"},
                  alibi_view(options),
                  {&seqs.cu_seqlens_q, "cu_seqlens_q"},
                  {&seqs.cu_seqlens_k, "cu_seqlens_k"},
                  {seqs.seqused_k ? &*seqs.seqused_k : nullptr, "seqused_k"}});
  return p;
}

}  // namespace attncore::detail
