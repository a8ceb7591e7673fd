#include "kvcache.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "attncore/merge.h"
#include "attncore/paged.h"
#include "borrowed.h"
#include "call_options.h"
#include "calls.h"

namespace py = pybind11;

namespace attncore_python {
namespace {

using attncore::DType;
using attncore::InvalidArgument;
using attncore::TensorView;

// The arrays of a call over a KV cache, borrowed: q [B, Hq, Lq, D], k_cache
// [B_cache, Hkv, capacity, D], v_cache [B_cache, Hkv, capacity, Dv] (the flash layout's
// transposed(1, 2) views), int32 cache_seqlens [B] and optional cache_batch_idx, cache_leftpad
// [B]; with an int32 block_table [B, max_pages_per_seq] the caches are page pools
// [num_pages, Hkv, page_size, D]. With k_new / v_new [B, Hkv, L_new, D] (an append: the caches
// are then written, so borrowed as outputs), f32 rotary_cos, rotary_sin [positions,
// rotary_dim / 2] when given.
struct KvCall {
  static constexpr const char* op = "forward";  // the library's name of the call, in messages
  KvCall(py::handle q, py::handle k_cache, py::handle v_cache, py::handle cache_seqlens,
         py::handle cache_batch_idx, py::handle cache_leftpad, py::handle block_table,
         py::handle k_new, py::handle v_new, py::handle rotary_cos, py::handle rotary_sin,
         bool rotary_interleaved, py::handle alibi_slopes)
      : bq(q, op, "query", false),
        bk(k_cache, op, "k_cache", !k_new.is_none()),
        bv(v_cache, op, "v_cache", !k_new.is_none()),
        blens(cache_seqlens, op, "cache_seqlens", false),
        bidx(borrow_optional(cache_batch_idx, op, "cache_batch_idx", false)),
        bpad(borrow_optional(cache_leftpad, op, "cache_leftpad", false)),
        btable(borrow_optional(block_table, op, "block_table", false)),
        bknew(borrow_optional(k_new, op, "k", false)),
        bvnew(borrow_optional(v_new, op, "v", false)),
        bcos(borrow_optional(rotary_cos, op, "rotary_cos", false)),
        bsin(borrow_optional(rotary_sin, op, "rotary_sin", false)),
        balibi(borrow_optional(alibi_slopes, op, "alibi_slopes", false)),
        seqs{blens.view(), view_of(bidx), view_of(bpad), view_of(btable)} {
    if (bknew.has_value() != bvnew.has_value())
      throw InvalidArgument(std::string(op) + ": k and v must be given together (k is " +
                            (bknew ? "set" : "None") + ", v is " + (bvnew ? "set" : "None") + ")");
    if (bknew) {
      append = attncore::KvAppend{bknew->view(), bvnew->view(), view_of(bcos), view_of(bsin),
                                  rotary_interleaved};
    }
  }
  const Borrowed bq, bk, bv, blens;
  const std::optional<Borrowed> bidx, bpad, btable, bknew, bvnew, bcos, bsin, balibi;
  const attncore::KvCacheSeqs seqs;
  std::optional<attncore::KvAppend> append;  // with k_new, v_new
};

// The keys a call over a KV cache attends per sequence, on average: each sequence's
// cache_seqlens (within the keys its cache row or block table holds) and its new rows, so that
// call_work counts what the call reads, not the cache's capacity. (A decode step over a cache of
// 1024 slots holding 1 key, Hq 32, D 128, went through the runner: 131 us a call against 23 for
// a cache of 64 slots, 1 thread.) Lengths the library will refuse (not int32 [B]) count the
// capacity, as do batches of more than 2^16 sequences (a broadcast array: not read through).
double attended_keys(const TensorView& q, const TensorView& k, const attncore::KvCacheSeqs& seqs,
                     const std::optional<attncore::KvAppend>& append) {
  // (A paged cache's keys per sequence: its block table's pages times the page size.)
  const double capacity = seqs.block_table ? static_cast<double>(seqs.block_table->size(1)) *
                                                 static_cast<double>(k.size(2))
                                           : static_cast<double>(k.size(2));
  const double added = append ? static_cast<double>(append->k_new.size(2)) : 0.0;
  const TensorView& lens = seqs.cache_seqlens;
  const std::int64_t batch = q.size(0);
  if (lens.data == nullptr || lens.dtype != DType::i32 || lens.rank != 1 || lens.size(0) != batch ||
      batch == 0 || batch > (1 << 16))
    return capacity + added;
  double keys = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const double n = static_cast<const std::int32_t*>(lens.data)[b * lens.stride_of(0)];
    keys += std::min(std::max(n + added, 0.0), capacity);
  }
  return keys / static_cast<double>(batch);
}

// The call over a KV cache of q [B, Hq, Lq, D] and the caches (the library's views), with an
// append or not, into out [B, Hq, Lq, Dv] and lse [B, Hq, Lq] (when given): run (run_call), or
// only checked (explain_kvcache: its explain_forward_kvcache, which writes nothing).
void run_kvcache(const TensorView& q, const TensorView& k, const TensorView& v,
                 const attncore::KvCacheSeqs& seqs, const std::optional<attncore::KvAppend>& append,
                 const TensorView& out, const std::optional<TensorView>& lse,
                 const attncore::Options& options, attncore::Backend backend) {
  const double keys = attended_keys(q, k, seqs, append);
  run_call(options, weighed_work(call_work(q, keys, v), backend, q.dtype),
           [&](const attncore::Options& o) {
             if (append) {
               attncore::forward_kvcache_into(q, k, v, seqs, *append, out, lse, o, backend);
             } else {
               attncore::forward_kvcache_into(q, k, v, seqs, out, lse, o, backend);
             }
           });
}
void explain_kvcache(const TensorView& q, const TensorView& k, const TensorView& v,
                     const attncore::KvCacheSeqs& seqs,
                     const std::optional<attncore::KvAppend>& append,
                     const attncore::Options& options, attncore::Backend backend) {
  if (append) {
    (void)attncore::explain_forward_kvcache(q, k, v, seqs, *append, options, backend);
  } else {
    (void)attncore::explain_forward_kvcache(q, k, v, seqs, options, backend);
  }
}

// Attention over a KV cache (KvCall's arrays; an append writes the new rows into the caches in
// place first). Writes out [B, Hq, Lq, Dv] and, when given, lse [B, Hq, Lq].
void forward_kvcache(py::handle q, py::handle k_cache, py::handle v_cache, py::handle cache_seqlens,
                     py::handle cache_batch_idx, py::handle cache_leftpad, py::handle block_table,
                     py::handle k_new, py::handle v_new, py::handle rotary_cos,
                     py::handle rotary_sin, bool rotary_interleaved, py::handle out, py::handle lse,
                     py::handle alibi_slopes, const CallOptions& call) {
  last_call_addresses().clear();
  const KvCall c(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                 k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes);
  const Borrowed bout(out, KvCall::op, "out", true);
  const auto blse = borrow_optional(lse, KvCall::op, "lse", true);
  const attncore::Options options = call.options(KvCall::op, std::nullopt, c.balibi, false);
  const attncore::Backend backend = backend_from_name(KvCall::op, call.backend);
  run_kvcache(c.bq.view(), c.bk.view(), c.bv.view(), c.seqs, c.append, bout.view(), view_of(blse),
              options, backend);
}

// The fast path of flash_attn_with_kvcache: a call with no ALiBi, on the caller's own arrays, all
// numpy arrays or all plain CPU torch tensors (borrowed.h) in flash-attn's layout (q
// [B, Lq, Hq, D], caches [B_cache, capacity, Hkv, D] or page pools [num_pages, page_size, Hkv,
// D], new k, v [B, L_new, Hkv, D], unit last strides) whose shapes fit together; caches an append
// may write (numpy: writeable; torch: an inference tensor only in inference mode), float32
// rotary tables [positions, rotary_dim / 2] with a unit last stride, int32 index arrays with a
// unit last stride, all of the same kind, cache_seqlens also a Python int; options of plain
// Python types (softmax_scale None or a finite number > 0, causal a bool, window_size a tuple of
// two ints from -1, softcap a number other than NaN, num_splits an int within int32, backend
// None or a name). Makes out [B, Lq, Hq, Dv] in q's dtype and returns it, or with return_lse (out,
// lse [B, Hq, Lq], float32, float64 for a float64 q); returns None for any other call (and where a
// torch input requires grad in grad mode), which the package's general path then checks and
// runs. The caller moves an appended torch cache's version counter. A decode step of Hq 32,
// Hkv 8, D 64 over 200 keys (1 thread, Zen 3) took ~165 us through the general path (~80 of them
// in the library), ~65 here; appending one key and value ~200 against ~75.
py::object attend_kvcache(py::handle q, py::handle k_cache, py::handle v_cache, py::handle k_new,
                          py::handle v_new, py::handle rotary_cos, py::handle rotary_sin,
                          bool rotary_interleaved, py::handle cache_seqlens,
                          py::handle cache_batch_idx, py::handle cache_leftpad,
                          py::handle block_table, py::handle softmax_scale, py::handle causal,
                          py::handle window_size, py::handle softcap, py::handle num_splits,
                          py::handle backend, bool return_lse) {
  constexpr const char* op = KvCall::op;
  const py::object general = py::none();
  attncore::Options options;
  options.enable_gqa = true;
  attncore::Backend chosen = attncore::Backend::automatic;
  const auto splits = plain_int(num_splits, INT32_MIN, INT32_MAX);
  if (!splits ||
      !plain_flash_options(softmax_scale, causal, window_size, softcap, backend, options, chosen))
    return general;
  options.num_splits = static_cast<int>(*splits);

  last_call_addresses().clear();
  const bool appending = !k_new.is_none();
  if (appending == v_new.is_none() ||
      (!appending && (!rotary_cos.is_none() || !rotary_sin.is_none())))
    return general;
  const auto bq = Borrowed::plain(q, op, "query"), bk = Borrowed::plain(k_cache, op, "k_cache"),
             bv = Borrowed::plain(v_cache, op, "v_cache");
  if (!bq || !bk || !bv) return general;
  const ArrayKind kind = bq->kind();
  if (bk->kind() != kind || bv->kind() != kind) return general;
  // Optional arrays of the same kind: absent (an empty optional inside), or nullopt (declined).
  auto same_kind = [&](py::handle x, const char* name) -> std::optional<std::optional<Borrowed>> {
    if (x.is_none()) return std::optional<Borrowed>{};
    auto b = Borrowed::plain(x, op, name);
    if (!b || b->kind() != kind) return std::nullopt;
    return std::optional<Borrowed>(std::move(b));
  };
  const auto bknew = same_kind(k_new, "k"), bvnew = same_kind(v_new, "v");
  const auto bcos = same_kind(rotary_cos, "rotary_cos"), bsin = same_kind(rotary_sin, "rotary_sin");
  if (!bknew || !bvnew || !bcos || !bsin) return general;
  bool grad = false;
  for (const auto* b : {&*bq, &*bk, &*bv}) grad = grad || b->requires_grad();
  for (const auto* b : {&*bknew, &*bvnew, &*bcos, &*bsin})
    grad = grad || (*b && (*b)->requires_grad());
  if (kind == ArrayKind::torch && grad && grad_enabled()) {
    return general;  // (NotImplementedError: the general path)
  }
  for (const auto* b : {&*bcos, &*bsin}) {
    if (*b && ((*b)->view().dtype != DType::f32 || (*b)->view().rank != 2 ||
               ((*b)->view().size(1) > 1 && (*b)->view().stride_of(1) != 1)))
      return general;  // (other dtypes taken as float32, or copied: the general path)
  }
  if (appending) {  // caches the append may write in place
    for (py::handle cache : {k_cache, v_cache}) {
      if (kind == ArrayKind::numpy && !py::reinterpret_borrow<py::array>(cache).writeable())
        return general;
      if (kind == ArrayKind::torch && cache.attr("is_inference")().ptr() == Py_True &&
          py::module_::import("torch").attr("is_inference_mode_enabled")().ptr() != Py_True)
        return general;
    }
  }
  // Index arrays: int32 arrays of the same kind with a unit last stride (cache_seqlens also an
  // int), or None (the general path copies others, or refuses them).
  auto index = [&](py::handle x, const char* name) -> std::optional<std::optional<Borrowed>> {
    auto b = same_kind(x, name);
    if (!b || !*b) return b;
    const TensorView& t = (*b)->view();
    if (t.dtype != DType::i32 || !unit_last_stride(t)) return std::nullopt;
    return b;
  };
  const auto bidx = index(cache_batch_idx, "cache_batch_idx");
  const auto bpad = index(cache_leftpad, "cache_leftpad");
  const auto btable = index(block_table, "block_table");
  if (!bidx || !bpad || !btable) return general;
  const TensorView &cq = bq->view(), &ck = bk->view(), &cv = bv->view();
  const DType dtype = cq.dtype;
  if (cq.rank != 4 || ck.rank != 4 || cv.rank != 4 || !plain_value_dtype(dtype, kind) ||
      !unit_last_stride(cq) || !unit_last_stride(ck) || !unit_last_stride(cv))
    return general;
  // Shapes that do not fit together: the general path names them in flash-attn's layout.
  const std::int64_t batch = cq.size(0), heads_q = cq.size(2), heads_kv = ck.size(2);
  const bool paged = btable->has_value();
  if (ck.size(3) != cq.size(3) || heads_kv == 0 || heads_q % heads_kv != 0 ||
      cv.size(0) != ck.size(0) || cv.size(1) != ck.size(1) || cv.size(2) != heads_kv ||
      (paged && ck.size(1) == 0) || (!paged && !bidx->has_value() && ck.size(0) != batch))
    return general;
  if (appending) {  // k, v [B, L_new, Hkv, D / Dv]
    const TensorView &kn = (*bknew)->view(), &vn = (*bvnew)->view();
    if (kn.rank != 4 || vn.rank != 4 || !unit_last_stride(kn) || !unit_last_stride(vn) ||
        kn.size(0) != batch || kn.size(2) != heads_kv || kn.size(3) != ck.size(3) ||
        vn.size(0) != batch || vn.size(1) != kn.size(1) || vn.size(2) != heads_kv ||
        vn.size(3) != cv.size(3))
      return general;
  }
  // cache_seqlens: an int32 array, or an int for every sequence (in `lengths`).
  // (A batch of more than 2^24 sequences, as a broadcast query makes at no cost: the general
  // path, whose array of lengths is refused by its size.)
  const auto length =
      batch <= (1 << 24) ? plain_int(cache_seqlens, -INT32_MAX - 1, INT32_MAX) : std::nullopt;
  std::vector<std::int32_t> lengths(length ? static_cast<std::size_t>(batch) : 0,
                                    static_cast<std::int32_t>(length.value_or(0)));
  const auto blens = length ? std::optional<std::optional<Borrowed>>(std::optional<Borrowed>{})
                            : index(cache_seqlens, "cache_seqlens");
  if (!blens || (!length && !blens->has_value())) return general;
  if (length && batch == 0) return general;  // (whose check of the int no sequence would make)
  const attncore::KvCacheSeqs seqs{
      length ? TensorView::contiguous(lengths.data(), DType::i32, {batch}) : (*blens)->view(),
      view_of(*bidx), view_of(*bpad), view_of(*btable)};
  const std::int64_t seqlen_q = cq.size(1), dim_v = cv.size(3);
  const TensorView qv = cq.transposed(1, 2), kv = ck.transposed(1, 2), vv = cv.transposed(1, 2);
  std::optional<attncore::KvAppend> append;
  if (appending) {
    append =
        attncore::KvAppend{(*bknew)->view().transposed(1, 2), (*bvnew)->view().transposed(1, 2),
                           view_of(*bcos), view_of(*bsin), rotary_interleaved};
  }
  const double rows =
      static_cast<double>(batch) * static_cast<double>(seqlen_q) * static_cast<double>(heads_q);
  // (The LSE counted always: the general path makes it for every call.)
  if (!outputs_may_be_made(rows, dim_v, dtype, true,
                           [&] { explain_kvcache(qv, kv, vv, seqs, append, options, chosen); }))
    return general;
  const py::object out = new_array(kind, {batch, seqlen_q, heads_q, dim_v}, dtype);
  py::object lse = py::none();
  if (return_lse) lse = new_array(kind, {batch, heads_q, seqlen_q}, lse_dtype_of(dtype));
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  run_kvcache(qv, kv, vv, seqs, append, bout.view().transposed(1, 2), view_of(blse), options,
              chosen);
  if (return_lse) return py::make_tuple(out, lse);
  return out;
}

// The library's checks of forward_kvcache's call (the same arguments, nothing run or written:
// explain_forward_kvcache's, of the backend it names too), made before the package copies an
// input it cannot read in place.
void check_forward_kvcache(py::handle q, py::handle k_cache, py::handle v_cache,
                           py::handle cache_seqlens, py::handle cache_batch_idx,
                           py::handle cache_leftpad, py::handle block_table, py::handle k_new,
                           py::handle v_new, py::handle rotary_cos, py::handle rotary_sin,
                           bool rotary_interleaved, py::handle alibi_slopes,
                           const CallOptions& call) {
  const KvCall c(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                 k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes);
  const attncore::Options options = call.options(KvCall::op, std::nullopt, c.balibi, false);
  const attncore::Backend backend = backend_from_name(KvCall::op, call.backend);
  explain_kvcache(c.bq.view(), c.bk.view(), c.bv.view(), c.seqs, c.append, options, backend);
}

// Merges two attention results over disjoint key sets into out and lse (which may be the very
// arrays out_a / lse_a or out_b / lse_b).
void merge_states(py::handle out_a, py::handle lse_a, py::handle out_b, py::handle lse_b,
                  py::handle out, py::handle lse, int num_threads) {
  constexpr const char* op = "merge_attention_states";
  last_call_addresses().clear();
  const Borrowed boa(out_a, op, "out_a", false), bla(lse_a, op, "lse_a", false);
  const Borrowed bob(out_b, op, "out_b", false), blb(lse_b, op, "lse_b", false);
  const Borrowed bout(out, op, "out", true), blse(lse, op, "lse", true);
  // Work for run_call (Ctrl-C on the main thread): a merged element costs about what 8
  // multiply-adds of the reference backend do (2^22 rows of Dv = 128 took ~3 s on one thread).
  double elements = 1.0;
  for (int d = 0; d < boa.view().rank; ++d) elements *= static_cast<double>(boa.view().size(d));
  attncore::Options options;
  options.num_threads = num_threads;
  run_call(options, weighed_work(8.0 * elements, attncore::Backend::reference, DType::f32),
           [&](const attncore::Options& o) {
             attncore::merge_attention_states_into(boa.view(), bla.view(), bob.view(), blb.view(),
                                                   bout.view(), blse.view(), o.num_threads,
                                                   o.cancel);
           });
}

// A PagedKvCache's array as a numpy array over the cache's own memory, which the array keeps
// alive (through `owner`, the Python object of the cache); bf16 as int16 (numpy has no
// bfloat16: attncore.PagedKVCache views it as torch.bfloat16).
py::array paged_array(py::object owner, const TensorView& t) {
  static const std::map<DType, const char*> names = {{DType::f32, "float32"},
                                                     {DType::f64, "float64"},
                                                     {DType::f16, "float16"},
                                                     {DType::bf16, "int16"},
                                                     {DType::i32, "int32"}};
  std::vector<py::ssize_t> shape, strides;
  for (int d = 0; d < t.rank; ++d) {
    shape.push_back(t.size(d));
    strides.push_back(t.stride_of(d) * static_cast<py::ssize_t>(attncore::size_of(t.dtype)));
  }
  return py::array(py::dtype(names.at(t.dtype)), shape, strides, t.data, owner);
}

DType cache_dtype(const std::string& name) {
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    if (name == attncore::name_of(d)) return d;
  }
  throw InvalidArgument("PagedKVCache: dtype is not a cache dtype (dtype=" + name +
                        ", expected f32, bf16, f16 or f64)");
}

