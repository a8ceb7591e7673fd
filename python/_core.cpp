// attncore._core: the extension module behind the `attncore` Python package. It runs
// attncore::forward_into / backward_into and their variable-length forms
// (forward_varlen_into / backward_varlen_into) on Python arrays, read and written in place
// (borrowed.h: numpy arrays, torch tensors, other buffer-protocol and DLPack objects). Nothing is
// copied; the package allocates the outputs and reshapes its arguments into the views this
// module takes (rank 4 for dense calls, the packed rank-3 views for variable-length ones),
// except on the fast path (attend), which takes the caller's arrays and makes the output. int32
// arrays become DType::i32 views, which the library takes as index arrays (cu_seqlens, seqused_k)
// and refuses elsewhere. The KV-cache calls and PagedKvCache: kvcache.cpp.
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/varlen.h"
#include "borrowed.h"
#include "call_options.h"
#include "calls.h"
#include "kvcache.h"

namespace py = pybind11;

namespace {

using attncore::DType;
using attncore::InvalidArgument;
using attncore::TensorView;
using attncore::Unsupported;
using attncore_python::ArrayKind;
using attncore_python::backend_from_name;
using attncore_python::borrow_optional;
using attncore_python::Borrowed;
using attncore_python::call_work;
using attncore_python::CallOptions;
using attncore_python::causal_from_name;
using attncore_python::GilReleased;
using attncore_python::grad_enabled;
using attncore_python::last_call_addresses;
using attncore_python::lse_dtype_of;
using attncore_python::new_array;
using attncore_python::outputs_may_be_made;
using attncore_python::plain_backend;
using attncore_python::plain_flash_options;
using attncore_python::plain_int;
using attncore_python::plain_number;
using attncore_python::plain_value_dtype;
using attncore_python::plain_window;
using attncore_python::run_call;
using attncore_python::unit_last_stride;
using attncore_python::varlen_work;
using attncore_python::view_of;
using attncore_python::weighed_work;

// q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; writes out [B, Hq, Lq, Dv] and, when
// given, lse [B, Hq, Lq]. mask: rank 2 or 4; alibi_slopes: [Hq] or [B, Hq].
void forward(py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
             py::handle mask, py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  last_call_addresses().clear();
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  const double work =
      weighed_work(call_work(bq.view(), bk.view(), bv.view()), backend, bq.view().dtype);
  run_call(options, work, [&](const attncore::Options& o) {
    attncore::forward_into(bq.view(), bk.view(), bv.view(), bout.view(), view_of(blse), o, backend);
  });
}

// The fast path of scaled_dot_product_attention (layout bhld, q [B, Hq, Lq, D], an optional
// mask of rank 2 or 4) and flash_attn_func (layout blhd, q [B, Lq, Hq, D], no mask): one call
// on the caller's own rank-4 arrays, all numpy arrays or all plain CPU torch tensors (borrowed.h)
// with one batch size, and options of plain Python types: causal "none", "upper-left" or
// "lower-right"; scale None or a finite float > 0; window_size None or (left, right) ints;
// softcap a float (<= 0: off, flash-attn's convention); dropout_p 0; enable_gqa a bool (key and
// value with one head serve every query head regardless, as with torch's broadcasting); backend
// None or a name. Makes out (laid out like q, in the caller's layout) and returns it; where a
// torch input requires grad in grad mode, returns (out, lse [B, Hq, Lq] fp32) for the caller to
// record the autograd node with. Outputs of 1 MiB or more are made after the call's argument
// checks. Returns None for any other call, and for outputs past the memory this process may
// use: the package then takes its general path, which handles and checks everything.
py::object attend(py::handle q, py::handle k, py::handle v, py::handle mask, bool blhd,
                  const std::string& causal, py::handle scale, py::handle window_size,
                  py::handle softcap, py::handle dropout_p, py::handle enable_gqa,
                  py::handle backend) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  const py::object general = py::none();
  if (!mask.is_none() && blhd) return general;
  attncore::Options options;
  if (!scale.is_none()) {
    const auto s = plain_number(scale);
    if (!s || !(*s > 0) || !std::isfinite(*s)) return general;
    options.scale = *s;
  }
  if (!window_size.is_none()) {
    const auto window = plain_window(window_size);
    if (!window) return general;
    options.window_left = window->first;
    options.window_right = window->second;
  }
  const auto cap = plain_number(softcap), p = plain_number(dropout_p);
  if (!cap || std::isnan(*cap) || !p || *p != 0.0) return general;
  options.softcap = *cap > 0 ? *cap : 0.0;
  if (enable_gqa.ptr() != Py_True && enable_gqa.ptr() != Py_False) return general;
  const auto backend_chosen = plain_backend(backend);
  if (!backend_chosen) return general;
  const attncore::Backend chosen = *backend_chosen;
  options.causal = causal_from_name(op, causal);

