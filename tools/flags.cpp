// The flag table of `run`, `explain` and `bench`: every flag once, with its name, value kind
// (the type of the config field it lands in), default (that field's initial value unless the
// row says otherwise), help line and commands. One parser reads the command line through it and
// the usage texts are generated from it. Bad usage throws UsageError (exit code 2).
#include "flags.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <variant>

#include "commands.h"
#include "flag_checks.h"

namespace attncore_tools {

using attncore::Backend;
using attncore::Causal;
using attncore::DType;

namespace {

// ---------------------------------------------------------------------------------------------
// Values. Backends, causal kinds and dtypes use the library's own spellings.

template <class Enum>
struct Accepted;
template <>
struct Accepted<Backend> {
  static constexpr Backend values[] = {Backend::automatic, Backend::reference, Backend::math,
                                       Backend::flash};
};
template <>
struct Accepted<Causal> {
  static constexpr Causal values[] = {Causal::none, Causal::upper_left, Causal::lower_right};
};
template <>
struct Accepted<DType> {
  static constexpr DType values[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
};
template <>
struct Accepted<MaskKind> {
  static constexpr MaskKind values[] = {MaskKind::none, MaskKind::boolean, MaskKind::additive};
};

template <class Enum>
Enum parse_enum(std::string_view flag, std::string_view text) {
  for (Enum e : Accepted<Enum>::values) {
    if (name_of(e) == text) return e;
  }
  std::string choices;
  for (Enum e : Accepted<Enum>::values) {
    if (!choices.empty()) choices += ',';
    choices += name_of(e);
  }
  throw UsageError{std::string(flag) + ": unknown value '" + std::string(text) +
                   "' (expected one of " + choices + ")"};
}

// Reads all of `text` as a T (from_chars); throws "is out of range (expected <range>)" for a
// number past T's range and "is not <kind>" for anything else.
template <class T>
T parse_number(std::string_view flag, std::string_view text, const char* kind,
               const std::string& range) {
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const bool whole = !text.empty() && end == text.data() + text.size();
  if (whole && ec == std::errc::result_out_of_range) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) +
                     "' is out of range (expected " + range + ")"};
  }
  if (!whole || ec != std::errc()) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' is not " + kind};
  }
  return v;
}

std::int64_t parse_int(std::string_view flag, std::string_view text, std::int64_t min_value) {
  const std::int64_t v =
      parse_number<std::int64_t>(flag, text, "an integer",
                                 "an integer from " + std::to_string(min_value) + " to " +
                                     std::to_string(std::numeric_limits<std::int64_t>::max()));
  if (v < min_value) {
    throw UsageError{std::string(flag) + ": " + std::string(text) + " is below the minimum " +
                     std::to_string(min_value)};
  }
  return v;
}

std::uint64_t parse_uint(std::string_view flag, std::string_view text) {
  return parse_number<std::uint64_t>(
      flag, text, "a non-negative integer",
      "an integer from 0 to " + std::to_string(std::numeric_limits<std::uint64_t>::max()));
}

double parse_double(std::string_view flag, std::string_view text) {
  return parse_number<double>(flag, text, "a number",
                              "0 or a magnitude from 4.9e-324 to 1.8e308, a double's range");
}

// Counts: far above any sane repeat or pass count (Flag::max's default).
constexpr std::int64_t kMaxCount = 1 << 20;

int parse_count(std::string_view flag, std::string_view text, std::int64_t min_value,
                std::int64_t max_value) {
  const std::string range =
      "an integer from " + std::to_string(min_value) + " to " + std::to_string(max_value);
  const auto v = parse_number<std::int64_t>(flag, text, "an integer", range);
  if (v < min_value) {
    throw UsageError{std::string(flag) + ": " + std::string(text) + " is below the minimum " +
                     std::to_string(min_value)};
  }
  if (v > max_value) {
    const char* past = max_value == kMaxCount ? " is too large" : " is past the library's maximum";
    throw UsageError{std::string(flag) + ": " + std::string(text) + past + " (expected <= " +
                     std::to_string(max_value) + ")"};
  }
  return static_cast<int>(v);
}

