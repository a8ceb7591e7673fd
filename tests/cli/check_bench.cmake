# Runs `attncore bench` on a tiny sweep with every output file and checks the files:
# the CSV's header and rows, the JSON's rows, and the PNG's signature and IHDR size.
#   -DEXE=<program>  -DOUT=<scratch directory>
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY "${OUT}")
execute_process(
  COMMAND "${EXE}" bench --seqlens 64,128 --dtypes f32 --causal none --heads-q 2 --head-dim 32
          --backward
          --repeat 1 --csv "${OUT}/bench.csv" --json "${OUT}/bench.json" --png "${OUT}/bench.png"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench exited ${rc}\n${out}\n${err}")
endif()
if(NOT out MATCHES "vs math" OR NOT out MATCHES "flash")
  message(FATAL_ERROR "no table on stdout:\n${out}")
endif()
# The progress bar goes to a terminal only: redirected, stderr holds no carriage return.
string(FIND "${err}" "\r" cr)
if(NOT cr EQUAL -1)
  message(FATAL_ERROR "a carriage return in redirected stderr:\n${err}")
endif()
file(STRINGS "${OUT}/bench.csv" csv)
list(LENGTH csv lines)
list(GET csv 0 header)
if(NOT lines EQUAL 9 OR NOT header MATCHES "^seqlen,.*,pass,.*,gflops,.*speedup_vs_math$")
  message(FATAL_ERROR "bad CSV (${lines} lines):\n${csv}")
endif()
file(READ "${OUT}/bench.json" json)
string(JSON rows LENGTH "${json}" rows)
string(JSON backend GET "${json}" rows 1 backend)
if(NOT rows EQUAL 8 OR NOT backend STREQUAL "math")
  message(FATAL_ERROR "bad JSON: ${json}")
endif()
file(READ "${OUT}/bench.png" png LIMIT 24 HEX)
if(NOT png MATCHES "^89504e470d0a1a0a0000000d49484452000003c000000258$")  # 960 x 600
  message(FATAL_ERROR "bad PNG header: ${png}")
endif()
