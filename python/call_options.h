// The options of one call as the attncore package passes them to attncore._core, and the
// names it passes (causal, backend), read into the library's terms with the package's messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

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

}  // namespace attncore_python
