// The inference cases: variable-length batches (forward and backward; over page pools,
// forward), KV caches (dense rows or pages, with and without an append) and
// merge_attention_states.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fuzz_cases.h"
#include "testing/problem.h"
#include "testing/tensors.h"

namespace attncore::fuzz {

void fuzz_varlen(Reader& r) {
  Dims s = dims(r);
  std::vector<std::int64_t> cu_q{0}, cu_k{0}, used;
  double pairs = 0;
  std::int64_t max_q = 0, max_k = 0;
  for (std::int64_t b = 0; b < s.b; ++b) {
    const std::int64_t lq = length(r) / 2, lk = length(r) / 2;
    const std::int64_t u = r.chance(60) ? r.range(0, lk) : lk;
    cu_q.push_back(cu_q.back() + lq);
    cu_k.push_back(cu_k.back() + lk);
    used.push_back(u);
    pairs += double(lq * lk);
    max_q = std::max(max_q, lq), max_k = std::max(max_k, lk);
  }
  if (flops(s, pairs) > kMaxFlops) return;
  if (r.chance(6)) std::swap(cu_q[1], cu_q[s.b]);  // decreasing offsets
  const std::int64_t total_q = cu_q.back() + r.range(0, 2), total_k = cu_k.back() + r.range(0, 2);
  Array acu_q = index_array(cu_q), acu_k = index_array(cu_k), aused = index_array(used);
  VarlenSeqs seqs{acu_q.view,
                  acu_k.view,
                  std::nullopt,
                  max_q + r.range(0, 2) - (r.chance(6) ? 1 : 0),
                  max_k + r.range(0, 2),
                  std::nullopt};
  if (r.chance(100)) seqs.seqused_k = aused.view;
  // Now and then the keys in page pools [num_pages, page_size, Hkv, D] named by a block table
  // (forward only; now and then -1 or a page past the pool for a key in use: refused).
  const bool paged = r.chance(64);
  std::int64_t page_size = 1, per_seq = 0, num_pages = 0;
  std::vector<std::int64_t> table;
  if (paged) {
    static constexpr std::int64_t kPageSizes[] = {1, 3, 16};
    page_size = kPageSizes[r.byte() % std::size(kPageSizes)];
    per_seq = std::max<std::int64_t>(
        (max_k + page_size - 1) / page_size + r.range(0, 1) - (r.chance(4) ? 1 : 0), 0);
    num_pages = r.range(1, s.b * per_seq + 2);
    for (std::int64_t i = 0; i < s.b * per_seq; ++i)
      table.push_back(r.chance(3) ? (r.chance(128) ? -1 : num_pages) : r.range(0, num_pages - 1));
  }
  Array atable = index_array(table);
  if (paged) {
    atable.view = TensorView::strided(atable.view.data, DType::i32, {s.b, per_seq},
                                      {std::max<std::int64_t>(per_seq, 1), 1});
    seqs.block_table = atable.view;
  }
  const DType dtype = value_dtype(r);
  const DType kv_dtype = paged && dtype == DType::f32 && r.chance(64) ? DType::bf16 : dtype;
  const std::vector<std::int64_t> k_shape =
      paged ? std::vector<std::int64_t>{num_pages, page_size, s.hkv, s.d}
            : std::vector<std::int64_t>{total_k, s.hkv, s.d};
  std::vector<std::int64_t> v_shape = k_shape;
  v_shape.back() = s.dv;
  Array q = make_input(dtype, {total_q, s.hq, s.d}, layout(r), r, 1, 1.0);
  Array k = make_input(kv_dtype, k_shape, layout(r), r, 2, 1.0);
  Array v = make_input(kv_dtype, v_shape, layout(r), r, 3, 1.0);
  Decoded o;
  decode_options(r, s, false, o);
  Array out = make_array(dtype, {total_q, s.hq, s.dv}, output_layout(r), 0xa5);
  Array lse = make_array(dtype == DType::f64 ? DType::f64 : DType::f32, {s.hq, total_q},
                         output_layout(r), 0xa5);
  std::vector<Array*> inputs{&q, &k, &v, &acu_q, &acu_k, &aused, &atable};
  if (o.alibi) inputs.push_back(&*o.alibi);
  if (o.mask) inputs.push_back(&*o.mask);
  CallSpec fwd{
      {&out, &lse}, inputs, {}, {out.view, lse.view}, o.options.cancel != nullptr, [&](Backend b) {
        forward_varlen_into(q.view, k.view, v.view, seqs, out.view, lse.view, o.options, b);
      }};
  const std::vector<Run> runs = run_all_backends(fwd);
  check_forward(runs, dtype, value_bound(v, o.options), s.hq, s.dv, true);
  if (paged || runs.front().outcome != Outcome::ok || r.chance(128)) return;

  // Backward from the reference's out and lse.
  Array ref_out = make_array(dtype, {total_q, s.hq, s.dv}, Layout::contiguous);
  Array ref_lse = make_array(lse.view.dtype, {s.hq, total_q}, Layout::contiguous);
  test::write_view(ref_out.view, runs.front().results[0]);
  test::write_view(ref_lse.view, runs.front().results[1]);
  Array dout = make_input(dtype, {total_q, s.hq, s.dv}, layout(r), r, 5, 1.0);
  Array dq = make_array(dtype, {total_q, s.hq, s.d}, output_layout(r), 0xa5);
  Array dk = make_array(dtype, {total_k, s.hkv, s.d}, output_layout(r), 0xa5);
  Array dv = make_array(dtype, {total_k, s.hkv, s.dv}, output_layout(r), 0xa5);
  std::vector<Array*> bwd_inputs = inputs;
  bwd_inputs.insert(bwd_inputs.end(), {&ref_out, &ref_lse, &dout});
  CallSpec bwd{{&dq, &dk, &dv}, bwd_inputs, {}, {dq.view, dk.view, dv.view}, false, [&](Backend b) {
                 backward_varlen_into(dout.view, q.view, k.view, v.view, ref_out.view, ref_lse.view,
                                      seqs, dq.view, dk.view, dv.view, o.options, b);
               }};
  check_gradients(run_all_backends(bwd),
                  {dtype, s.d, s.dv, s.hq / std::max<std::int64_t>(s.hkv, 1) * max_q, &o.options,
                   &q, &k, &v, &dout, nullptr});  // a key's gradient sums its group's rows
}

namespace {

// The part of a KV-cache call after its cache and sequence arrays (`inputs`): the new rows
// (append: L_new of them), rotary tables (up to max_positions positions), options, outputs;
// runs the call on every backend and checks it.
// The query's dtype over a cache of `dtype`: mostly the same; an f32 query over a 16-bit
// cache now and then, and now and then a mix no call takes (a 16-bit query over the other
// 16-bit dtype, or over an f32 cache).
DType query_dtype(Reader& r, DType dtype) {
  if (dtype == DType::bf16 || dtype == DType::f16) {
    if (r.chance(3)) return dtype == DType::bf16 ? DType::f16 : DType::bf16;
    return r.chance(80) ? DType::f32 : dtype;
  }
  return dtype == DType::f32 && r.chance(3) ? DType::bf16 : dtype;
}

void run_cache_call(Reader& r, const Dims& s, DType dtype, bool append, std::int64_t l_new,
                    std::int64_t max_positions, const KvCacheSeqs& seqs, Array& q, Array& k_cache,
                    Array& v_cache, std::vector<Array*> inputs) {
  // New rows in the cache's dtype, or (over a 16-bit cache) now and then in the query's.
  const DType out_dtype = q.view.dtype;
  const DType new_dtype = out_dtype != dtype && r.chance(100) ? out_dtype : dtype;
  Array k_new = make_input(new_dtype, {s.b, s.hkv, l_new, s.d}, layout(r), r, 4, 1.0);
  Array v_new = make_input(new_dtype, {s.b, s.hkv, l_new, s.dv}, layout(r), r, 5, 1.0);
  KvAppend add{k_new.view, v_new.view, std::nullopt, std::nullopt, r.chance(128)};
  std::optional<Array> cos, sin;
  if (append && r.chance(80)) {
    const std::int64_t half = r.range(0, s.d / 2), positions = r.range(0, max_positions);
    cos = make_input(DType::f32, {positions, half}, Layout::contiguous, r, 6, 0.25);
    sin = make_input(DType::f32, {positions, half}, Layout::contiguous, r, 7, 0.25);
    add.rotary_cos = cos->view, add.rotary_sin = sin->view;
  }
  Decoded o;
  decode_options(r, s, false, o);
  // An append in the allocating form returns new tensors, copied here: into contiguous arrays;
  // in the into form, as without one.
  const bool allocating = append && r.chance(128);
  Array out = make_array(out_dtype, {s.b, s.hq, s.lq, s.dv},
                         allocating ? Layout::contiguous : output_layout(r), 0xa5);
  Array lse = make_array(out_dtype == DType::f64 ? DType::f64 : DType::f32, {s.b, s.hq, s.lq},
                         allocating ? Layout::contiguous : output_layout(r), 0xa5);
  inputs.insert(inputs.end(), {&q, &k_cache, &v_cache, &k_new, &v_new});
  for (auto* a : {&cos, &sin, &o.alibi, &o.mask})
    if (*a) inputs.push_back(&**a);
  describe(append ? "kvcache append" : "kvcache", s, dtype, o.options,
           {&q, &k_cache, &v_cache, &k_new, &v_new});
  std::vector<Array*> written;
  if (append) written = {&k_cache, &v_cache};
  CallSpec call{{&out, &lse},
                inputs,
                written,
                {out.view, lse.view},
                o.options.cancel != nullptr,
                [&](Backend b) {
                  if (!append) {
                    forward_kvcache_into(q.view, k_cache.view, v_cache.view, seqs, out.view,
                                         lse.view, o.options, b);
                    return;
                  }
                  if (!allocating) {
                    forward_kvcache_into(q.view, k_cache.view, v_cache.view, seqs, add, out.view,
                                         lse.view, o.options, b);
                    return;
                  }
                  const ForwardResult res =
                      forward_kvcache(q.view, k_cache.view, v_cache.view, seqs, add, o.options, b);
                  test::write_view(out.view, test::read_view(res.out));
                  test::write_view(lse.view, test::read_view(res.lse));
                }};
  const std::vector<Run> runs = run_all_backends(call);
  check_forward(runs, out_dtype, value_bound(v_cache, o.options), s.hq, s.dv, false);
  for (const Run& run : runs) {  // every backend appends the same bytes
    if (run.outcome == Outcome::ok && runs.front().outcome == Outcome::ok &&
        run.written != runs.front().written)
      fail(std::string(name_of(run.backend)) + ": appended other bytes than the reference");
  }
}

// Whether no two elements of a view share memory.
bool distinct_elements(const TensorView& t) {
  std::vector<std::int64_t> offsets{0};
  for (int d = 0; d < t.rank; ++d) {
    std::vector<std::int64_t> next;
    for (std::int64_t at : offsets)
      for (std::int64_t i = 0; i < t.shape[d]; ++i) next.push_back(at + i * t.stride[d]);
    offsets.swap(next);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) == offsets.end();
}

}  // namespace

void fuzz_kvcache(Reader& r) {
  Dims s = dims(r);
  s.lq = r.chance(160) ? 1 : r.range(0, 8);
  const std::int64_t rows = r.range(1, 3), capacity = r.range(0, 40);
  const bool append = r.chance(128);
  const std::int64_t l_new = append ? r.range(0, 6) : 0;
  std::vector<std::int64_t> lens, idx, pad;
  for (std::int64_t b = 0; b < s.b; ++b) {
    lens.push_back(r.range(0, capacity));
    idx.push_back(r.range(0, rows - 1));
    pad.push_back(r.range(0, lens.back()));
  }
  if (r.chance(4)) lens[0] = capacity + 1;
  if (flops(s, double(s.b * s.lq * (capacity + l_new))) > kMaxFlops) return;
  Array alens = index_array(lens), aidx = index_array(idx), apad = index_array(pad);
  KvCacheSeqs seqs;
  seqs.cache_seqlens = alens.view;
  if (r.chance(80) || rows < s.b) seqs.cache_batch_idx = aidx.view;
  if (r.chance(60)) seqs.cache_leftpad = apad.view;
  const DType dtype = value_dtype(r);
  Array q = make_input(query_dtype(r, dtype), {s.b, s.hq, s.lq, s.d}, layout(r), r, 1, 1.0);
  Array k_cache = make_input(dtype, {rows, s.hkv, capacity, s.d}, layout(r), r, 2, 1.0);
  Array v_cache = make_input(dtype, {rows, s.hkv, capacity, s.dv}, layout(r), r, 3, 1.0);
  run_cache_call(r, s, dtype, append, l_new, capacity + 8, seqs, q, k_cache, v_cache,
                 {&alens, &aidx, &apad});
}

// A paged cache: a pool of pages [num_pages, Hkv, page_size, D] (also the flash layout
// [num_pages, page_size, Hkv, D] transposed), a block table [B, pages per sequence] naming pool
// pages (shared between sequences now and then; now and then -1 or past the pool inside a
// sequence's slots, or cache_batch_idx given: refused), slots no sequence uses poisoned with NaN
// and inf now and then (they must change nothing: docs/design.md section 1.11).
void fuzz_paged(Reader& r) {
  Dims s = dims(r);
  s.lq = r.chance(160) ? 1 : r.range(0, 8);
  static constexpr std::int64_t kPageSizes[] = {1, 2, 3, 5, 16};
  const std::int64_t page_size = kPageSizes[r.byte() % std::size(kPageSizes)];
  const std::int64_t per_seq = r.range(0, 40 / page_size + 1), capacity = per_seq * page_size;
  const std::int64_t num_pages = r.range(1, s.b * per_seq + 2);
  const bool append = r.chance(128);
  const std::int64_t l_new = append ? r.range(0, 6) : 0;
  std::vector<std::int64_t> lens, pad, table, batch_idx;
  for (std::int64_t b = 0; b < s.b; ++b) {
    lens.push_back(r.range(0, capacity));
    pad.push_back(r.range(0, lens.back()));
    batch_idx.push_back(0);
    const std::int64_t used = (std::min(lens.back() + l_new, capacity) + page_size - 1) / page_size;
    for (std::int64_t i = 0; i < per_seq; ++i) {
      std::int64_t page = i < used || r.chance(60) ? r.range(0, num_pages - 1) : -1;
      if (r.chance(3)) page = r.chance(128) ? -1 : num_pages;
      table.push_back(page);
    }
  }
  if (r.chance(4)) lens[0] = capacity + 1;
  if (flops(s, double(s.b * s.lq * (capacity + l_new))) > kMaxFlops) return;
  Array alens = index_array(lens), apad = index_array(pad), aidx = index_array(batch_idx);
  Array atable = index_array(table);
  atable.view = TensorView::strided(atable.view.data, DType::i32, {s.b, per_seq}, {per_seq, 1});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = alens.view;
  seqs.block_table = atable.view;
  if (r.chance(60)) seqs.cache_leftpad = apad.view;
  if (r.chance(3)) seqs.cache_batch_idx = aidx.view;
  const DType dtype = value_dtype(r);
  Array q = make_input(query_dtype(r, dtype), {s.b, s.hq, s.lq, s.d}, layout(r), r, 1, 1.0);
  Array k_cache = make_input(dtype, {num_pages, s.hkv, page_size, s.d}, layout(r), r, 2, 1.0);
  Array v_cache = make_input(dtype, {num_pages, s.hkv, page_size, s.dv}, layout(r), r, 3, 1.0);
  if (r.chance(64)) {  // poison the slots no sequence reads (after its append)
    std::vector<bool> read(static_cast<std::size_t>(num_pages * page_size), false);
    for (std::int64_t b = 0; b < s.b; ++b) {
      const std::int64_t start = seqs.cache_leftpad ? pad[b] : 0;
      for (std::int64_t slot = start; slot < std::min(lens[b] + l_new, capacity); ++slot) {
        const std::int64_t page = table[b * per_seq + slot / page_size];
        if (page >= 0 && page < num_pages) read[page * page_size + slot % page_size] = true;
      }
    }
    for (Array* cache : {&k_cache, &v_cache}) {
      if (!distinct_elements(cache->view)) continue;  // (poison would reach read slots too)
      std::vector<double> x = test::read_view(cache->view);
      const std::size_t row = static_cast<std::size_t>(cache->view.shape[3]);
      for (std::int64_t page = 0; page < num_pages; ++page)
        for (std::int64_t h = 0; h < s.hkv; ++h)
          for (std::int64_t i = 0; i < page_size; ++i) {
            if (read[page * page_size + i]) continue;
            const std::size_t at =
                static_cast<std::size_t>((page * s.hkv + h) * page_size + i) * row;
            for (std::size_t e = 0; e < row; ++e) x[at + e] = e % 2 ? kInf : std::nan("");
          }
      test::write_view(cache->view, x);
    }
  }
  run_cache_call(r, s, dtype, append, l_new, capacity + 8, seqs, q, k_cache, v_cache,
                 {&alens, &apad, &aidx, &atable});
}

void fuzz_merge(Reader& r) {
  const int rank = static_cast<int>(r.range(1, 4));
  std::vector<std::int64_t> shape;
  for (int d = 0; d < rank; ++d) shape.push_back(d + 1 == rank ? head_dim(r) : r.range(0, 5));
  const std::vector<std::int64_t> lse_shape(shape.begin(), shape.end() - 1);
  std::vector<std::int64_t> shape_b = shape;
  if (r.chance(4)) shape_b.back() += 1;
  const DType dtype = value_dtype(r), lse_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
  Array oa = make_input(dtype, shape, layout(r), r, 1, 1.0);
  Array ob = make_input(dtype, shape_b, layout(r), r, 2, 1.0);
  Array la = make_input(lse_dtype, lse_shape, layout(r), r, 3, 16.0);
  Array lb = make_input(lse_dtype, lse_shape, layout(r), r, 4, 16.0);
  for (Array* l : {&la, &lb}) {  // LSE -inf: a side that saw no key
    auto x = test::read_view(l->view);
    for (double& e : x) e = e <= -14.0 ? -kInf : e;
    test::write_view(l->view, x);
  }
  const bool in_place = r.chance(60);  // into out_a and lse_a themselves
  const int threads = r.chance(4) ? -1 : static_cast<int>(r.range(0, 3));
  const bool allocating = r.chance(60);  // new tensors, copied here into contiguous arrays
  Array out = make_array(dtype, shape, allocating ? Layout::contiguous : output_layout(r), 0xa5);
  Array lse =
      make_array(lse_dtype, lse_shape, allocating ? Layout::contiguous : output_layout(r), 0xa5);
  // Expected, in double from the inputs as the library reads them.
  const auto xa = test::read_view(oa.view), xb = test::read_view(ob.view);
  const auto ya = test::read_view(la.view), yb = test::read_view(lb.view);
  Array* target_out = in_place ? &oa : &out;
  Array* target_lse = in_place ? &la : &lse;
  CallSpec call{{&out, &lse}, {&oa, &ob, &la, &lb}, {}, {}, false, [&](Backend) {
                  if (allocating) {
                    const MergeResult m =
                        merge_attention_states(oa.view, la.view, ob.view, lb.view, threads);
                    test::write_view(out.view, test::read_view(m.out));
                    test::write_view(lse.view, test::read_view(m.lse));
                    return;
                  }
                  merge_attention_states_into(oa.view, la.view, ob.view, lb.view, target_out->view,
                                              target_lse->view, threads);
                }};
  if (in_place && !allocating) call.written = {&oa, &la};
  call.result = {target_out->view, target_lse->view};
  if (allocating) call.result = {out.view, lse.view};
  const Run run = run_all_backends(call).front();  // no backends: the same call three times
  if (run.outcome != Outcome::ok) return;
  const std::size_t dv = static_cast<std::size_t>(shape.back());
  double vmax = std::max(max_finite(xa), max_finite(xb));
  const double tol = output_tolerance(dtype, vmax);
  for (std::size_t row = 0; row < ya.size(); ++row) {
    const double m = std::max(ya[row], yb[row]);
    const double l =
        m == -kInf ? -kInf : m + std::log(std::exp(ya[row] - m) + std::exp(yb[row] - m));
    if (!(std::fabs(run.results[1][row] - l) <= test::lse_tolerance(dtype, l)) &&
        run.results[1][row] != l)
      fail("merge: lse differs");
    for (std::size_t j = 0; j < dv; ++j) {
      const double want = l == -kInf ? 0.0
                                     : std::exp(ya[row] - l) * xa[row * dv + j] +
                                           std::exp(yb[row] - l) * xb[row * dv + j];
      if (!(std::fabs(run.results[0][row * dv + j] - want) <= tol))
        fail("merge: out element " + std::to_string(row * dv + j) + " is " +
             std::to_string(run.results[0][row * dv + j]) + ", expected " + std::to_string(want) +
             " (" + std::string(name_of(dtype)) + ", lse " + std::to_string(ya[row]) + ", " +
             std::to_string(yb[row]) + (in_place ? ", in place" : "") +
             (allocating ? ", allocating" : "") + ")");
    }
  }
}

}  // namespace attncore::fuzz
