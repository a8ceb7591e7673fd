// The options of one call as the attncore package passes them to attncore._core, and the
// names it passes (causal, backend), read into the library's terms with the package's messages.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "attncore/attncore.h"
#include "borrowed.h"

namespace attncore_python {

// A causal alignment by its name ('none', 'upper-left', 'lower-right').
inline attncore::Causal causal_from_name(const char* op, const std::string& name) {
  for (auto c :
       {attncore::Causal::none, attncore::Causal::upper_left, attncore::Causal::lower_right}) {
    if (attncore::name_of(c) == name) return c;
  }
  throw attncore::InvalidArgument(std::string(op) + ": causal is invalid (causal='" + name +
                                  "', expected 'none', 'upper-left' or 'lower-right')");
}

// The library's backend_from_name, with the package's message.
inline attncore::Backend backend_from_name(const char* op, const std::string& name) {
  try {
    return attncore::backend_from_name(name);
  } catch (const attncore::InvalidArgument&) {
    throw attncore::InvalidArgument(std::string(op) + ": backend is invalid (backend='" + name +
                                    "', expected 'auto', 'reference', 'math' or 'flash')");
  }
}

// The options of one call, as the package passes them (keyword arguments of both functions).
struct CallOptions {
  std::optional<double> scale;
  std::string causal;
  std::int64_t window_left, window_right;
  double softcap, dropout_p;
  std::uint64_t seed, offset;
  bool enable_gqa;
  int num_threads;
  std::string backend;
  int num_splits = 0;  // flash's split-KV decode (attncore::Options::num_splits)