  last_call_addresses().clear();
  const auto bq = Borrowed::plain(q, op, "query"), bk = Borrowed::plain(k, op, "key"),
             bv = Borrowed::plain(v, op, "value");
  const auto bmask = mask.is_none() ? std::nullopt : Borrowed::plain(mask, op, "mask");
  if (!bq || !bk || !bv || (!mask.is_none() && !bmask)) return general;
  const ArrayKind kind = bq->kind();
  if (bk->kind() != kind || bv->kind() != kind || (bmask && bmask->kind() != kind)) return general;
  // A call that autograd records: its backward needs the LSE.
  const bool want_lse = kind == ArrayKind::torch &&
                        (bq->requires_grad() || bk->requires_grad() || bv->requires_grad() ||
                         (bmask && bmask->requires_grad())) &&
                        attncore_python::grad_enabled();
  const TensorView &cq = bq->view(), &ck = bk->view(), &cv = bv->view();
  const DType dtype = cq.dtype;
  // Keys and values of a dtype no call takes (a torch bool key): the general path names them.
  if (cq.rank != 4 || ck.rank != 4 || cv.rank != 4 || !plain_value_dtype(dtype, kind) ||
      !plain_value_dtype(ck.dtype, kind) || !plain_value_dtype(cv.dtype, kind) ||
      ck.size(0) != cq.size(0) || cv.size(0) != cq.size(0) || !unit_last_stride(cq) ||
      !unit_last_stride(ck) || !unit_last_stride(cv))
    return general;
  // flash-attn's layout with shapes that do not fit together: the general path names them in
  // that layout (the library would name its [B, H, L, D] views).
  if (blhd && (ck.size(3) != cq.size(3) || ck.size(2) == 0 || cq.size(2) % ck.size(2) != 0 ||
               cv.size(1) != ck.size(1) || cv.size(2) != ck.size(2)))
    return general;
  // torch's layout with one query head against several kv heads: torch broadcasts the query
  // (the general path: sdpa_query_heads).
  if (!blhd && cq.size(1) == 1 && ck.size(1) > 1) return general;
  // torch's layout with key and value of different head counts: the general path repeats them
  // (sdpa_kv_heads), or names what does not fit.
  if (!blhd && ck.size(1) != cv.size(1)) return general;
  if (bmask) {  // bhld: the scores are [B, Hq, Lq, Lk]
    const TensorView& m = bmask->view();
    const std::int64_t scores[4] = {cq.size(0), cq.size(1), cq.size(2), ck.size(2)};
    bool broadcasts = m.rank == 2 || m.rank == 4;
    for (int d = 0; broadcasts && d < m.rank; ++d) {
      const std::int64_t n = m.size(d);
      broadcasts = n == 1 || n == scores[4 - m.rank + d];
    }
    if (!broadcasts || (m.dtype != DType::b8 && m.dtype != DType::f32 && m.dtype != dtype))
      return general;
    options.mask = m;
  }
  const int heads = blhd ? 2 : 1;  // the heads' dim in the caller's layout
  options.enable_gqa = enable_gqa.ptr() == Py_True || (ck.size(heads) == 1 && cv.size(heads) == 1);

