# cmake -DCOMPILER=<c++> -DSOURCE=<file.cpp> -DINCLUDE_DIRS=<dir|dir|...> -P kvmosaicCompileFail.cmake
#
# Compile-fail check used by test/compile_fail/CMakeLists.txt: SOURCE must contain a line
# "// EXPECT: <regex>"; the script runs `COMPILER -std=c++17 -fsyntax-only -I... SOURCE` and
# succeeds only if the compiler fails and its output (stdout+stderr) matches <regex>.
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.21)

foreach(_var COMPILER SOURCE INCLUDE_DIRS)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "kvmosaicCompileFail.cmake: -D${_var}=... is required")
  endif()
endforeach()

file(STRINGS "${SOURCE}" _expect LIMIT_COUNT 1 REGEX "^[ \t]*//[ \t]*EXPECT:")
if(NOT _expect)
  message(FATAL_ERROR "${SOURCE}: no line of the form '// EXPECT: <regex>'")
endif()
string(REGEX REPLACE "^[ \t]*//[ \t]*EXPECT:[ \t]*" "" _regex "${_expect}")
string(STRIP "${_regex}" _regex)
if(_regex STREQUAL "")
  message(FATAL_ERROR "${SOURCE}: the EXPECT regex is empty")
endif()

set(_includes "")
string(REPLACE "|" ";" _include_dirs "${INCLUDE_DIRS}")
foreach(_dir IN LISTS _include_dirs)
  if(NOT _dir STREQUAL "")
    list(APPEND _includes "-I${_dir}")
  endif()
endforeach()

# Stable, plain diagnostics: no locale quotes, no colour escapes.
set(ENV{LC_ALL} C)
set(ENV{GCC_COLORS} "")
set(_command "${COMPILER}" -std=c++17 -fsyntax-only -fdiagnostics-color=never ${_includes} "${SOURCE}")
execute_process(COMMAND ${_command}
  RESULT_VARIABLE _result
  OUTPUT_VARIABLE _output
  ERROR_VARIABLE _output)

string(REPLACE ";" " " _shown "${_command}")
if(_result EQUAL 0)
  message(FATAL_ERROR "compile-fail: ${SOURCE} compiled, but it must not.\n  command: ${_shown}\n"
                      "  expected an error matching: ${_regex}\n${_output}")
endif()
if(NOT _output MATCHES "${_regex}")
  message(FATAL_ERROR "compile-fail: ${SOURCE} failed to compile, but not with the expected message.\n"
                      "  command: ${_shown}\n  expected output matching: ${_regex}\n"
                      "--- compiler output ---\n${_output}")
endif()
message(STATUS "compile-fail OK: ${SOURCE} was rejected with output matching '${_regex}'")