  attncore::Options options(const char* op, const std::optional<Borrowed>& mask,
                            const std::optional<Borrowed>& alibi, bool compute_dbias) const {
    attncore::Options o;
    o.scale = scale;
    o.causal = causal_from_name(op, causal);
    o.window_left = window_left;
    o.window_right = window_right;
    o.softcap = softcap;
    o.alibi_slopes = view_of(alibi);
    o.mask = view_of(mask);
    o.compute_dbias = compute_dbias;
    o.dropout_p = dropout_p;
    o.seed = seed;
    o.offset = offset;
    o.enable_gqa = enable_gqa;
    o.num_threads = num_threads;
    o.num_splits = num_splits;
    return o;
  }
};

// The fast paths' options (attend, attend_kvcache), read only where they are of plain Python
// types; anything else (nullopt) sends the call to the package's general path, which checks it.
// A Python float or int (not bool) as a double.
inline std::optional<double> plain_number(py::handle x) {
  if (PyFloat_CheckExact(x.ptr())) return PyFloat_AS_DOUBLE(x.ptr());
  if (PyLong_CheckExact(x.ptr())) {
    const double value = PyLong_AsDouble(x.ptr());
    if (value == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return std::nullopt;
    }
    return value;
  }
  return std::nullopt;
}
// A Python int (not bool) within [lo, hi].
inline std::optional<std::int64_t> plain_int(py::handle x, std::int64_t lo, std::int64_t hi) {
  if (!PyLong_CheckExact(x.ptr())) return std::nullopt;
  const long long value = PyLong_AsLongLong(x.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return std::nullopt;
  }
  if (value < lo || value > hi) return std::nullopt;
  return value;
}
// (left, right) of a window_size given as a tuple of two Python ints (the library checks their
// values).
inline std::optional<std::pair<std::int64_t, std::int64_t>> plain_window(py::handle x) {
  if (!PyTuple_CheckExact(x.ptr()) || PyTuple_GET_SIZE(x.ptr()) != 2) return std::nullopt;
  const auto left = plain_int(PyTuple_GET_ITEM(x.ptr(), 0), INT64_MIN, INT64_MAX);
  const auto right = plain_int(PyTuple_GET_ITEM(x.ptr(), 1), INT64_MIN, INT64_MAX);
  if (!left || !right) return std::nullopt;
  return std::make_pair(*left, *right);
}

// A backend given as None (automatic) or a name.
inline std::optional<attncore::Backend> plain_backend(py::handle x) {
  if (x.is_none()) return attncore::Backend::automatic;
  if (!PyUnicode_CheckExact(x.ptr())) return std::nullopt;
  Py_ssize_t size = 0;
  const char* name = PyUnicode_AsUTF8AndSize(x.ptr(), &size);  // (null: not UTF-8)
  if (name == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  try {
    return attncore::backend_from_name(std::string(name, static_cast<std::size_t>(size)));
  } catch (const attncore::InvalidArgument&) {
    return std::nullopt;
  }
}

// The options of a flash-attn call on its fast path (attend_varlen, attend_kvcache) into
// `options`: softmax_scale None or a finite number > 0, causal a bool (lower-right), window_size
// a tuple of two ints from -1 on, softcap a number (<= 0: off), backend None or a name (into
// `chosen`). false for anything else: the general path reads it, or names what is wrong.
inline bool plain_flash_options(py::handle softmax_scale, py::handle causal, py::handle window_size,
                                py::handle softcap, py::handle backend, attncore::Options& options,
                                attncore::Backend& chosen) {
  if (!softmax_scale.is_none()) {
    const auto s = plain_number(softmax_scale);
    if (!s || !(*s > 0) || !std::isfinite(*s)) return false;
    options.scale = *s;
  }
  if (causal.ptr() != Py_True && causal.ptr() != Py_False) return false;
  options.causal = causal.ptr() == Py_True ? attncore::Causal::lower_right : attncore::Causal::none;
  const auto window = plain_window(window_size);
  const auto cap = plain_number(softcap);
  const auto named = plain_backend(backend);
  if (!window || window->first < -1 || window->second < -1 || !cap || std::isnan(*cap) || !named)
    return false;
  options.window_left = window->first;
  options.window_right = window->second;
  options.softcap = *cap > 0 ? *cap : 0.0;
  chosen = *named;
  return true;
}

// A value dtype the fast paths take from arrays of `kind` (bf16 from torch only: numpy has none).
inline bool plain_value_dtype(attncore::DType dtype, ArrayKind kind) {
  using attncore::DType;
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 ||
         (dtype == DType::bf16 && kind == ArrayKind::torch);
}
// Whether a view's last dim has unit stride (or at most one element; rank 0: no dim).
inline bool unit_last_stride(const attncore::TensorView& x) {
  return x.rank == 0 || x.size(x.rank - 1) <= 1 || x.stride_of(x.rank - 1) == 1;
}
// The LSE's dtype for values of `dtype`: float64 for float64, else float32.
inline attncore::DType lse_dtype_of(attncore::DType dtype) {
  return dtype == attncore::DType::f64 ? dtype : attncore::DType::f32;
}

// The fast paths' outputs: `rows` rows of dim_v elements of `dtype`, and with_lse one LSE per
// row (lse_dtype_of). Past the memory this process may use (a broadcast
// query stands for any number of rows at no cost): false, and the general path refuses them
// (MemoryError, before anything else, as its outputs' check comes first). Outputs of 1 MiB or
// more are made only for a call whose arguments pass the library's checks, a backend it names
// among them (`check`: the library's explain of the call, 0.7 us on the Intel Xeon, against tens
// of us or more for any call with 1 MiB of outputs; smaller ones are made first, at no cost worth
// a check).
template <class Check>
bool outputs_may_be_made(double rows, std::int64_t dim_v, attncore::DType dtype, bool with_lse,
                         Check&& check) {
  const double bytes =
      rows * (static_cast<double>(dim_v) * static_cast<double>(attncore::size_of(dtype)) +
              (with_lse ? static_cast<double>(attncore::size_of(lse_dtype_of(dtype))) : 0.0));
  if (bytes < static_cast<double>(1 << 20)) return true;
  if (bytes > attncore::memory_limit().bytes) return false;
  check();
  return true;
}

}  // namespace attncore_python
