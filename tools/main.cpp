// The `attncore` program: dispatch to the commands and the mapping of errors to exit codes.
//
//   attncore              a short sweep that checks every backend against the reference and
//                         times it (the default: "does this build work here, and how fast")
//   attncore --version    the version
//   attncore info         version, CPU, features, SIMD targets, threads, measured FMA peak, the
//                         cost model's constants (--json: one JSON object)
//   attncore run [flags]  one configured call: random inputs, best-of-N timing, GFLOP/s,
//                         optional check against the reference backend (--help lists flags)
//   attncore explain [flags]  the backend `auto` picks for the call the run flags describe,
//                         with every backend's verdict and the cost model's estimates
//   attncore bench [flags]  flash against math over sequence lengths; --select: auto's choice
//                         against every backend over a sweep of shapes
//
// Exit codes (docs/design.md section 7): 0 success, 1 library error (its message on stderr,
// after "attncore: "), 2 bad usage. With --json, stdout holds exactly one JSON object; diagnostics
// go to stderr.
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "flags.h"

namespace attncore_tools {
namespace {

int dispatch(const std::vector<std::string>& args) {
  if (args.empty()) return cmd_default();
  const std::string& cmd = args[0];
  if (cmd == "--version" || cmd == "version") {
    if (args.size() > 1) throw UsageError{cmd + " takes no arguments (got '" + args[1] + "')"};
    std::printf("attncore %s\n", attncore::version());
    return kExitOk;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "info") return cmd_info(rest);
  if (cmd == "run") return cmd_run(rest);
  if (cmd == "explain") return cmd_explain(rest);
  if (cmd == "bench") return cmd_bench(rest);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    std::fputs(usage_text().c_str(), stdout);
    return kExitOk;
  }
  throw UsageError{"unknown command '" + cmd + "'"};
}

}  // namespace
}  // namespace attncore_tools

int main(int argc, char** argv) {
  using namespace attncore_tools;
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return dispatch(args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "attncore: %s\n\n%s", e.message.c_str(), usage_text().c_str());
    return kExitUsage;
  } catch (const attncore::Error& e) {
    std::fprintf(stderr, "attncore: %s\n", e.what());
    return kExitLibraryError;
  } catch (const CheckFailed& e) {
    std::fprintf(stderr, "attncore: %s\n", e.message.c_str());
    return kExitLibraryError;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "attncore: out of memory\n");
    return kExitLibraryError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attncore: %s\n", e.what());
    return kExitLibraryError;
  }
}