Window parse_window(std::string_view flag, std::string_view text) {
  const auto comma = text.find(',');
  if (comma == std::string_view::npos || text.find(',', comma + 1) != std::string_view::npos) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) +
                     "' is not L,R (two integers, -1 = unbounded)"};
  }
  // The library checks the values (-1 = unbounded, else >= 0).
  constexpr std::int64_t kAny = std::numeric_limits<std::int64_t>::min();
  const std::string whole = std::string(flag) + " " + std::string(text);
  Window w;
  w.left = parse_int(whole + " (L)", text.substr(0, comma), kAny);
  w.right = parse_int(whole + " (R)", text.substr(comma + 1), kAny);
  return w;
}

// ---------------------------------------------------------------------------------------------
// The table.

// The commands a flag belongs to; `explain` takes run's flags.
enum FlagSet : unsigned { kRun = 1, kBench = 2, kBoth = kRun | kBench };

// Where a flag's value lands, which is also its kind: the field's type says how the value is
// read (integers, counts, numbers, enums, lists of them, text) and shown as a default. A switch
// lands in a bool. std::monostate: lands nowhere (--help, handled before parsing).
using Field =
    std::variant<std::monostate, bool RunConfig::*, std::int64_t RunConfig::*, int RunConfig::*,
                 double RunConfig::*, std::uint64_t RunConfig::*, std::string RunConfig::*,
                 DType RunConfig::*, Causal RunConfig::*, Backend RunConfig::*,
                 MaskKind RunConfig::*, Window RunConfig::*, std::vector<std::int64_t> RunConfig::*,
                 bool BenchSweep::*, int BenchSweep::*, std::string BenchSweep::*,
                 std::vector<std::int64_t> BenchSweep::*, std::vector<DType> BenchSweep::*,
                 std::vector<Causal> BenchSweep::*>;

struct Flag {
  std::string_view name;
  std::string_view value_name;  // the value's placeholder in the usage text; "": a switch
  FlagSet commands;
  Field field;
  std::string_view help;  // '\n' continues on the next line
  // The default the usage text shows; "": the field's initial value in the command's config
  // (none for switches and files).
  std::string_view shown_default = "";
  std::int64_t min = 0;  // counts (int fields): the smallest value accepted
  std::int64_t max = kMaxCount;  // and the largest (the library's maximum where it has one)
};

// Sizes (integer fields and lists of them) accept 0 in run and explain (empty problems are
// legal; the library checks the rest) and at least 1 in bench, which times every point.
std::int64_t min_size(FlagSet command) { return command == kBench ? 1 : 0; }