  const std::int64_t batch = cq.size(0), heads_q = cq.size(heads), seqlen_q = cq.size(3 - heads),
                     dim_v = cv.size(3);
  auto bhld = [&](const TensorView& x) { return blhd ? x.transposed(1, 2) : x; };
  const DType lse_dtype = attncore_python::lse_dtype_of(dtype);
  const double rows =
      static_cast<double>(batch) * static_cast<double>(heads_q) * static_cast<double>(seqlen_q);
  if (!attncore_python::outputs_may_be_made(rows, dim_v, dtype, want_lse, [&] {
        (void)attncore::explain_forward(bhld(cq), bhld(ck), bhld(cv), options, chosen);
      }))
    return general;
  std::vector<std::int64_t> out_shape{batch, heads_q, seqlen_q, dim_v};
  if (blhd) std::swap(out_shape[1], out_shape[2]);
  const py::object out = attncore_python::new_array(
      kind, out_shape, dtype, {cq.stride_of(0), cq.stride_of(1), cq.stride_of(2), 1});
  py::object lse = py::none();
  if (want_lse) lse = attncore_python::new_array(kind, {batch, heads_q, seqlen_q}, lse_dtype);
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  const double work = weighed_work(call_work(bhld(cq), bhld(ck), bhld(cv)), chosen, dtype);
  run_call(options, work, [&](const attncore::Options& o) {
    attncore::forward_into(bhld(cq), bhld(ck), bhld(cv), bhld(bout.view()), view_of(blse), o,
                           chosen);
  });
  if (want_lse) return py::make_tuple(out, lse);
  return out;
}

// The gradients of forward's call with the same q, k, v and options: writes dq, dk, dv (shaped
// like q, k, v) and, when given, dbias (shaped like mask, which must then be additive).
void backward(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out,
              py::handle lse, py::handle dq, py::handle dk, py::handle dv, py::handle dbias,
              py::handle mask, py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  last_call_addresses().clear();
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const Borrowed bdq(dq, op, "dq", true), bdk(dk, op, "dk", true), bdv(dv, op, "dv", true);
  const auto bdbias = borrow_optional(dbias, op, "dbias", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, bdbias.has_value());
  const attncore::Backend backend = backend_from_name(op, call.backend);
  const double work =
      weighed_work(call_work(bq.view(), bk.view(), bv.view()), backend, bq.view().dtype);
  run_call(options, work, [&](const attncore::Options& o) {
    attncore::backward_into(bdout.view(), bq.view(), bk.view(), bv.view(), bout.view(), blse.view(),
                            bdq.view(), bdk.view(), bdv.view(), view_of(bdbias), o, backend);
  });
}

// The index arrays of a variable-length call, borrowed for the duration of the call.
struct BorrowedSeqs {
  Borrowed cu_seqlens_q, cu_seqlens_k;
  std::optional<Borrowed> seqused_k;
  std::int64_t max_seqlen_q, max_seqlen_k;
  std::optional<Borrowed> block_table;  // (forward only: k and v are then page pools)

  BorrowedSeqs(const char* op, py::handle cu_q, py::handle cu_k, py::handle used,
               std::int64_t max_q, std::int64_t max_k, py::handle table = py::none())
      : cu_seqlens_q(cu_q, op, "cu_seqlens_q", false),
        cu_seqlens_k(cu_k, op, "cu_seqlens_k", false),
        seqused_k(borrow_optional(used, op, "seqused_k", false)),
        max_seqlen_q(max_q),
        max_seqlen_k(max_k),
        block_table(borrow_optional(table, op, "block_table", false)) {}

  attncore::VarlenSeqs seqs() const {
    return {cu_seqlens_q.view(), cu_seqlens_k.view(), view_of(seqused_k),
            max_seqlen_q,        max_seqlen_k,        view_of(block_table)};
  }
};

