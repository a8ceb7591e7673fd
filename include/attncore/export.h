// ATTNCORE_API marks what libattncore.so exports: the public API, and nothing else. The library
// is built with hidden visibility (CMakeLists.txt), so a declaration without it stays inside
// the library; every function or class with out-of-line members declared in a public header
// carries it (docs/design.md section 8). Classes thrown to the caller carry it too, so that
// their type info is shared and `catch (const attncore::Error&)` works across the boundary.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define ATTNCORE_API __attribute__((visibility("default")))
#else
#define ATTNCORE_API
#endif
