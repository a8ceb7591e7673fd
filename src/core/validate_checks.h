// The checks validate.cpp and validate_varlen.cpp share: one Checker with docs/design.md section
// 4's message form, `<op>: <what> <problem> (<name>=<value>, expected <constraint>)[; <remedy>]`.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

#include "attncore/error.h"
#include "core/overlap.h"
#include "core/params.h"

namespace attncore::detail {

inline std::string fmt_double(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// The product of non-negative counts, or -1 when it does not fit in int64.
inline std::int64_t product_or_negative(std::initializer_list<std::int64_t> counts) {
  std::int64_t product = 1;
  bool zero = false;
  bool overflow = false;
  for (const std::int64_t c : counts) {
    zero |= c == 0;
    overflow |= __builtin_mul_overflow(product, c, &product);
  }
  return zero ? 0 : overflow ? -1 : product;
}

// The same product in floating point, for messages.
inline double product_of(std::initializer_list<std::int64_t> counts) {
  double product = 1;
  for (const std::int64_t c : counts) product *= static_cast<double>(c);
  return product;
}

inline std::string dims_string(const std::int64_t* dims, int n) {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < n; ++d) os << (d ? ", " : "") << dims[d];
  os << ']';
  return os.str();
}

// A view and the name messages give it.
struct NamedView {
  const TensorView* view;
  const char* name;
};

inline std::string range_string(const TensorView& t) {
  const ByteRange r = byte_range(t);
  std::ostringstream os;
  os << "bytes [0x" << std::hex << r.begin << ", 0x" << r.end << ')';
  return os.str();
}

class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(std::string(op_) + ": " + what);
  }
  [[noreturn]] void unsupported(const std::string& what) const {
    throw Unsupported(std::string(op_) + ": " + what);
  }

  // Structure every view must have: rank, non-negative sizes and strides, an element count and
  // an address range that fit in int64, data unless empty (a unit last stride is checked
  // apart, where a kernel needs one: unit_last_stride).
  void view(const TensorView& t, const char* name, int rank, const char* layout) const {
    if (t.rank != rank) {
      fail(std::string(name) + " has the wrong rank (rank=" + std::to_string(t.rank) +
           ", expected " + std::to_string(rank) + ": " + layout + ")");
    }
    structure(t, name);
  }

  void structure(const TensorView& t, const char* name) const {
    if (t.rank < 0 || t.rank > kMaxRank) {
      fail(std::string(name) + " has an invalid rank (rank=" + std::to_string(t.rank) +
           ", expected 0.." + std::to_string(kMaxRank) + ")");
    }
    if (static_cast<unsigned>(t.dtype) > static_cast<unsigned>(DType::i32)) {
      fail(std::string(name) + " has an invalid dtype (dtype=" +
           std::to_string(static_cast<unsigned>(t.dtype)) + ", expected a DType value)");
    }
    for (int d = 0; d < t.rank; ++d) {
      if (t.size(d) < 0) {
        fail(std::string(name) + " has a negative size (shape=" + t.shape_string() +
             ", expected sizes >= 0)");
      }
      if (t.stride_of(d) < 0) {
        fail(std::string(name) + " has a negative stride (stride[" + std::to_string(d) +
             "]=" + std::to_string(t.stride_of(d)) + ", expected >= 0)");
      }
    }
    const std::int64_t n = t.numel();
    if (n < 0) {
      fail(std::string(name) + " has too many elements (shape=" + t.shape_string() +
           ", expected an element count that fits in int64)");
    }
    if (n == 0) return;
    // The last element's offset, and its byte offset, must fit in int64.
    std::int64_t extent = 0;
    for (int d = 0; d < t.rank; ++d) {
      const std::int64_t span = t.size(d) - 1;
      if (span > 0 && t.stride_of(d) > (INT64_MAX - extent) / span) {
        fail(std::string(name) + " spans too much memory (shape=" + t.shape_string() +
             ", expected strides whose extent fits in int64)");
      }
      extent += span * t.stride_of(d);
    }
    if (extent > INT64_MAX / 8) {
      fail(std::string(name) + " spans too much memory (extent=" + std::to_string(extent) +
           " elements, expected < 2^60)");
    }
    if (t.data == nullptr && t.rank == 0) {  // a default TensorView: nothing was passed
      fail(std::string(name) + " is not given (rank=0 with null data, expected a tensor)");
    }
    if (t.data == nullptr) {
      fail(std::string(name) + " has null data with non-zero size (shape=" + t.shape_string() +
           ", expected a valid pointer)");
    }
    // Elements at addresses that are multiples of their size: the checks and kernels read them
    // as their type (a misaligned float read is undefined behaviour).
    const auto first = reinterpret_cast<std::uintptr_t>(t.data);
    const auto item = static_cast<std::uintptr_t>(size_of(t.dtype));
    if (first % item != 0) {
      fail(std::string(name) + " is not aligned to its element size (address % " +
           std::to_string(item) + "=" + std::to_string(first % item) +
           ", expected 0); copy it to an aligned buffer");
    }
    // Its last byte's address must not wrap around the address space.
    const auto bytes =
        static_cast<std::uintptr_t>((extent + 1) * static_cast<std::int64_t>(size_of(t.dtype)));
    if (first + bytes < first) {
      fail(std::string(name) + " spans past the end of the address space (shape=" +
           t.shape_string() + ", expected memory the process can address)");
    }
  }

  // Strides of an empty view address nothing (numpy gives them all 0), so neither check below
  // applies to one.
  void unit_last_stride(const TensorView& t, const char* name) const {
    if (t.numel() == 0) return;
    if (t.rank > 0 && t.size(t.rank - 1) > 1 && t.stride_of(t.rank - 1) != 1) {
      fail(std::string(name) + " has a non-unit last stride (stride[" + std::to_string(t.rank - 1) +
           "]=" + std::to_string(t.stride_of(t.rank - 1)) +
           ", expected 1); make the head dimension contiguous");
    }
  }

  // An output may not map two elements to one address: through a zero stride, or strides that
  // make elements coincide.
  void writable(const TensorView& t, const char* name) const {
    if (t.numel() == 0) return;
    for (int d = 0; d < t.rank; ++d) {
      if (t.size(d) > 1 && t.stride_of(d) == 0) {
        fail(std::string(name) + " is an output with a zero stride (stride[" + std::to_string(d) +
             "]=0, expected > 0 on dims of size > 1)");
      }
    }
    if (self_overlapping(t)) {
      fail(std::string(name) + " is an output whose elements overlap (shape=" + t.shape_string() +
           ", strides=" + dims_string(t.stride.data(), t.rank) +
           ", expected each element at its own address)");
    }
  }

  void dtype(const TensorView& t, const char* name, DType expected, const char* like) const {
    if (t.dtype != expected) {
      fail(std::string(name) + " has the wrong dtype (dtype=" + std::string(name_of(t.dtype)) +
           ", expected " + std::string(name_of(expected)) + like + ")");
    }
  }

  void shape(const TensorView& t, const char* name, const std::int64_t* expected,
             const char* layout, const std::string& detail = "") const {
    for (int d = 0; d < t.rank; ++d) {
      if (t.size(d) != expected[d]) {
        fail(std::string(name) + " has shape " + t.shape_string() + ", expected " +
             dims_string(expected, t.rank) + " (" + layout + ")" + detail);
      }
    }
  }

  // A count the call forms from its sizes (`formula` = the product of `factors`) must fit in
  // int64: the element count of an output it allocates, or the (query, key) pairs it computes.
  void count(const std::string& what, const char* formula,
             std::initializer_list<std::int64_t> factors) const {
    if (product_or_negative(factors) < 0) {
      fail(what + " (" + formula + "=" + fmt_double(product_of(factors)) + ", expected < 2^63)");
    }
  }

  // No output may share a byte with another output or with an input (views_overlap: exact, so
  // that outputs interleaved in one buffer, as dq, dk, dv in a packed [total, 3, H, D] buffer,
  // are accepted; conservative only where strides interleave with no common structure). Views
  // with null data (an LSE not asked for) take no part.
  void separate(std::initializer_list<NamedView> outputs,
                std::initializer_list<NamedView> inputs) const {
    for (auto out = outputs.begin(); out != outputs.end(); ++out) {
      for (auto other = outputs.begin(); other != out; ++other) disjoint(*out, *other);
      for (const NamedView& in : inputs) disjoint(*out, in);
    }
  }

  // A thread count: 0 (the default) to kMaxThreads.
  void threads(int num_threads) const {
    if (num_threads < 0) {
      fail("num_threads is negative (num_threads=" + std::to_string(num_threads) +
           ", expected >= 0; 0 = default)");
    }
    if (num_threads > kMaxThreads) {
      fail("num_threads is too large (num_threads=" + std::to_string(num_threads) +
           ", expected <= " + std::to_string(kMaxThreads) + ", attncore::kMaxThreads)");
    }
  }

  void splits(int num_splits) const {
    if (num_splits < 0 || num_splits > kMaxSplits) {
      fail("num_splits is out of range (num_splits=" + std::to_string(num_splits) +
           ", expected 0 to " + std::to_string(kMaxSplits) +
           ", attncore::kMaxSplits; 0 = planned, 1 = no split)");
    }
  }

  void backend(Backend b) const {
    if (static_cast<unsigned>(b) > static_cast<unsigned>(Backend::flash)) {
      unsupported("backend is not available in this build (backend=" +
                  std::to_string(static_cast<unsigned>(b)) +
                  ", expected auto, reference, math or flash)");
    }
  }

  void floating_query(const TensorView& q) const {
    if (!is_floating(q.dtype)) {
      fail("query has an unsupported dtype (dtype=" + std::string(name_of(q.dtype)) +
           ", expected f32, f64, bf16 or f16)");
    }
  }

  // q, k, v of one floating dtype, head dims contiguous.
  void inputs(const TensorView& q, const TensorView& k, const TensorView& v) const {
    floating_query(q);
    dtype(k, "key", q.dtype, " like query");
    dtype(v, "value", q.dtype, " like query");
    unit_last_stride(q, "query");
    unit_last_stride(k, "key");
    unit_last_stride(v, "value");
  }

  // Head dims and query heads of p (set from q and v) are at least 1.
  void dims(const Params& p) const {
    if (p.head_dim < 1) fail("query has head dim 0 (D=0, expected D >= 1)");
    if (p.head_dim_v < 1) fail("value has head dim 0 (Dv=0, expected Dv >= 1)");
    if (p.heads_q < 1) fail("query has no heads (Hq=0, expected Hq >= 1)");
  }

  // Fewer kv heads than query heads needs GQA enabled; sets p.group (Hq % Hkv == 0 checked).
  void group(Params& p, const Options& o) const {
    if (!o.enable_gqa && p.heads_kv != p.heads_q) {
      fail("key has fewer heads than query without GQA (Hkv=" + std::to_string(p.heads_kv) +
           ", expected Hkv == Hq=" + std::to_string(p.heads_q) + "); set enable_gqa");
    }
    p.group = p.heads_q / p.heads_kv;
  }

 private:
  void disjoint(const NamedView& out, const NamedView& other) const {
    if (out.view == nullptr || other.view == nullptr || !views_overlap(*out.view, *other.view)) {
      return;
    }
    fail(std::string(out.name) + " overlaps " + other.name + " (" + out.name + "=" +
         range_string(*out.view) + ", " + other.name + "=" + range_string(*other.view) +
         ", expected no byte in common); an output may share memory with no other output and "
         "no input");
  }

  const char* op_;
};

