// The exceptions attncore throws. Every message has the form
//   <op>: <what> <problem> (<name>=<value>, expected <constraint>)[; <remedy>]
#pragma once

#include <stdexcept>
#include <string>

#include "attncore/export.h"

namespace attncore {

// Base of everything the library throws.
class ATTNCORE_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// The arguments are wrong: shapes, dtypes, strides, values out of range.
class ATTNCORE_API InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The arguments are valid but this backend or build cannot run them.
class ATTNCORE_API Unsupported : public Error {
 public:
  using Error::Error;
};

// The call needs more memory than this process may use: refused before anything is allocated
// or written when its workspace plus the outputs it allocates exceed the smallest of physical
// memory, the cgroup limit and RLIMIT_AS, or an allocation failed (the message says whether
// outputs are incomplete).
class ATTNCORE_API OutOfMemory : public Error {
 public:
  using Error::Error;
};

// The call saw its Options::cancel flag set and stopped: before any work (the outputs are not
// written) or after some (the outputs are incomplete: some rows written, others not).
class ATTNCORE_API Cancelled : public Error {
 public:
  using Error::Error;
};

}  // namespace attncore