// In the order of the usage texts.
constexpr Flag kFlags[] = {
    {"--batch", "N", kBoth, &RunConfig::batch, "batch size B"},
    {"--heads-q", "N", kBoth, &RunConfig::heads_q, "query heads Hq"},
    {"--heads-kv", "N", kBoth, &RunConfig::heads_kv, "key/value heads Hkv, Hq % Hkv == 0",
     "= heads-q"},
    {"--seqlen-q", "N", kRun, &RunConfig::seqlen_q, "query length Lq"},
    {"--seqlen-k", "N", kRun, &RunConfig::seqlen_k, "key/value length Lk", "= seqlen-q"},
    {"--varlen", "L,L,...", kRun, &RunConfig::varlen,
     "instead of --seqlen-q/k: a packed variable-length batch (attncore/\nvarlen.h) of "
     "sequences with these query lengths; B = their count"},
    {"--varlen-k", "L,L,...", kRun, &RunConfig::varlen_k, "with --varlen: the key lengths",
     "= varlen"},
    {"--seqused-k", "L,L,...", kRun, &RunConfig::seqused_k,
     "with --varlen: the keys each sequence uses (<= its key length)", "all"},
    {"--cache-len", "N", kRun, &RunConfig::cache_len,
     "instead of --seqlen-q/k: N keys already in a KV cache (attncore/\nkvcache.h), "
     "--new-tokens rows appended, then attended",
     "no cache"},
    {"--new-tokens", "T", kRun, &RunConfig::new_tokens,
     "with --cache-len: new tokens per sequence (queries and appended\nkeys): 1 = decode, "
     "more = chunked prefill"},
    {"--page-size", "P", kRun, &RunConfig::page_size,
     "with --cache-len: a paged cache of pages of P slots in shuffled\norder; 0 = a dense "
     "cache; with --varlen: the keys in such pages (attncore/\nvarlen.h; forward only)"},
    {"--pages-in-order", "", kRun, &RunConfig::pages_in_order,
     "with --page-size: each sequence's pages one after the other in\nthe pool, not "
     "shuffled"},
    {"--seqlens", "L,L,...", kBench, &BenchSweep::seqlens, "sequence lengths, Lq = Lk"},
    {"--head-dim", "N", kBoth, &RunConfig::head_dim, "query/key head dim D"},
    {"--head-dim-v", "N", kRun, &RunConfig::head_dim_v, "value head dim Dv", "= head-dim"},
    {"--dtype", "T", kRun, &RunConfig::dtype,
     "f32, f64, bf16 or f16 (f64: math and reference; auto takes math)"},
    {"--dtypes", "T,T", kBench, &BenchSweep::dtypes, "f32, bf16, f16 (flash has no f64)"},
    {"--causal", "C", kRun, &RunConfig::causal, "none, upper-left or lower-right"},
    {"--causal", "C,C", kBench, &BenchSweep::causals, "none, upper-left, lower-right"},
    {"--window", "L,R", kRun, &RunConfig::window, "sliding window, -1 = unbounded on that side"},
    {"--softcap", "X", kRun, &RunConfig::softcap, "softcap, 0 = off"},
    {"--alibi", "", kRun, &RunConfig::alibi, "ALiBi with the standard slopes 2^(-8(h+1)/Hq)"},
    {"--mask", "M", kRun, &RunConfig::mask,
     "none, bool (random, 90% true) or additive (random in [-2, 0)),\nshape [Lq, Lk]"},
    {"--dropout", "P", kRun, &RunConfig::dropout, "dropout probability"},
    {"--seed", "S", kRun, &RunConfig::seed, "seed of the random inputs and of dropout"},
    {"--backend", "B", kRun, &RunConfig::backend, "auto, reference, math or flash"},
    {"--backward", "", kBoth, &RunConfig::backward, "also time the backward (with a random dout)"},
    {"--threads", "N", kBoth, &RunConfig::threads,
     "threads (at most 1024), 0 = ATTNCORE_NUM_THREADS or the CPUs this\nprocess may run on",
     "", 0, attncore::kMaxThreads},
    {"--num-splits", "N", kRun, &RunConfig::num_splits,
     "flash's split-KV decode: parts per kv group's keys, 0 = planned\nfrom the CPU count, 1 = "
     "no split, up to 256 forced",
     "", 0, attncore::kMaxSplits},
    {"--simd", "T", kBoth, &RunConfig::simd,
     "the flash kernels' SIMD target: avx512bf16, avx512, avx2 or generic\n(`attncore info` "
     "lists this CPU's)",
     "the best this CPU runs"},
    {"--repeat", "N", kBoth, &RunConfig::repeat, "calls timed; the best is reported", "", 1},
    {"--check", "", kRun, &RunConfig::check, "max abs error against the reference backend in f64"},
    {"--json", "", kRun, &RunConfig::json, "print one JSON object on stdout and nothing else"},
    {"--select", "", kBench, &BenchSweep::select,
     "instead: a fixed sweep of shapes (tiny to long, decode, causal;\nf32 and bf16), each "
     "backend and auto's choice timed in --passes\ninterleaved passes (median), and auto's time "
     "over the best one's;\nwith --backward: the backward instead of the forward"},
    {"--passes", "N", kBench, &BenchSweep::passes,
     "with --select, --decode: interleaved passes per shape", "", 1},
    {"--varlen", "", kBench, &BenchSweep::varlen,
     "instead: a fixed ragged batch of 32 sequences (64 to 2048) run\npacked (varlen), as a dense "
     "batch of equal work and padded to\nthe longest with a key-padding mask; forward and "
     "backward, flash,\n1 thread unless --threads"},
    {"--decode", "", kBench, &BenchSweep::decode,
     "instead: decode over a KV cache (Hq 32, Hkv 32 and 8, D 128, B 1..64,\nLk 1k..32k, f32/bf16/"
     "f16, [B, Hkv, L, D] and [B, L, Hkv, D]) as K/V GB/s\nagainst the read bandwidth probe, "
     "flash on 1 and 2 threads and math\non 1, medians of --passes interleaved passes"},
    {"--quick", "", kBench, &BenchSweep::quick, "with --decode: B = 1 and Lk 4096, 16384 only"},
    {"--points", "D:L:H,...", kBench, &BenchSweep::points,
     "with --decode: only these points, dtype:layout:Hkv items, e.g.\nf32:BLHD:32,bf16:p16:8 "
     "(f32, bf16, f16; BHLD, BLHD, p16, p256; 32, 8;\n* = any), no chunked prefill; with "
     "--threads N: flash on N threads\nonly",
     "all"},
    {"--max-kv-gib", "N", kBench, &BenchSweep::max_kv_gib,
     "with --decode: points with more K/V are skipped (listed)", "", 1},
    {"--csv", "FILE", kBench, &BenchSweep::csv, "also write the table as CSV"},
    {"--json", "FILE", kBench, &BenchSweep::json,
     "also write it as one JSON object (- = standard output, the table\nthen goes to standard "
     "error)"},
    {"--png", "FILE", kBench, &BenchSweep::png, "also plot GFLOP/s against sequence length"},
    {"--help", "", kBoth, std::monostate{}, "this text"},
};

