# cmake -DJSON_FILE=<demo_smoke.json> -P kvmosaicCheckDemoJson.cmake
#
# Checks the JSON written by `kvmosaic_demo --json <file>` (CTest demo_json). Accepted shapes:
#   { <record> }                       one result
#   [ <record>, ... ]                  several results
#   { ..., "<any>": [ <record>, ... ] } several results under some member (e.g. "results")
# where every <record> is an object with the keys
#   cache, format, selector, backend, bytes_per_token, compression_ratio, rel_l2_error, cosine, decode_us,
#   pages_used, pages_freed
# and the seven measurements are JSON numbers (decode_us may also be null: not measured).
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.21)  # string(JSON) needs 3.19

if(NOT DEFINED JSON_FILE)
  message(FATAL_ERROR "kvmosaicCheckDemoJson.cmake: -DJSON_FILE=... is required")
endif()
if(NOT EXISTS "${JSON_FILE}")
  message(FATAL_ERROR "demo JSON ${JSON_FILE} does not exist (did demo_smoke run?)")
endif()
file(READ "${JSON_FILE}" _json)

set(_required_keys cache format selector backend bytes_per_token compression_ratio rel_l2_error cosine decode_us pages_used
    pages_freed)
set(_number_keys bytes_per_token compression_ratio rel_l2_error cosine decode_us pages_used pages_freed)

string(JSON _root_type ERROR_VARIABLE _error TYPE "${_json}")
if(_error)
  message(FATAL_ERROR "${JSON_FILE} is not valid JSON: ${_error}\n${_json}")
endif()

# has_keys(<out> <json object text>): TRUE if every required key is present.
function(has_keys out object)
  foreach(_key IN LISTS _required_keys)
    string(JSON _type ERROR_VARIABLE _error TYPE "${object}" "${_key}")
    if(_error)
      set(${out} FALSE PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} TRUE PARENT_SCOPE)
endfunction()

# check_record(<where> <json object text>): fail with a clear message unless the record is complete.
function(check_record where object)
  set(_missing "")
  foreach(_key IN LISTS _required_keys)
    string(JSON _type ERROR_VARIABLE _error TYPE "${object}" "${_key}")
    if(_error)
      list(APPEND _missing "${_key}")
    elseif(_key IN_LIST _number_keys)
      if(NOT _type STREQUAL "NUMBER" AND NOT (_key STREQUAL "decode_us" AND _type STREQUAL "NULL"))
        message(FATAL_ERROR "${where}: \"${_key}\" is ${_type}, expected a number\n${object}")
      endif()
    endif()
  endforeach()
  if(_missing)
    string(REPLACE ";" ", " _missing "${_missing}")
    message(FATAL_ERROR "${where}: missing key(s) ${_missing}\n${object}")
  endif()
  string(JSON _cache GET "${object}" cache)
  string(JSON _format GET "${object}" format)
  string(JSON _ratio GET "${object}" compression_ratio)
  string(JSON _cosine GET "${object}" cosine)
  message(STATUS "${where}: cache=${_cache} format=${_format} compression_ratio=${_ratio} cosine=${_cosine}")
endfunction()

# check_array(<where> <json array text>): every element must be a complete record; at least one.
function(check_array where array)
  string(JSON _length LENGTH "${array}")
  if(_length EQUAL 0)
    message(FATAL_ERROR "${where}: empty array, expected result records")
  endif()
  math(EXPR _last "${_length} - 1")
  foreach(_i RANGE ${_last})
    string(JSON _element GET "${array}" ${_i})
    string(JSON _type TYPE "${array}" ${_i})
    if(NOT _type STREQUAL "OBJECT")
      message(FATAL_ERROR "${where}[${_i}] is ${_type}, expected an object")
    endif()
    check_record("${where}[${_i}]" "${_element}")
  endforeach()
endfunction()

set(_checked FALSE)
if(_root_type STREQUAL "OBJECT")
  has_keys(_complete "${_json}")
  if(_complete)
    check_record("${JSON_FILE}" "${_json}")
    set(_checked TRUE)
  else()
    string(JSON _members LENGTH "${_json}")
    if(_members GREATER 0)
      math(EXPR _last "${_members} - 1")
      foreach(_i RANGE ${_last})
        string(JSON _member MEMBER "${_json}" ${_i})
        string(JSON _type TYPE "${_json}" "${_member}")
        if(_type STREQUAL "ARRAY")
          string(JSON _array GET "${_json}" "${_member}")
          string(JSON _count LENGTH "${_array}")
          if(_count GREATER 0)
            string(JSON _first_type TYPE "${_array}" 0)
            if(_first_type STREQUAL "OBJECT")
              check_array("${JSON_FILE}:${_member}" "${_array}")
              set(_checked TRUE)
            endif()
          endif()
        endif()
      endforeach()
    endif()
    if(NOT _checked)
      check_record("${JSON_FILE}" "${_json}")  # reports the missing keys
    endif()
  endif()
elseif(_root_type STREQUAL "ARRAY")
  check_array("${JSON_FILE}" "${_json}")
  set(_checked TRUE)
else()
  message(FATAL_ERROR "${JSON_FILE}: top level is ${_root_type}, expected an object or an array")
endif()

message(STATUS "demo JSON OK: ${JSON_FILE}")
