// merge_attention_states (attncore/merge.h): validation, then every row of the outputs merged
// by policy/softmax_state.h's merge_outputs, in blocks of rows with the cancel flag read
// before each.
#include "attncore/merge.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <optional>
#include <string>

#include "attncore/error.h"
#include "core/convert.h"
#include "core/cpu_info.h"
#include "core/exit_guard.h"
#include "core/params.h"
#include "core/threadpool.h"
#include "core/validate_checks.h"
#include "policy/softmax_state.h"

namespace attncore {

namespace {

using detail::Checker;
using detail::Launch;
using detail::load_element;
using detail::load_row;
using detail::parallel_for;
using detail::store_element;
using detail::store_row;

// The offset of row `row` (row-major over the first `rank` dims of `shape`) in a view.
std::int64_t row_offset(const TensorView& t, const std::array<std::int64_t, kMaxRank>& shape,
                        int rank, std::int64_t row) {
  std::int64_t offset = 0;
  for (int d = rank - 1; d >= 0; --d) {
    const std::int64_t n = shape[static_cast<std::size_t>(d)];
    offset += (row % n) * t.stride_of(d);
    row /= n;
  }
  return offset;
}

bool same_view(const TensorView& x, const TensorView& y) {
  if (x.data != y.data || x.dtype != y.dtype || x.rank != y.rank) return false;
  for (int d = 0; d < x.rank; ++d) {
    if (x.size(d) != y.size(d) || (x.size(d) > 1 && x.stride_of(d) != y.stride_of(d))) return false;
  }
  return true;
}

// out and lse share no byte with each other or with an input, except that each may be the very
// view of its own kind on side a or b (merge.h: each row is read before it is written; a
// view shifted by a row would be read after being written).
void separate(const Checker& check, const TensorView& out_a, const TensorView& lse_a,
              const TensorView& out_b, const TensorView& lse_b, const TensorView& out,
              const TensorView& lse) {
  check.separate({{&out, "out"}, {&lse, "lse"}}, {});
  const detail::NamedView outs[2] = {{&out_a, "out_a"}, {&out_b, "out_b"}};
  const detail::NamedView lses[2] = {{&lse_a, "lse_a"}, {&lse_b, "lse_b"}};
  for (int side = 0; side < 2; ++side) {
    if (!same_view(out, *outs[side].view)) check.separate({{&out, "out"}}, {outs[side]});
    check.separate({{&out, "out"}}, {lses[side]});
    if (!same_view(lse, *lses[side].view)) check.separate({{&lse, "lse"}}, {lses[side]});
    check.separate({{&lse, "lse"}}, {outs[side]});
  }
}

// Checks the six views; returns the number of rows (the LSE's elements).
std::int64_t validate(const Checker& check, const TensorView& out_a, const TensorView& lse_a,
                      const TensorView& out_b, const TensorView& lse_b, const TensorView* out,
                      const TensorView* lse, int num_threads) {
  check.structure(out_a, "out_a");
  if (out_a.rank < 1) {
    check.fail("out_a has the wrong rank (rank=0, expected >= 1: [..., Dv])");
  }
  if (!is_floating(out_a.dtype)) {
    check.fail("out_a has an unsupported dtype (dtype=" + std::string(name_of(out_a.dtype)) +
               ", expected f32, f64, bf16 or f16)");
  }
  const DType lse_dtype = out_a.dtype == DType::f64 ? DType::f64 : DType::f32;
  const int rank = out_a.rank;
  auto like_out = [&](const TensorView& t, const char* name) {
    check.view(t, name, rank, "like out_a");
    check.dtype(t, name, out_a.dtype, " like out_a");
    check.shape(t, name, out_a.shape.data(), "like out_a");
  };
  auto like_lse = [&](const TensorView& t, const char* name) {
    check.view(t, name, rank - 1, "out_a's shape without its last dim");
    check.dtype(t, name, lse_dtype, " (f64 only for f64 outputs)");
    check.shape(t, name, out_a.shape.data(), "out_a's shape without its last dim");
  };
  like_lse(lse_a, "lse_a");
  like_out(out_b, "out_b");
  like_lse(lse_b, "lse_b");
  if (out != nullptr) {
    like_out(*out, "out");
    check.writable(*out, "out");
    like_lse(*lse, "lse");
    check.writable(*lse, "lse");
    separate(check, out_a, lse_a, out_b, lse_b, *out, *lse);
  }
  check.threads(num_threads);
  std::int64_t rows = 1;
  for (int d = 0; d + 1 < rank; ++d) rows *= out_a.size(d);
  return rows;
}

// Rows merged between two reads of the cancel flag: a few hundred microseconds of work for
// Dv = 128 (2^22 rows of Dv = 128 merged in ~3 s on one thread: ~0.7 us a row).
constexpr std::int64_t kCancelRows = 512;

// Columns merged at a time (each column is merged by itself given the row's two LSEs): the
// scratch of a thread stays 3 * 1024 values whatever Dv, which the caller's views alone bound.
constexpr std::int64_t kChunk = 1024;

template <class T>
void merge_rows(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                const TensorView& lse_b, const TensorView& out, const TensorView& lse,
                std::int64_t rows, const Launch& launch) {
  const int rank = out_a.rank;
  const std::int64_t dv = out_a.size(rank - 1);
  const std::int64_t a_step = out_a.stride_of(rank - 1), b_step = out_b.stride_of(rank - 1),
                     out_step = out.stride_of(rank - 1);  // (any: a row is read element-wise)
  parallel_for(rows, launch.threads, [&](std::int64_t begin, std::int64_t end) {
    T a[kChunk], b[kChunk], merged[kChunk];  // a row's columns [e0, e0 + kChunk)
    for (std::int64_t row = begin; row < end; ++row) {
      if ((row - begin) % kCancelRows == 0) launch.check_cancel();
      const std::int64_t at_a = row_offset(out_a, out_a.shape, rank - 1, row),
                         at_b = row_offset(out_b, out_a.shape, rank - 1, row),
                         at_out = row_offset(out, out_a.shape, rank - 1, row);
      const T la =
          load_element<T>(lse_a.data, lse_a.dtype, row_offset(lse_a, out_a.shape, rank - 1, row));
      const T lb =
          load_element<T>(lse_b.data, lse_b.dtype, row_offset(lse_b, out_a.shape, rank - 1, row));
      T l = 0;
      for (std::int64_t e0 = 0; e0 == 0 || e0 < dv; e0 += kChunk) {  // (Dv = 0: the LSEs alone)
        const std::int64_t n = std::min(kChunk, dv - e0);
        load_row(out_a.data, out_a.dtype, at_a + e0 * a_step, n, a, a_step);
        load_row(out_b.data, out_b.dtype, at_b + e0 * b_step, n, b, b_step);
        l = detail::merge_outputs(a, la, b, lb, n, merged);
        store_row(merged, n, out.data, out.dtype, at_out + e0 * out_step, out_step);
      }
      store_element(lse.data, lse.dtype, row_offset(lse, out_a.shape, rank - 1, row), l);
    }
  });
}

// Counted as a run in flight (core/exit_guard.h: a merge on a thread still running at exit
// stops at its next block and parks); a cancelled merge throws Cancelled.
void run(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
         const TensorView& lse_b, const TensorView& out, const TensorView& lse, std::int64_t rows,
         int num_threads, const std::atomic<bool>* cancel) {
  Launch launch;
  launch.threads = detail::resolve_threads(num_threads, "merge_attention_states");
  launch.cancel = cancel;
  if (launch.cancelled()) {  // (as the attention calls: read once before anything is written)
    throw Cancelled(detail::cancelled_message("merge_attention_states", /*started=*/false));
  }
  detail::run_in_flight([&] {
    try {
      if (out_a.dtype == DType::f64) {
        merge_rows<double>(out_a, lse_a, out_b, lse_b, out, lse, rows, launch);
      } else {
        merge_rows<float>(out_a, lse_a, out_b, lse_b, out, lse, rows, launch);
      }
    } catch (const detail::CancelledWork&) {
      throw Cancelled(detail::cancelled_message("merge_attention_states"));
    }
  });
}

}  // namespace

void merge_attention_states_into(const TensorView& out_a, const TensorView& lse_a,
                                 const TensorView& out_b, const TensorView& lse_b,
                                 const TensorView& out, const TensorView& lse, int num_threads,
                                 const std::atomic<bool>* cancel) {
  const Checker check("merge_attention_states");
  const std::int64_t rows = validate(check, out_a, lse_a, out_b, lse_b, &out, &lse, num_threads);
  run(out_a, lse_a, out_b, lse_b, out, lse, rows, num_threads, cancel);
}

MergeResult merge_attention_states(const TensorView& out_a, const TensorView& lse_a,
                                   const TensorView& out_b, const TensorView& lse_b,
                                   int num_threads, const std::atomic<bool>* cancel) {
  const Checker check("merge_attention_states");
  const std::int64_t rows =
      validate(check, out_a, lse_a, out_b, lse_b, nullptr, nullptr, num_threads);
  // The outputs, refused before they are allocated when the process may not hold them (a
  // broadcast out_a of absurd size costs its caller nothing).
  const DType lse_dtype = out_a.dtype == DType::f64 ? DType::f64 : DType::f32;
  const double bytes =
      static_cast<double>(rows) *
      (static_cast<double>(out_a.size(out_a.rank - 1)) * static_cast<double>(size_of(out_a.dtype)) +
       static_cast<double>(size_of(lse_dtype)));
  if (const auto limit = detail::exceeded_memory_limit(bytes)) {
    char text[160];
    std::snprintf(text, sizeof text, "(outputs=%.4g bytes, expected <= %.4g bytes, %s)", bytes,
                  limit->bytes, limit->name);
    throw OutOfMemory(std::string("merge_attention_states: the outputs exceed the memory this "
                                  "process may use ") +
                      text + "; use merge_attention_states_into");
  }
  if (cancel != nullptr && cancel->load()) {  // (read before the outputs are allocated, too)
    throw Cancelled(detail::cancelled_message("merge_attention_states", /*started=*/false));
  }
  MergeResult r;
  try {
    r.out = Tensor(out_a.dtype, out_a.shape.data(), out_a.rank);
    r.lse = Tensor(lse_dtype, out_a.shape.data(), out_a.rank - 1);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("merge_attention_states: out of memory while allocating out and lse");
  }
  run(out_a, lse_a, out_b, lse_b, r.out, r.lse, rows, num_threads, cancel);
  return r;
}

}  // namespace attncore