// A name means one flag per command.
constexpr bool names_are_unique() {
  for (const Flag& a : kFlags) {
    for (const Flag& b : kFlags) {
      if (&a != &b && a.name == b.name && (a.commands & b.commands) != 0) return false;
    }
  }
  return true;
}
static_assert(names_are_unique());

// ---------------------------------------------------------------------------------------------
// Reading a value into its field, and showing a field's default.

template <class Member>
struct MemberTraits;
template <class T, class Owner>
struct MemberTraits<T Owner::*> {
  using type = T;
  using owner = Owner;
};

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};

template <class T>
T parse_value(const Flag& f, FlagSet command, std::string_view text) {
  if constexpr (std::is_same_v<T, bool>) {
    return true;  // a switch
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return parse_int(f.name, text, min_size(command));
  } else if constexpr (std::is_same_v<T, int>) {
    return parse_count(f.name, text, f.min, f.max);
  } else if constexpr (std::is_same_v<T, double>) {
    return parse_double(f.name, text);
  } else if constexpr (std::is_same_v<T, std::uint64_t>) {
    return parse_uint(f.name, text);
  } else if constexpr (std::is_same_v<T, std::string>) {
    return std::string(text);
  } else if constexpr (std::is_same_v<T, Window>) {
    return parse_window(f.name, text);
  } else if constexpr (IsVector<T>::value) {
    T values;
    for (std::string_view part : split(text, ',')) {
      values.push_back(parse_value<typename T::value_type>(f, command, part));
    }
    return values;
  } else {
    return parse_enum<T>(f.name, text);
  }
}

template <class T>
std::string show_value(const T& value) {
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::string>) {
    return "";  // switches and files have no default to show
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(value);
  } else if constexpr (std::is_same_v<T, double>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", value);
    return buf;
  } else if constexpr (std::is_same_v<T, Window>) {
    return std::to_string(value.left) + "," + std::to_string(value.right);
  } else if constexpr (IsVector<T>::value) {
    std::string s;
    for (const auto& e : value) {
      if (!s.empty()) s += ',';
      s += show_value(e);
    }
    return s;
  } else {
    return std::string(name_of(value));
  }
}

