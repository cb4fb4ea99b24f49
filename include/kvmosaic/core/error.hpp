// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Errors. Every check on user input throws a `kvmosaic::error` whose message names the operation,
/// the parameter, the value it got and the values it allows, e.g.
/// `kvmosaic: cache_config: head_dim = 96; allowed: 64, 128 or 256`. Checks happen before any state
/// changes, and a failure after the writes began is rolled back, so a throwing call leaves the
/// cache exactly as it was (no token half-stored, no page leaked). Device code never throws;
/// everything a kernel relies on is checked on the host first.

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace kvmosaic {

/// Base of all kvmosaic exceptions; `parameter()` names the offending argument.
class error : public std::runtime_error {
 public:
  error(std::string parameter, const std::string& message)
      : std::runtime_error(message), parameter_(std::move(parameter)) {}
  const std::string& parameter() const noexcept { return parameter_; }

 private:
  std::string parameter_;
};

/// A parameter outside its allowed values.
class invalid_argument : public error {
 public:
  using error::error;
};

/// A fixed-size resource (page pool, sequence slots) cannot hold what was asked; nothing was changed.
class capacity_error : public error {
 public:
  using error::error;
};

namespace detail {

/// A value as text for a message: integers and strings as they are, floating-point values as
/// `%g` prints them (what a default `std::ostream` prints). Numbers and strings are formatted
/// without iostreams, so messages are the same, and building them is safe, in a process whose
/// other libraries install their own locale facets (seen with PyTorch extensions); other types
/// fall back to `operator<<`.
inline std::string to_text(const std::string& value) { return value; }
inline std::string to_text(const char* value) { return value != nullptr ? std::string(value) : std::string("(null)"); }
inline std::string to_text(bool value) { return value ? "1" : "0"; }
inline std::string to_text(char value) { return std::string(1, value); }
template <class Value>
std::enable_if_t<std::is_integral<Value>::value, std::string> to_text(Value value) {
  return std::to_string(value);
}
template <class Value>
std::enable_if_t<std::is_floating_point<Value>::value, std::string> to_text(Value value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
  return text;
}
template <class Value>
std::enable_if_t<!std::is_arithmetic<Value>::value && !std::is_convertible<const Value&, std::string>::value, std::string>
to_text(const Value& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

template <class Value>
std::string describe(const char* where, const char* parameter, const Value& value, const char* allowed) {
  return std::string("kvmosaic: ") + where + ": " + parameter + " = " + to_text(value) + "; allowed: " + allowed;
}

/// Throws `invalid_argument` naming `parameter`, its `value` and the `allowed` values unless `ok`.
template <class Value>
void require(bool ok, const char* where, const char* parameter, const Value& value, const char* allowed) {
  if (!ok) throw invalid_argument(parameter, describe(where, parameter, value, allowed));
}

}  // namespace detail
}  // namespace kvmosaic
