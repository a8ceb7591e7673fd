// The command line of `run`, `explain` and `bench`: one table of flags (flags.cpp) parses them
// into a RunConfig or BenchConfig and generates the usage texts.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "run_config.h"

namespace attncore_tools {

// The parts of `text` between the separators: "a,,b" gives "a", "", "b"; "" gives "".
std::vector<std::string_view> split(std::string_view text, char separator);

// Whether the arguments of `run` or `explain` (run's flags), or of `bench`, ask for the command's
// usage text: a --help or -h that is no flag's value ("--cache-len -h" gives "-h" to --cache-len,
// which refuses it as bad usage).
bool asks_for_run_help(const std::vector<std::string>& args);
bool asks_for_bench_help(const std::vector<std::string>& args);

// The flags of `run` and `explain`; the config comes back finished (RunConfig::finish).
RunConfig parse_run_flags(const std::vector<std::string>& args);
// The flags of `bench`; its run config comes back finished.
BenchConfig parse_bench_flags(const std::vector<std::string>& args);

// The commands and run's flags: `attncore --help`, `run --help`, `explain --help`, and the text
// after a usage error.
const std::string& usage_text();
// `bench --help`.
const std::string& bench_usage_text();

}  // namespace attncore_tools
