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
// after "attncore: "; also a failed check, and an output file or standard output that cannot be
// written), 2 bad usage. When a command's output is JSON on stdout (run, explain and info
// --json, bench --json -), stdout holds exactly one JSON object, also when the command fails
// (then with an `error` field); diagnostics go to stderr.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "flags.h"
#include "json.h"

namespace attncore_tools {
namespace {

bool json_printed = false;  // print_json_object has run

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

// Whether the command's output is one JSON object on standard output: run, explain and info
// with --json, bench with --json - (read from the raw arguments, so that a command line that
// does not parse gets its JSON object too). Values never start with "--", so a "--json" among
// the arguments is the flag.
bool json_on_stdout(const std::vector<std::string>& args) {
  if (args.empty()) return false;
  const std::string& cmd = args[0];
  for (std::size_t i = 1; i < args.size(); ++i) {
    if (cmd == "bench") {
      if (args[i] == "--json=-" ||
          (args[i] == "--json" && i + 1 < args.size() && args[i + 1] == "-"))
        return true;
    } else if ((cmd == "run" || cmd == "explain" || cmd == "info") && args[i] == "--json") {
      return true;
    }
  }
  return false;
}

// A failed command: its message on stderr (bad usage: with a line on where the flags are
// listed, not their 50 lines) and, when its output is JSON on stdout and it printed no object,
// one with the version and an `error` field.
int fail(int code, const std::string& message, bool json) {
  std::fprintf(stderr, "attncore: %s\n", message.c_str());
  if (code == kExitUsage) {
    std::fputs(
        "usage: attncore [info | run | explain | bench] [flags]; `attncore --help` lists "
        "the commands and run's flags, `attncore bench --help` bench's\n",
        stderr);
  }
  if (json && !json_printed) {
    JsonObject j;
    j.add("version", attncore::version());
    j.add("error", message);
    print_json_object(j);
  }
  return code;
}

// The command's exit code, a failure reported by `fail`.
int run_command(const std::vector<std::string>& args) {
  const bool json = json_on_stdout(args);
  try {
    return dispatch(args);
  } catch (const UsageError& e) {
    return fail(kExitUsage, e.message, json);
  } catch (const CheckFailed& e) {
    return fail(kExitLibraryError, e.message, json);
  } catch (const std::bad_alloc&) {
    return fail(kExitLibraryError, "out of memory", json);
  } catch (const std::exception& e) {  // attncore::Error and the rest
    return fail(kExitLibraryError, e.what(), json);
  }
}

// Output that did not reach standard output (a full disk, /dev/full, a closed descriptor) is a
// failure, reported on stderr: exit code 1, or the command's own when it failed already.
int check_stdout(int code) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int error = errno;
  if (flushed && !std::ferror(stdout)) return code;
  std::fprintf(stderr,
               "attncore: standard output cannot be written (expected a stream this process may "
               "write%s%s)\n",
               error != 0 ? ": " : "", error != 0 ? std::strerror(error) : "");
  return code != kExitOk ? code : kExitLibraryError;
}

}  // namespace

void print_json_object(const JsonObject& j) {
  std::printf("%s\n", j.str().c_str());
  std::fflush(stdout);
  json_printed = true;
}

}  // namespace attncore_tools

int main(int argc, char** argv) {
  using namespace attncore_tools;
  const std::vector<std::string> args(argv + 1, argv + argc);
  return check_stdout(run_command(args));
}