// The configs a command line fills: the run config and, for bench, the sweep (which run's
// flags never reach).
struct Target {
  RunConfig& run;
  BenchSweep& sweep;
};

template <class Owner>
Owner& owner_of(const Target& t) {
  if constexpr (std::is_same_v<Owner, RunConfig>) {
    return t.run;
  } else {
    return t.sweep;
  }
}

void land(const Flag& f, FlagSet command, std::string_view text, const Target& into) {
  std::visit(
      [&](auto field) {
        if constexpr (!std::is_same_v<decltype(field), std::monostate>) {
          using Traits = MemberTraits<decltype(field)>;
          owner_of<typename Traits::owner>(into).*field =
              parse_value<typename Traits::type>(f, command, text);
        }
      },
      f.field);
}

std::string shown_default(const Flag& f, const Target& defaults) {
  if (!f.shown_default.empty()) return std::string(f.shown_default);
  return std::visit(
      [&](auto field) -> std::string {
        if constexpr (std::is_same_v<decltype(field), std::monostate>) {
          return "";
        } else {
          return show_value(owner_of<typename MemberTraits<decltype(field)>::owner>(defaults).*
                            field);
        }
      },
      f.field);
}

// ---------------------------------------------------------------------------------------------
// Parsing and usage.

// One argument read against a command's flags: its name (up to a '=': --flag=value), the value
// written after the '=', and the command's flag of that name (nullptr: none).
struct Argument {
  std::string_view name;
  std::optional<std::string_view> inline_value;
  const Flag* flag = nullptr;
};

Argument read_argument(std::string_view arg, FlagSet command) {
  Argument a{arg, std::nullopt, nullptr};
  if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
    a.inline_value = arg.substr(eq + 1);
    a.name = arg.substr(0, eq);
  }
  for (const Flag& f : kFlags) {
    if ((f.commands & command) != 0 && a.name == f.name) a.flag = &f;
  }
  return a;
}

// Whether args[i + 1] is the value of args[i], read as `a`: a flag that takes a value, given
// without '=', and a next argument that does not start with "--" (a value never does).
bool value_follows(const Argument& a, const std::vector<std::string>& args, std::size_t i) {
  return a.flag != nullptr && !a.flag->value_name.empty() && !a.inline_value &&
         i + 1 < args.size() && !std::string_view(args[i + 1]).starts_with("--");
}

// Reads `args` into `into` (which holds the command's defaults) and returns the flags given.
// --flag value and --flag=value.
GivenFlags parse_flags(const std::vector<std::string>& args, FlagSet command, const Target& into) {
  GivenFlags seen;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const Argument a = read_argument(args[i], command);
    const Flag* flag = a.flag;
    if (flag == nullptr) {
      throw UsageError{(command == kBench ? "unknown bench flag '" : "unknown argument '") +
                       args[i] + "'"};
    }
    if (std::find(seen.begin(), seen.end(), flag->name) != seen.end()) {
      throw UsageError{std::string(flag->name) + " is given twice (expected each flag once)"};
    }
    seen.push_back(flag->name);
    if (flag->value_name.empty()) {
      if (a.inline_value) throw UsageError{std::string(a.name) + " takes no value"};
      land(*flag, command, {}, into);
      continue;
    }
    std::string_view value;
    if (a.inline_value) {
      value = *a.inline_value;
    } else if (value_follows(a, args, i)) {
      value = args[++i];
    } else {
      throw UsageError{std::string(a.name) + " needs a value"};
    }
    land(*flag, command, value, into);
  }
  return seen;
}

// Whether `args` ask for the command's usage text: a --help or -h that is no flag's value.
bool asks_for_help(const std::vector<std::string>& args, FlagSet command) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") return true;
    if (value_follows(read_argument(args[i], command), args, i)) ++i;
  }
  return false;
}

