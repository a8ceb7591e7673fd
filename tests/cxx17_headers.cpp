// Every public header compiles as C++17 (docs/design.md section 8): built by the test
// public_headers_cxx17 with -std=c++17 -Wall -Wextra -Werror -fsyntax-only, never linked. The
// structs a caller fills may be initialized in part, as aggregates, without a warning
// (-Wmissing-field-initializers: every member has a default initializer).
#include "attncore/attncore.h"
#include "attncore/backend.h"
#include "attncore/dtype.h"
#include "attncore/error.h"
#include "attncore/export.h"
#include "attncore/info.h"
#include "attncore/kvcache.h"
#include "attncore/merge.h"
#include "attncore/options.h"
#include "attncore/paged.h"
#include "attncore/tensor.h"
#include "attncore/varlen.h"
#include "attncore/version.h"

int main() {
  const attncore::TensorView none;
  const attncore::VarlenSeqs seqs{none, none};
  const attncore::KvCacheSeqs cache{none};
  const attncore::KvAppend append{none, none};
  attncore::Options options{};
  options.num_threads = 1;
  (void)seqs;
  (void)cache;
  (void)append;
  return options.num_threads == 1 ? 0 : 1;
}
