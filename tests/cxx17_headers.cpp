// Every public header compiles as C++17 (docs/design.md section 8): built by the test
// public_headers_cxx17 with -std=c++17 -fsyntax-only, never linked.
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

int main() { return 0; }
