// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Errors. Every check on user input throws a `kvmosaic::error` whose message names the operation,
/// the parameter, the value it got and the values it allows, e.g.
/// `kvmosaic: cache_config: head_dim = 96; allowed: 64, 128 or 256`. Checks happen before any state
/// changes, and a failure after the writes began is rolled back, so a throwing call leaves the
/// cache exactly as it was (no token half-stored, no page leaked). Device code never throws;
/// everything a kernel relies on is checked on the host first.

#include <sstream>
#include <stdexcept>
#include <string>
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

template <class Value>
std::string describe(const char* where, const char* parameter, const Value& value, const char* allowed) {
  std::ostringstream os;
  os << "kvmosaic: " << where << ": " << parameter << " = " << value << "; allowed: " << allowed;
  return os.str();
}

/// Throws `invalid_argument` naming `parameter`, its `value` and the `allowed` values unless `ok`.
template <class Value>
void require(bool ok, const char* where, const char* parameter, const Value& value, const char* allowed) {
  if (!ok) throw invalid_argument(parameter, describe(where, parameter, value, allowed));
}

}  // namespace detail
}  // namespace kvmosaic
