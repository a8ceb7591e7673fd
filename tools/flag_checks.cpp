// The combinations of flags a command refuses as bad usage (UsageError), checked once the flag
// table (flags.cpp) has read the command line.
#include "flag_checks.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "commands.h"

namespace attncore_tools {

namespace {
constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
}  // namespace

bool given(const GivenFlags& flags, std::string_view name) {
  return std::find(flags.begin(), flags.end(), name) != flags.end();
}

void check_varlen_flags(const RunConfig& c, const GivenFlags& flags) {
  for (const char* name : {"--varlen-k", "--seqused-k"}) {
    if (!c.is_varlen() && given(flags, name)) {
      throw UsageError{std::string(name) + " needs --varlen"};
    }
  }
  if (!c.is_varlen()) return;
  for (const char* name : {"--seqlen-q", "--seqlen-k", "--batch"}) {
    if (given(flags, name)) {
      throw UsageError{std::string(name) + " does not go with --varlen (" +
                       (std::string(name) == "--batch"
                            ? "B is the number of --varlen lengths)"
                            : "the lengths come from --varlen and --varlen-k)")};
    }
  }
  const std::size_t n = c.varlen.size();
  auto same_count = [&](const char* name, const std::vector<std::int64_t>& lengths) {
    if (!lengths.empty() && lengths.size() != n) {
      throw UsageError{std::string(name) + " gives " + std::to_string(lengths.size()) +
                       (lengths.size() == 1 ? " length" : " lengths") + ", expected " +
                       std::to_string(n) + " (one per sequence of --varlen)"};
    }
  };
  same_count("--varlen-k", c.varlen_k);
  same_count("--seqused-k", c.seqused_k);
  // cu_seqlens are int32: the packed rows must fit. Each length is bounded before it is added,
  // so that the sum stays far from int64 overflow.
  auto fits = [](const char* name, const std::vector<std::int64_t>& lengths) {
    std::int64_t total = 0;
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      const std::int64_t x = lengths[b];
      if (x > kInt32Max) {
        throw UsageError{std::string(name) + ": a length is too large (" + name + "[" +
                         std::to_string(b) + "]=" + std::to_string(x) +
                         ", expected <= " + std::to_string(kInt32Max) + ": cu_seqlens are int32)"};
      }
      total += x;
      if (total > kInt32Max) {
        throw UsageError{std::string(name) + ": the lengths add up past 2^31 - 1 (sum of " + name +
                         "[0.." + std::to_string(b) + "]=" + std::to_string(total) +
                         ", expected <= " + std::to_string(kInt32Max) + ": cu_seqlens are int32)"};
      }
    }
  };
  fits("--varlen", c.varlen);
  fits("--varlen-k", c.varlen_k);
  fits("--seqused-k", c.seqused_k);
}

void check_simd_flag(const RunConfig& c) {
  // A name no build has is a bad flag; one this build has but this CPU cannot run is the
  // library's to refuse (set_simd_target), as a run-time error.
  const std::vector<std::string> known = attncore::simd_targets_compiled();
  if (!c.simd.empty() && std::find(known.begin(), known.end(), c.simd) == known.end()) {
    std::string names;
    for (const std::string& name : known) names += (names.empty() ? "" : ", ") + name;
    throw UsageError{"--simd: unknown target '" + c.simd + "' (expected one of " + names +
                     " compiled into this build)"};
  }
}

void check_cache_flags(const RunConfig& c, const GivenFlags& flags) {
  if (!c.is_cache() && given(flags, "--new-tokens")) {
    throw UsageError{"--new-tokens needs --cache-len"};
  }
  for (const char* name : {"--page-size", "--pages-in-order"}) {
    if (!c.is_cache() && !c.is_varlen() && given(flags, name)) {
      throw UsageError{std::string(name) + " needs --cache-len or --varlen"};
    }
  }
  if (c.is_varlen() && c.page_size > 0) {  // the varlen keys in pages (int32 entries)
    if (given(flags, "--backward")) {
      throw UsageError{
          "--backward does not go with --varlen and --page-size (attention over "
          "page pools is forward only)"};
    }
    const std::vector<std::int64_t>& keys = !c.seqused_k.empty()  ? c.seqused_k
                                            : !c.varlen_k.empty() ? c.varlen_k
                                                                  : c.varlen;
    double pages = 0;
    for (std::int64_t n : keys) pages += static_cast<double>(pages_per_sequence(n, c.page_size));
    if (pages > kInt32Max) {
      throw UsageError{
          "--page-size: the pages of the batch pass 2^31 - 1 (block_table entries are "
          "int32)"};
    }
  }
  if (c.pages_in_order && c.page_size == 0) {
    throw UsageError{"--pages-in-order needs --page-size P > 0 (a dense cache has no pages)"};
  }
  if (!c.is_cache()) return;
  for (const char* name : {"--seqlen-q", "--seqlen-k", "--varlen", "--backward"}) {
    if (given(flags, name)) {
      throw UsageError{std::string(name) + " does not go with --cache-len (" +
                       (std::string(name) == "--backward"
                            ? "attention over a KV cache is forward only)"
                            : "the lengths come from --cache-len and --new-tokens)")};
    }
  }
  // Both are >= 0 (the flag table's minimum); each is bounded before their sum is formed.
  if (c.cache_len > kInt32Max || c.new_tokens > kInt32Max - c.cache_len) {
    throw UsageError{"--cache-len: cache_len + new_tokens is too large (cache_len=" +
                     std::to_string(c.cache_len) + ", new_tokens=" + std::to_string(c.new_tokens) +
                     ", expected cache_len + new_tokens <= " + std::to_string(kInt32Max) +
                     ": cache_seqlens are int32)"};
  }
  // Page numbers (the batch's pages) are int32 too; page_size up to 2^63 - 1 must not overflow.
  const std::int64_t pages = pages_per_sequence(c.cache_len + c.new_tokens, c.page_size);
  if (static_cast<double>(c.batch) * static_cast<double>(pages) > kInt32Max) {
    throw UsageError{
        "--page-size: the pages of the batch pass 2^31 - 1 (block_table entries are "
        "int32)"};
  }
}

void check_bench_mode_flags(const GivenFlags& flags) {
  struct Mode {
    const char* name;
    std::vector<const char*> ignored;  // flags the mode has nothing to act on
  };
  const Mode modes[] = {
      {"--select",
       {"--varlen", "--decode", "--batch", "--heads-q", "--heads-kv", "--head-dim", "--seqlens",
        "--dtypes", "--causal", "--csv", "--json", "--png"}},
      {"--varlen", {"--decode", "--batch", "--seqlens", "--passes", "--csv", "--png"}},
      {"--decode",
       {"--batch", "--heads-q", "--heads-kv", "--head-dim", "--seqlens", "--dtypes", "--causal",
        "--backward", "--csv", "--png"}},
  };
  const Mode* mode = nullptr;
  for (const Mode& m : modes) {
    if (!given(flags, m.name)) continue;
    if (mode == nullptr) mode = &m;
    for (const char* name : m.ignored) {
      if (given(flags, name)) throw UsageError{std::string(name) + " does not go with " + m.name};
    }
  }
  const bool decode = mode != nullptr && std::string_view(mode->name) == "--decode";
  for (const char* name : {"--quick", "--max-kv-gib", "--points"}) {
    if (!decode && given(flags, name)) throw UsageError{std::string(name) + " needs --decode"};
  }
  if (mode == nullptr && given(flags, "--passes")) {
    throw UsageError{"--passes needs --select or --decode"};
  }
}

}  // namespace attncore_tools
