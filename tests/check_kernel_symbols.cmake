# Each SIMD target's kernel file may define out-of-line functions only inside its own namespace
# (attncore::detail::<target>): a weak symbol of shared code emitted there would carry that
# target's instructions and could be the copy the linker keeps for every caller.
#   -DNM=<nm> -DOBJECTS="<obj>;<obj>..."
cmake_minimum_required(VERSION 3.25)
set(checked 0)
foreach(obj IN LISTS OBJECTS)
  if(NOT obj MATCHES "flash_([a-z0-9]+)\\.cpp\\.o$" OR CMAKE_MATCH_1 STREQUAL "cost")
    continue()  # not a kernel file (flash_cost.cpp is the backend's cost term)
  endif()
  set(target ${CMAKE_MATCH_1})
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${symbols}")
  foreach(line IN LISTS lines)
    # Functions only (demangled names with a parameter list): the compiler's own data symbols
    # (DW.ref.__gxx_personality_v0, sanitizer constructors) carry no target code.
    if(line MATCHES " [WTtu] (.*\\(.*)$")
      set(name "${CMAKE_MATCH_1}")
      if(NOT name MATCHES "attncore::detail::${target}::" AND NOT name MATCHES "^attncore::detail::flash_target_${target}\\(\\)$")
        message(FATAL_ERROR "${obj} defines ${name} outside attncore::detail::${target}")
      endif()
    endif()
  endforeach()
  math(EXPR checked "${checked} + 1")
endforeach()
if(checked LESS 1)
  message(FATAL_ERROR "no kernel object files checked")
endif()
message(STATUS "${checked} kernel object files: every symbol in its target's namespace")
