# Install tests (cmake -P script):
#   -DMODE=install     cmake --install BUILD_DIR into PREFIX (a fresh directory)
#   -DMODE=cmake       configure, build and run consumer/ (C++17) with find_package(attncore)
#   -DMODE=pkg-config  compile consumer/main.cpp as C++17 with `pkg-config --cflags --libs
#                      attncore`, run it
# Other variables: BUILD_DIR, CONFIG, PREFIX, LIBDIR, WORK (scratch directory), GENERATOR,
# CXX (compiler), BUILD_TYPE, FLAGS (compile and link flags: the sanitizers of the main build),
# OPT_FLAGS (the main build's optimisation flags), PKG_CONFIG.
cmake_minimum_required(VERSION 3.25)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "${what} failed (${code}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok\n${out}")
endfunction()

set(source_dir ${CMAKE_CURRENT_LIST_DIR}/consumer)
if(IS_ABSOLUTE "${LIBDIR}")
  set(libdir "${LIBDIR}")
else()
  set(libdir "${PREFIX}/${LIBDIR}")
endif()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  set(config_args)
  if(CONFIG)
    set(config_args --config "${CONFIG}")
  endif()
  run_step("cmake --install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args})
  foreach(f "${libdir}/cmake/attncore/attncoreConfig.cmake" "${libdir}/pkgconfig/attncore.pc"
            "${PREFIX}/include/attncore/attncore.h" "${PREFIX}/include/attncore/version.h")
    if(NOT EXISTS "${f}")
      message(FATAL_ERROR "not installed: ${f}")
    endif()
  endforeach()

elseif(MODE STREQUAL "cmake")
  file(REMOVE_RECURSE "${WORK}")
  run_step("configure consumer" "${CMAKE_COMMAND}" -S "${source_dir}" -B "${WORK}" -G "${GENERATOR}"
    "-Dattncore_DIR=${libdir}/cmake/attncore" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_CXX_FLAGS=${FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${FLAGS}")
  run_step("build consumer" "${CMAKE_COMMAND}" --build "${WORK}")
  run_step("run consumer (shared)" "${WORK}/app")
  run_step("run consumer (static)" "${WORK}/app_static")

elseif(MODE STREQUAL "pkg-config")
  file(REMOVE_RECURSE "${WORK}")
  file(MAKE_DIRECTORY "${WORK}")
  set(ENV{PKG_CONFIG_PATH} "${libdir}/pkgconfig")
  execute_process(COMMAND "${PKG_CONFIG}" --cflags --libs attncore
    RESULT_VARIABLE code OUTPUT_VARIABLE pc_flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "pkg-config --cflags --libs attncore failed:\n${err}")
  endif()
  message(STATUS "pkg-config --cflags --libs attncore: ${pc_flags}")
  separate_arguments(pc_flags UNIX_COMMAND "${pc_flags}")
  separate_arguments(build_flags UNIX_COMMAND "${OPT_FLAGS} ${FLAGS}")
  # -std=c++17 first: flags from pkg-config come after it and would win.
  run_step("compile consumer" "${CXX}" -std=c++17 ${build_flags} "${source_dir}/main.cpp" ${pc_flags}
    "-Wl,-rpath,${libdir}" -o "${WORK}/app")
  run_step("run consumer" "${WORK}/app")

else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