// Packed q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] with int32 cu_seqlens_q,
// cu_seqlens_k [B + 1] and seqused_k [B] (or None); writes out [total_q, Hq, Dv] and, when
// given, lse [Hq, total_q]. mask is passed on so that the library refuses it (Unsupported).
// With an int32 block_table [B, max_pages_per_seq], k and v are page pools [num_pages,
// page_size, Hkv, D] (attncore/varlen.h).
void forward_varlen(py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q,
                    py::handle cu_seqlens_k, py::handle seqused_k, std::int64_t max_seqlen_q,
                    std::int64_t max_seqlen_k, py::handle out, py::handle lse, py::handle mask,
                    py::handle alibi_slopes, const CallOptions& call, py::handle block_table) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  last_call_addresses().clear();
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const BorrowedSeqs seqs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                          block_table);
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  const double work = weighed_work(varlen_work(bq.view(), bk.view(), bv.view(), seqs.seqs()),
                                   backend, bq.view().dtype);
  run_call(options, work, [&](const attncore::Options& o) {
    attncore::forward_varlen_into(bq.view(), bk.view(), bv.view(), seqs.seqs(), bout.view(),
                                  view_of(blse), o, backend);
  });
}

// The fast path of flash_attn_varlen_func: one call on the caller's own arrays, q [total_q,
// Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] (with block_table page pools [num_pages,
// page_size, Hkv, D]), all numpy arrays or all plain CPU torch tensors (borrowed.h) of value
// dtypes, none of which autograd would record, int32 index arrays (numpy or torch) whose last
// stride is 1, the maximum lengths as Python ints, no dropout, and flash-attn's options of plain
// Python types (plain_flash_options). Makes out (laid out like q) and returns it. Returns None
// for any other call, and for outputs past the memory this process may use (the LSE counted: the
// general path makes it for every call): the package's general path, which checks and handles
// everything, with the same bits. (A decode step of 4 sequences of 10 keys, Hq 32, Hkv 8, D 128,
// torch, 1 thread, one process, 11 interleaved rounds: 255 us through the general path, most of
// it its Python, against 77 here; one sequence of 16 keys, Hq 1, D 64: 210 against 15.)
py::object attend_varlen(py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q,
                         py::handle cu_seqlens_k, py::handle max_seqlen_q, py::handle max_seqlen_k,
                         py::handle seqused_k, py::handle block_table, py::handle softmax_scale,
                         py::handle causal, py::handle window_size, py::handle softcap,
                         py::handle dropout_p, py::handle backend) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  const py::object general = py::none();
  attncore::Options options;
  attncore::Backend chosen = attncore::Backend::automatic;
  const auto p = plain_number(dropout_p);
  const auto max_q = plain_int(max_seqlen_q, INT64_MIN, INT64_MAX),
             max_k = plain_int(max_seqlen_k, INT64_MIN, INT64_MAX);
  if (!p || *p != 0.0 || !max_q || !max_k ||
      !plain_flash_options(softmax_scale, causal, window_size, softcap, backend, options, chosen))
    return general;

  last_call_addresses().clear();
  const bool paged = !block_table.is_none();
  const auto bq = Borrowed::plain(q, op, "query"), bk = Borrowed::plain(k, op, "key"),
             bv = Borrowed::plain(v, op, "value");
  if (!bq || !bk || !bv) return general;
  const ArrayKind kind = bq->kind();
  if (bk->kind() != kind || bv->kind() != kind) return general;
  if (kind == ArrayKind::torch &&
      (bq->requires_grad() || bk->requires_grad() || bv->requires_grad()) && grad_enabled())
    return general;  // (the autograd record, or NotImplementedError over pools: the general path)
  const TensorView &cq = bq->view(), &ck = bk->view(), &cv = bv->view();
  const int kv_rank = paged ? 4 : 3;
  if (cq.rank != 3 || ck.rank != kv_rank || cv.rank != kv_rank ||
      !plain_value_dtype(cq.dtype, kind) || !plain_value_dtype(ck.dtype, kind) ||
      !plain_value_dtype(cv.dtype, kind) || !unit_last_stride(cq) || !unit_last_stride(ck) ||
      !unit_last_stride(cv))
    return general;
  // Index arrays: int32 of the rank the call takes, their last stride 1 (the general path copies
  // or refuses others); absent (an empty optional inside), or nullopt (declined).
  auto index = [&](py::handle x, const char* name,
                   int rank) -> std::optional<std::optional<Borrowed>> {
    if (x.is_none()) return std::optional<Borrowed>{};
    auto b = Borrowed::plain(x, op, name);
    if (!b || b->view().dtype != DType::i32 || b->view().rank != rank ||
        !unit_last_stride(b->view()))
      return std::nullopt;
    return std::optional<Borrowed>(std::move(b));
  };
  const auto cu_q = index(cu_seqlens_q, "cu_seqlens_q", 1),
             cu_k = index(cu_seqlens_k, "cu_seqlens_k", 1), used = index(seqused_k, "seqused_k", 1),
             table = index(block_table, "block_table", 2);
  if (!cu_q || !cu_k || !used || !table || !*cu_q || !*cu_k) return general;
  const attncore::VarlenSeqs seqs{(*cu_q)->view(), (*cu_k)->view(), view_of(*used),
                                  *max_q,          *max_k,          view_of(*table)};
  const std::int64_t total_q = cq.size(0), heads_q = cq.size(1), dim_v = cv.size(kv_rank - 1);
  const double rows = static_cast<double>(total_q) * static_cast<double>(heads_q);
  if (!outputs_may_be_made(rows, dim_v, cq.dtype, true, [&] {
        (void)attncore::explain_forward_varlen(cq, ck, cv, seqs, options, chosen);
      }))
    return general;
  const py::object out =
      new_array(kind, {total_q, heads_q, dim_v}, cq.dtype, {cq.stride_of(0), cq.stride_of(1), 1});
  const Borrowed bout(out, op, "out", true);
  const double work = weighed_work(varlen_work(cq, ck, cv, seqs), chosen, cq.dtype);
  run_call(options, work, [&](const attncore::Options& o) {
    attncore::forward_varlen_into(cq, ck, cv, seqs, bout.view(), std::nullopt, o, chosen);
  });
  return out;
}