// The flag lines of a command's usage text: "  --name VALUE" in a 27-column field, then the
// help, the default in brackets after its last line.
std::string flag_lines(FlagSet command, const Target& defaults) {
  constexpr std::size_t kHelpColumn = 27;
  std::string text;
  for (const Flag& f : kFlags) {
    if ((f.commands & command) == 0) continue;
    std::string line = "  ";
    line += f.name;
    if (!f.value_name.empty()) {
      line += ' ';
      line += f.value_name;
    }
    line.resize(std::max(kHelpColumn, line.size() + 1), ' ');
    for (const char ch : f.help) {
      if (ch == '\n') {
        line += '\n';
        line.append(kHelpColumn, ' ');
      } else {
        line += ch;
      }
    }
    const std::string d = shown_default(f, defaults);
    if (!d.empty()) line += " [" + d + "]";
    text += line;
    text += '\n';
  }
  return text;
}

constexpr const char* kCommands = R"(usage:
  attncore                 check and time every backend on a few shapes (the default)
  attncore --version       the version
  attncore info [--json]   version, CPU, SIMD targets, threads, measured FMA peak, the cost
                           model's constants
  attncore run [flags]     time (and check) one attention call on random data
  attncore explain [flags] which backend `auto` picks for the call the run flags describe, and
                           why: every backend's verdict, the cost model's estimates and constants
                           (runs nothing; --backend B considers only B; --backward: the backward)
  attncore bench [flags]   fused kernels against math over sequence lengths; --varlen: a
                           ragged batch packed, dense and padded (bench --help)

run flags (defaults in brackets):
)";

}  // namespace

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  for (std::size_t at = 0;;) {
    const std::size_t end = text.find(separator, at);
    parts.push_back(text.substr(at, end == std::string_view::npos ? end : end - at));
    if (end == std::string_view::npos) return parts;
    at = end + 1;
  }
}

bool asks_for_run_help(const std::vector<std::string>& args) { return asks_for_help(args, kRun); }

bool asks_for_bench_help(const std::vector<std::string>& args) {
  return asks_for_help(args, kBench);
}

RunConfig parse_run_flags(const std::vector<std::string>& args) {
  RunConfig c;
  BenchSweep unused;
  const GivenFlags flags = parse_flags(args, kRun, {c, unused});
  check_varlen_flags(c, flags);
  check_cache_flags(c, flags);
  check_simd_flag(c);
  c.finish();
  return c;
}

BenchConfig parse_bench_flags(const std::vector<std::string>& args) {
  BenchConfig c;
  const GivenFlags flags = parse_flags(args, kBench, {c.run, c.sweep});
  for (const DType dtype : c.sweep.dtypes) {
    if (dtype == DType::f64) {
      throw UsageError{
          "--dtypes: f64 does not go with bench (it times the flash backend, which "
          "has no f64)"};
    }
  }
  check_bench_mode_flags(flags);
  check_simd_flag(c.run);
  if (given(flags, "--points")) check_decode_points(c.sweep.points);
  // (Here with the other flags, before bench creates its output files.)
  if (c.sweep.decode && c.run.threads > 2) {
    throw UsageError{"bench --decode: --threads takes 0, 1 or 2 (--threads=" +
                     std::to_string(c.run.threads) + ")"};
  }
  if (c.sweep.varlen) {
    // One thread unless asked: the comparison is of kernels, not of thread scheduling.
    if (!given(flags, "--threads")) c.run.threads = 1;
  }
  c.run.finish();
  return c;
}

const std::string& usage_text() {
  static const std::string text = [] {
    RunConfig defaults;
    BenchSweep unused;
    return kCommands + flag_lines(kRun, {defaults, unused});
  }();
  return text;
}

const std::string& bench_usage_text() {
  static const std::string text = [] {
    BenchConfig defaults;
    return "usage: attncore bench [flags]   (Lq = Lk, Dv = D; defaults in brackets)\n" +
           flag_lines(kBench, {defaults.run, defaults.sweep});
  }();
  return text;
}

}  // namespace attncore_tools
