// The combinations of flags a command refuses as bad usage (UsageError), checked once the flag
// table (flags.cpp) has read the command line into a config.
#pragma once

#include <string_view>
#include <vector>

#include "run_config.h"

namespace attncore_tools {

// The names of the flags a command line gave.
using GivenFlags = std::vector<std::string_view>;

bool given(const GivenFlags& flags, std::string_view name);

// The packed-batch flags of run: lists of matching lengths, and no dense lengths beside them.
void check_varlen_flags(const RunConfig& c, const GivenFlags& flags);
// The KV-cache flags of run: --new-tokens and --page-size need --cache-len, which takes the
// place of the dense lengths and of the packed batch; the cache is forward only.
void check_cache_flags(const RunConfig& c, const GivenFlags& flags);
// --simd one of the targets compiled in, refused before any work (bench measures the machine
// first). (--threads and --num-splits take the library's maximums as they are parsed.)
void check_simd_flag(const RunConfig& c);
// bench runs one of its modes (the sweep, --select, --varlen, --decode); a flag the mode given
// has nothing to act on, or a second mode, is refused rather than silently ignored.
void check_bench_mode_flags(const GivenFlags& flags);

}  // namespace attncore_tools