// The gradients of forward_varlen's call with the same inputs: writes dq, dk, dv (shaped like
// q, k, v; rows that belong to no sequence get 0).
void backward_varlen(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out,
                     py::handle lse, py::handle cu_seqlens_q, py::handle cu_seqlens_k,
                     py::handle seqused_k, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                     py::handle dq, py::handle dk, py::handle dv, py::handle mask,
                     py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  last_call_addresses().clear();
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const BorrowedSeqs seqs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  const Borrowed bdq(dq, op, "dq", true), bdk(dk, op, "dk", true), bdv(dv, op, "dv", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  const double work = weighed_work(varlen_work(bq.view(), bk.view(), bv.view(), seqs.seqs()),
                                   backend, bq.view().dtype);
  run_call(options, work,
           [&](const attncore::Options& o) {
             attncore::backward_varlen_into(bdout.view(), bq.view(), bk.view(), bv.view(),
                                            bout.view(), blse.view(), seqs.seqs(), bdq.view(),
                                            bdk.view(), bdv.view(), o, backend);
           });
}

// Names of backends, in order.
std::vector<std::string> names_of(const std::vector<attncore::Backend>& backends) {
  std::vector<std::string> names;
  for (attncore::Backend b : backends) names.emplace_back(attncore::name_of(b));
  return names;
}

// The library's messages in Python's terms: a backend left out points to the C++ scope
// (BackendScope, set_enabled_backends: src/core/select.cpp), which Python sets through
// attncore.sdpa_kernel.
std::string python_terms(std::string text) {
  static const std::string cpp = "see BackendScope or set_enabled_backends";
  static const std::string python = "see attncore.sdpa_kernel";
  for (std::size_t at = text.find(cpp); at != std::string::npos; at = text.find(cpp, at)) {
    text.replace(at, cpp.size(), python);
  }
  return text;
}

// An Explanation as ([(name, enabled, reasons, estimated_seconds)], chosen name or None,
// summary).
py::tuple explanation_tuple(const attncore::Explanation& e) {
  py::list verdicts;
  for (const attncore::BackendVerdict& v : e.verdicts) {
    std::vector<std::string> reasons;
    for (const std::string& r : v.reasons) reasons.push_back(python_terms(r));
    verdicts.append(py::make_tuple(std::string(attncore::name_of(v.backend)), v.enabled, reasons,
                                   v.estimated_seconds));
  }
  py::object chosen = py::none();
  if (e.chosen != attncore::Backend::automatic)
    chosen = py::str(std::string(attncore::name_of(e.chosen)));
  return py::make_tuple(verdicts, chosen, python_terms(e.summary()));
}

// What automatic selection does with forward's call (the same arguments, nothing written),
// after the library's checks of it: of the backend it names too (call.backend), which the
// package runs before it copies an input. (explain_backward and the varlen ones alike.)
py::tuple explain_forward(py::handle q, py::handle k, py::handle v, py::handle mask,
                          py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  return explanation_tuple(attncore::explain_forward(bq.view(), bk.view(), bv.view(),
                                                     call.options(op, bmask, balibi, false),
                                                     backend_from_name(op, call.backend)));
}

// The same for backward's call; dbias is asked for when `want_dbias` (an additive mask).
py::tuple explain_backward(py::handle dout, py::handle q, py::handle k, py::handle v,
                           py::handle out, py::handle lse, py::handle mask, py::handle alibi_slopes,
                           bool want_dbias, const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  return explanation_tuple(attncore::explain_backward(
      bdout.view(), bq.view(), bk.view(), bv.view(), bout.view(), blse.view(),
      call.options(op, bmask, balibi, want_dbias), backend_from_name(op, call.backend)));
}

// The same for forward_varlen's and backward_varlen's calls (the index arrays read as they do).
py::tuple explain_forward_varlen(py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q,
                                 py::handle cu_seqlens_k, py::handle seqused_k,
                                 std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                                 py::handle mask, py::handle alibi_slopes, const CallOptions& call,
                                 py::handle block_table) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const BorrowedSeqs seqs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                          block_table);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  return explanation_tuple(attncore::explain_forward_varlen(
      bq.view(), bk.view(), bv.view(), seqs.seqs(), call.options(op, bmask, balibi, false),
      backend_from_name(op, call.backend)));
}

