# Each SIMD target's kernel files (src/cpu/flash_<target>.cpp, and math's GEMMs
# src/cpu/gemm_<target>.cpp) compile the functions of their namespace
# (attncore::detail::<target>) for the target's ISA. A weak symbol of shared code
# carrying that ISA could be the copy the linker keeps for every caller, so every function the
# object defines outside that namespace must be baseline code: inline helpers of the library
# headers (which carry no target attribute) that the compiler emitted out of line, as clang does
# for some. The x86-64 targets above the baseline (avx*) are AVX2 and AVX-512, whose instructions
# are all VEX or EVEX encoded (mnemonics v*) or AVX-512 mask instructions (k*): a function outside
# the namespace must hold none of them. Other targets may define no function outside it. The
# generic target is the baseline ISA.
#   -DNM=<nm> -DOBJECTS="<obj>;<obj>..." [-DOBJDUMP=<objdump>]
cmake_minimum_required(VERSION 3.25)
if(NOT OBJDUMP)
  # The objdump beside nm (nm -> objdump, llvm-nm-14 -> llvm-objdump-14), else any on the PATH.
  get_filename_component(nm_dir "${NM}" DIRECTORY)
  get_filename_component(nm_name "${NM}" NAME)
  string(REGEX REPLACE "nm" "objdump" objdump_name "${nm_name}")
  find_program(OBJDUMP NAMES ${objdump_name} objdump llvm-objdump HINTS "${nm_dir}" NO_CACHE)
  if(NOT OBJDUMP)
    message(FATAL_ERROR "no objdump found (pass -DOBJDUMP=...)")
  endif()
endif()

set(checked 0)
foreach(obj IN LISTS OBJECTS)
  if(NOT obj MATCHES "/(flash|gemm)_([a-z0-9]+)\\.cpp\\.o$" OR CMAKE_MATCH_2 STREQUAL "cost")
    continue()  # not a kernel file (flash_cost.cpp is the backend's cost term)
  endif()
  set(kind ${CMAKE_MATCH_1})
  set(target ${CMAKE_MATCH_2})
  math(EXPR checked "${checked} + 1")
  if(target STREQUAL "generic")
    continue()
  endif()
  execute_process(COMMAND ${OBJDUMP} -d --no-show-raw-insn ${obj}
                  OUTPUT_VARIABLE listing RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${OBJDUMP} failed on ${obj}")
  endif()
  # One list element per line: semicolons and brackets (list syntax) made harmless first.
  string(REPLACE ";" "," listing "${listing}")
  string(REPLACE "[" "(" listing "${listing}")
  string(REPLACE "]" ")" listing "${listing}")
  string(REPLACE "\n" ";" lines "${listing}")
  # Mangled names: N8attncore6detail<length><target> opens the namespace (ZN: a lambda's scope,
  # ZZN: the scope of a lambda within a lambda, and so on).
  string(LENGTH "${target}" length)
  set(namespace "^_Z+NK?8attncore6detail${length}${target}[0-9]")
  set(function "")
  set(outside OFF)
  set(functions 0)            # in the namespace (none: the file is for another architecture)
  set(target_instructions 0)  # in the namespace: proves the listing is read
  foreach(line IN LISTS lines)
    if(line MATCHES "^[0-9a-f]+ <(.*)>:$")
      set(function "${CMAKE_MATCH_1}")
      # The namespace, or this file's entry point <kind>_target_<target>().
      set(entry "^_ZN8attncore6detail[0-9]+${kind}_target_${target}Ev$")
      if(function MATCHES "${namespace}" OR function MATCHES "${entry}")
        set(outside OFF)
        math(EXPR functions "${functions} + 1")
      elseif(target MATCHES "^avx")
        set(outside ON)
      else()
        message(FATAL_ERROR "${obj} defines ${function} outside attncore::detail::${target}")
      endif()
    elseif(line MATCHES "^ +[0-9a-f]+: *\t({[a-z]+} )?([a-z][a-z0-9]*)")
      set(mnemonic "${CMAKE_MATCH_2}")
      if(mnemonic MATCHES "^[vk]")
        if(outside)
          message(FATAL_ERROR "${obj}: ${function} lies outside attncore::detail::${target} and "
                              "holds ${target} instructions (${mnemonic})")
        endif()
        math(EXPR target_instructions "${target_instructions} + 1")
      endif()
    endif()
  endforeach()
  if(functions GREATER 0 AND target MATCHES "^avx" AND target_instructions EQUAL 0)
    message(FATAL_ERROR "${obj}: no ${target} instruction found (is ${OBJDUMP}'s listing read?)")
  endif()
endforeach()
if(checked LESS 1)
  message(FATAL_ERROR "no kernel object files checked")
endif()
message(STATUS "${checked} kernel object files: outside its target's namespace, baseline code only")
