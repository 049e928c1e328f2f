// Error messages of the bindings' argument checks, built without iostreams.
//
// TORCH_CHECK_VALUE(cond, a, b, ...) formats its message with c10::str, an std::ostringstream. On the first two GPU
// runs (H100 and H200, torch 2.11+cu130) every check of the CUDA extension whose message streamed a number (an
// int64, a double, a shape) killed the process with SIGSEGV, while the checks whose messages held only strings,
// dtypes and devices raised as they should (tests/gpu/cuda_cases.py error_cases, mx_cases.py error_cases). The
// MOL_CHECK_* macros below build the same text with std::to_string / snprintf and hand c10 a finished string:
// integers as decimal, floating-point values as the stream's default (printf "%g"), shapes as "[2, 3]", dtypes by
// name, devices by Device::str(). The text equals c10::str's for every argument type used here (the host-emulated
// tests compare messages exactly).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace mol {
namespace msg {

inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? '1' : '0'; }  // as an ostream without std::boolalpha
inline void put(std::string& s, double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%g", v);
  s += buf;
}
inline void put(std::string& s, float v) { put(s, static_cast<double>(v)); }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_enum_v<T> && !std::is_same_v<T, c10::ScalarType>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(static_cast<std::underlying_type_t<T>>(v));
}
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }

template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}

}  // namespace msg
}  // namespace mol

// As TORCH_CHECK_VALUE / TORCH_CHECK_TYPE / TORCH_CHECK (c10::ValueError / TypeError / Error); the message is only
// built when the check fails.
#define MOL_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::mol::msg::cat(__VA_ARGS__))
#define MOL_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::mol::msg::cat(__VA_ARGS__))
#define MOL_CHECK(cond, ...) TORCH_CHECK(cond, ::mol::msg::cat(__VA_ARGS__))
