# The shared library exports the public API only (docs/design.md section 8): among its defined
# dynamic symbols none names attncore::detail, and the entry points and the exception types'
# type info of the public headers are there. Prints the count of exported attncore symbols.
#   -DNM=<nm> -DLIBRARY=<path to libattncore.so>
cmake_minimum_required(VERSION 3.25)
execute_process(COMMAND "${NM}" -D -C --defined-only "${LIBRARY}"
  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "${NM} -D failed on ${LIBRARY}: ${err}")
endif()
string(REPLACE "\n" ";" lines "${out}")
set(attncore_symbols "")
set(detail_symbols "")
foreach(line IN LISTS lines)
  # "<address> <type> <demangled name>"
  if(NOT line MATCHES "^[0-9a-fA-F]+ [A-Za-z] (.*)$")
    continue()
  endif()
  set(name "${CMAKE_MATCH_1}")
  if(name MATCHES "attncore::")
    list(APPEND attncore_symbols "${name}")
  endif()
  if(name MATCHES "attncore::detail::")
    list(APPEND detail_symbols "${name}")
  endif()
endforeach()
list(REMOVE_DUPLICATES attncore_symbols)
list(LENGTH attncore_symbols count)
if(detail_symbols)
  list(REMOVE_DUPLICATES detail_symbols)
  list(JOIN detail_symbols "\n  " shown)
  message(FATAL_ERROR "libattncore exports internal symbols:\n  ${shown}")
endif()
foreach(expected
    "attncore::forward(attncore::TensorView const&"
    "attncore::backward_into("
    "attncore::set_num_threads(int)"
    "attncore::version()"
    "attncore::measure_fma_peak_gflops(int)"
    "attncore::measure_read_bandwidth_gbs(int, long)"
    "attncore::Tensor::Tensor("
    "typeinfo for attncore::InvalidArgument"
    "typeinfo for attncore::Cancelled")
  string(FIND "${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "libattncore does not export ${expected}")
  endif()
endforeach()
message(STATUS "libattncore exports ${count} attncore symbols, none of them attncore::detail")