// The views of the options, as inputs for Checker::separate (null when not given).
inline NamedView alibi_view(const Options& o) {
  return {o.alibi_slopes ? &*o.alibi_slopes : nullptr, "alibi_slopes"};
}
inline NamedView mask_view(const Options& o) { return {o.mask ? &*o.mask : nullptr, "mask"}; }

// Checks of the options, the same for dense and varlen calls; fills p's variant and dropout
// (p's geometry and sequence info are set). validate.cpp.
void resolve_variant(const Checker& check, const Options& o, Params& p);

// Page pools (a paged KV cache, a varlen call over pages; validate_kvcache.cpp). The dtype of K
// and V (named k_name, v_name): q's, or bf16 / f16 under an f32 query (docs/design.md section
// 1.10); K and V share it.
DType cache_dtype(const Checker& check, const TensorView& q, const TensorView& k,
                  const TensorView& v, const char* k_name, const char* v_name);
// The block table: int32 [B, pages per sequence], unit inner stride, over pages of page_size >=
// 1 slots (else the pool, named `pool`, of shape pool_shape, is refused in its layout); sets
// seq's block table fields. Its values are checked per sequence (check_pages).
void block_table_of(const Checker& check, const TensorView& t, std::int64_t batch,
                    std::int64_t page_size, const char* pool, const std::string& pool_shape,
                    const char* pool_layout, SeqInfo& seq);
// Every page sequence b uses (slots [start, end)) is a page of the pool (named `pool` in the
// message: "cache", "pool").
void check_pages(const Checker& check, const SeqInfo& seq, std::int64_t b, std::int64_t start,
                 std::int64_t end, std::int64_t num_pages, const char* pool);

}  // namespace attncore::detail
