// What the command files share: exit codes, the two errors that map to them, and the commands'
// entry points (one file each: cmd_default.cpp, cmd_info.cpp, cmd_run.cpp, cmd_explain.cpp,
// cmd_bench.cpp).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace attncore_tools {

// Exit codes (docs/design.md section 7).
constexpr int kExitOk = 0;
constexpr int kExitLibraryError = 1;
constexpr int kExitUsage = 2;

// A command line the program cannot run: reported with a line on where the flags are listed,
// exit code 2.
struct UsageError {
  std::string message;
};

// Failed self-checks in the default sweep: exit code 1 (the library computed a wrong result).
struct CheckFailed {
  std::string message;
};

// `args` are the arguments after the command's name.
int cmd_default();
int cmd_info(const std::vector<std::string>& args);
int cmd_run(const std::vector<std::string>& args);
int cmd_explain(const std::vector<std::string>& args);
int cmd_bench(const std::vector<std::string>& args);
// bench --decode (cmd_bench_decode.cpp), and the check of its --points at parse time (bad
// usage names the first bad item).
struct BenchConfig;
int bench_decode(const BenchConfig& bc);
void check_decode_points(const std::string& points);
// bench's JSON object into `file` ("-": standard output, print_json_object), cmd_bench.cpp.
class JsonObject;
void write_json_object(const std::string& file, const JsonObject& j);

// One number through a printf format ("%.0e").
inline std::string format(const char* fmt, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

}  // namespace attncore_tools
