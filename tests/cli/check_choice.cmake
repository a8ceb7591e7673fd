# Runs `attncore explain --json` on shapes near the flash/math tie (L = 8..32, a few head
# counts, forward and backward) in RUNS fresh processes each, and requires one answer per shape:
# the automatic choice depends only on the problem and fixed machine properties
# (docs/design.md section 8), never on constants a process measures at its start.
#
#   -DEXE=<program> -DRUNS=<processes per shape>
cmake_minimum_required(VERSION 3.25)

set(failures "")
set(shapes 0)
foreach(pass forward backward)
  set(pass_flag "")
  if(pass STREQUAL "backward")
    set(pass_flag "--backward")
  endif()
  foreach(heads 1 2 4 8)
    foreach(len 8 14 16 24 32)
      set(answers "")
      foreach(run RANGE 1 ${RUNS})
        execute_process(
          COMMAND "${EXE}" explain --heads-q ${heads} --seqlen-q ${len} --head-dim 64 ${pass_flag}
                  --json
          RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
        if(NOT code EQUAL 0)
          message(FATAL_ERROR "explain ${pass} Hq=${heads} L=${len}: exit code ${code}\n${err}")
        endif()
        string(JSON chosen GET "${out}" chosen)
        list(APPEND answers "${chosen}")
      endforeach()
      math(EXPR shapes "${shapes} + 1")
      set(all "${answers}")
      list(REMOVE_DUPLICATES answers)
      list(LENGTH answers distinct)
      if(distinct GREATER 1)
        string(APPEND failures "\n  ${pass} Hq=${heads} L=${len} D=64: ${all}")
      endif()
    endforeach()
  endforeach()
endforeach()
if(NOT failures STREQUAL "")
  message(FATAL_ERROR "the automatic choice differs between processes:${failures}")
endif()
message(STATUS "${shapes} shapes, ${RUNS} processes each: one choice per shape")