void bind_paged_cache(py::module_& m) {
  using attncore::PagedKvCache;
  py::class_<PagedKvCache>(m, "PagedKvCache")
      .def(py::init([](std::int64_t num_pages, std::int64_t page_size, std::int64_t heads_kv,
                       std::int64_t head_dim, std::int64_t head_dim_v, const std::string& dtype,
                       std::int64_t max_batch, std::int64_t max_pages_per_seq) {
             return PagedKvCache(num_pages, page_size, heads_kv, head_dim, head_dim_v,
                                 cache_dtype(dtype), max_batch, max_pages_per_seq);
           }),
           py::arg("num_pages"), py::arg("page_size"), py::arg("heads_kv"), py::arg("head_dim"),
           py::arg("head_dim_v"), py::arg("dtype"), py::arg("max_batch"),
           py::arg("max_pages_per_seq"))
      .def("reserve", &PagedKvCache::reserve, py::arg("batch_idx"), py::arg("seq_len"))
      .def("erase", &PagedKvCache::erase, py::arg("batch_idx"))
      .def("fork", &PagedKvCache::fork, py::arg("src"), py::arg("dst"), py::arg("prefix_len"))
      .def("free_pages", &PagedKvCache::free_pages)
      .def("capacity", &PagedKvCache::capacity, py::arg("batch_idx"))
      .def("references", &PagedKvCache::references, py::arg("page"))
      .def(
          "assign",
          [](PagedKvCache& c, std::int64_t b, py::handle positions, py::handle k, py::handle v) {
            constexpr const char* op = "PagedKVCache.assign";
            const Borrowed bp(positions, op, "input_pos", false), bk(k, op, "k_val", false),
                bv(v, op, "v_val", false);
            c.assign(b, bp.view(), bk.view(), bv.view());
          },
          py::arg("batch_idx"), py::arg("positions"), py::arg("k"), py::arg("v"))
      .def("array", [](py::object self, const std::string& which) {
        const PagedKvCache& c = self.cast<const PagedKvCache&>();
        if (which == "k") return paged_array(self, c.k_pages());
        if (which == "v") return paged_array(self, c.v_pages());
        if (which == "page_table") return paged_array(self, c.page_table());
        return paged_array(self, c.seqlens());
      });
}

}  // namespace