py::tuple explain_backward_varlen(py::handle dout, py::handle q, py::handle k, py::handle v,
                                  py::handle out, py::handle lse, py::handle cu_seqlens_q,
                                  py::handle cu_seqlens_k, py::handle seqused_k,
                                  std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                                  py::handle mask, py::handle alibi_slopes,
                                  const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const BorrowedSeqs seqs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  return explanation_tuple(attncore::explain_backward_varlen(
      bdout.view(), bq.view(), bk.view(), bv.view(), bout.view(), blse.view(), seqs.seqs(),
      call.options(op, bmask, balibi, false), backend_from_name(op, call.backend)));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attncore's C++ library on Python arrays (used by the attncore package)";

  attncore_python::set_main_thread(
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  // attncore::Cancelled: a call whose Options::cancel was set stopped (outputs incomplete).
  static py::exception<attncore::Cancelled> cancelled(m, "Cancelled", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const attncore::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const attncore::Unsupported& e) {
      PyErr_SetString(PyExc_NotImplementedError, python_terms(e.what()).c_str());
    } catch (const attncore::OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const attncore::Cancelled& e) {
      PyErr_SetString(cancelled.ptr(), e.what());
    } catch (const attncore::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<CallOptions>(m, "CallOptions")
      .def(py::init([](std::optional<double> scale, std::string causal, std::int64_t window_left,
                       std::int64_t window_right, double softcap, double dropout_p,
                       std::uint64_t seed, std::uint64_t offset, bool enable_gqa, int num_threads,
                       std::string backend, int num_splits) {
             return CallOptions{scale,
                                std::move(causal),
                                window_left,
                                window_right,
                                softcap,
                                dropout_p,
                                seed,
                                offset,
                                enable_gqa,
                                num_threads,
                                std::move(backend),
                                num_splits};
           }),
           py::kw_only(), py::arg("scale"), py::arg("causal"), py::arg("window_left"),
           py::arg("window_right"), py::arg("softcap"), py::arg("dropout_p"), py::arg("seed"),
           py::arg("offset"), py::arg("enable_gqa"), py::arg("num_threads"), py::arg("backend"),
           py::arg("num_splits") = 0);

  m.def("forward", &forward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"),
        py::arg("lse").none(true), py::arg("mask").none(true), py::arg("alibi_slopes").none(true),
        py::arg("options"));
  m.def("attend", &attend, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("mask").none(true), py::arg("blhd"), py::arg("causal"), py::arg("scale").none(true),
        py::arg("window_size").none(true), py::arg("softcap"), py::arg("dropout_p"),
        py::arg("enable_gqa"), py::arg("backend").none(true));
  m.def("backward", &backward, py::arg("dout"), py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("dbias").none(true), py::arg("mask").none(true), py::arg("alibi_slopes").none(true),
        py::arg("options"));
  m.def("forward_varlen", &forward_varlen, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k").none(true),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("out"), py::arg("lse").none(true),
        py::arg("mask").none(true), py::arg("alibi_slopes").none(true), py::arg("options"),
        py::arg("block_table").none(true) = py::none());
  m.def("attend_varlen", &attend_varlen, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("seqused_k").none(true), py::arg("block_table").none(true),
        py::arg("softmax_scale").none(true), py::arg("causal"), py::arg("window_size"),
        py::arg("softcap"), py::arg("dropout_p"), py::arg("backend").none(true));
  m.def("backward_varlen", &backward_varlen, py::arg("dout"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("seqused_k").none(true), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("mask").none(true), py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("explain_forward", &explain_forward, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("mask").none(true), py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("explain_backward", &explain_backward, py::arg("dout"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("out"), py::arg("lse"), py::arg("mask").none(true),
        py::arg("alibi_slopes").none(true), py::arg("want_dbias"), py::arg("options"));
  m.def("explain_forward_varlen", &explain_forward_varlen, py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("seqused_k").none(true), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("mask").none(true), py::arg("alibi_slopes").none(true), py::arg("options"),
        py::arg("block_table").none(true) = py::none());
  m.def("explain_backward_varlen", &explain_backward_varlen, py::arg("dout"), py::arg("query"),
        py::arg("key"), py::arg("value"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("seqused_k").none(true), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("mask").none(true), py::arg("alibi_slopes").none(true),
        py::arg("options"));
  m.def(
      "enabled_backends", [] { return names_of(attncore::enabled_backends()); },
      "The backends automatic selection may choose on this thread, in priority order");
  m.def(
      "set_enabled_backends",
      [](const std::vector<std::string>& names) {
        std::vector<attncore::Backend> backends;
        for (const std::string& name : names)
          backends.push_back(backend_from_name("set_enabled_backends", name));
        return names_of(attncore::set_enabled_backends(backends));
      },
      py::arg("backends"), "Replaces this thread's enabled backends; returns the previous list");
  m.def("set_num_threads", &attncore::set_num_threads, py::arg("num_threads"),
        "Sets the process-wide thread count (0 resets); returns the previous setting");
  m.def("get_num_threads", &attncore::get_num_threads,
        "The thread count a call without num_threads would use now");
  m.def("version", &attncore::version);
  m.def(
      "memory_limit",
      [] {
        const attncore::MemoryLimit limit = attncore::memory_limit();
        return py::make_tuple(limit.bytes, limit.name);
      },
      "(bytes, name): the memory this process may use and which limit sets it");
  attncore_python::bind_kvcache(m);
  m.def("simd_target", &attncore::simd_target);
  m.def(
      "_last_call_addresses", [] { return last_call_addresses(); },
      "The data address of each array of this thread's last call, by name");
}