void bind_kvcache(py::module_& m) {
  bind_paged_cache(m);
  m.def("forward_kvcache", &forward_kvcache, py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cache_seqlens"), py::arg("cache_batch_idx").none(true),
        py::arg("cache_leftpad").none(true), py::arg("block_table").none(true),
        py::arg("k").none(true), py::arg("v").none(true), py::arg("rotary_cos").none(true),
        py::arg("rotary_sin").none(true), py::arg("rotary_interleaved"), py::arg("out"),
        py::arg("lse").none(true), py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("attend_kvcache", &attend_kvcache, py::arg("query"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("k").none(true), py::arg("v").none(true), py::arg("rotary_cos").none(true),
        py::arg("rotary_sin").none(true), py::arg("rotary_interleaved"),
        py::arg("cache_seqlens").none(true), py::arg("cache_batch_idx").none(true),
        py::arg("cache_leftpad").none(true), py::arg("block_table").none(true),
        py::arg("softmax_scale").none(true), py::arg("causal"), py::arg("window_size"),
        py::arg("softcap"), py::arg("num_splits"), py::arg("backend").none(true),
        py::arg("return_lse"));
  m.def("check_forward_kvcache", &check_forward_kvcache, py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cache_seqlens"), py::arg("cache_batch_idx").none(true),
        py::arg("cache_leftpad").none(true), py::arg("block_table").none(true),
        py::arg("k").none(true), py::arg("v").none(true), py::arg("rotary_cos").none(true),
        py::arg("rotary_sin").none(true), py::arg("rotary_interleaved"),
        py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("merge_attention_states", &merge_states, py::arg("out_a"), py::arg("lse_a"),
        py::arg("out_b"), py::arg("lse_b"), py::arg("out"), py::arg("lse"),
        py::arg("num_threads") = 0);
}

}  // namespace attncore_python
