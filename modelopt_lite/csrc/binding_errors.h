// Python exceptions raised by the CUDA bindings themselves (quant_cuda_binding.cpp, mx_cuda_binding.cpp).
//
// The bindings validate with MOL_CHECK_VALUE / MOL_CHECK_TYPE (check_msg.h), which throw c10::ValueError /
// c10::TypeError.
// Left alone, such an exception is turned into a Python exception by a translator that torch._C registers with
// pybind11: that works only when the extension and torch share pybind11's internals and the exception crosses the
// library boundary intact. On the first GPU run (H100, torch 2.11+cu130) the ValueError cases killed the process
// with SIGSEGV, and this wrapper was added against a broken translation; the H200 runs showed the crash persisted
// with it, in building the messages that stream numbers (check_msg.h's MOL_CHECK_* fixed that). The wrapper stays:
// it does not depend on sharing pybind11's internals with torch. Every bound function is wrapped by python_errors():
// it catches the c10 errors in this module and sets the Python exception itself (PyErr_SetString +
// pybind11::error_already_set, which pybind11's dispatcher restores before consulting any translator), with the same
// message (what_without_backtrace):
//   c10::ValueError -> ValueError, c10::TypeError -> TypeError, c10::IndexError -> IndexError,
//   c10::NotImplementedError -> NotImplementedError, c10::OutOfMemoryError -> torch.OutOfMemoryError,
//   any other c10::Error -> RuntimeError.
// The GIL is held throughout (the bindings never release it).
#pragma once

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include "check_msg.h"

#include <utility>

namespace mol {

[[noreturn]] inline void raise_python(PyObject* type, const char* msg) {
  PyErr_SetString(type, msg);
  throw pybind11::error_already_set();
}

// torch.OutOfMemoryError (a RuntimeError subclass), or RuntimeError if this torch has none. Looked up per call
// (rare) rather than cached: a static Python object would outlive the interpreter.
[[noreturn]] inline void raise_torch_oom(const char* msg) {
  pybind11::object oom;
  try {
    oom = pybind11::module_::import("torch").attr("OutOfMemoryError");
  } catch (const pybind11::error_already_set&) {
    raise_python(PyExc_RuntimeError, msg);
  }
  raise_python(oom.ptr(), msg);
}

// Call inside a catch block: raise the Python exception of the c10 error in flight.
[[noreturn]] inline void rethrow_c10_as_python() {
  try {
    throw;
  } catch (const c10::ValueError& e) {
    raise_python(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    raise_python(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    raise_python(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    raise_python(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::OutOfMemoryError& e) {
    raise_torch_oom(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    raise_python(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

// fn wrapped for m.def: same signature; c10 errors leave it as Python exceptions (see above).
template <typename R, typename... A>
auto python_errors(R (*fn)(A...)) {
  return [fn](A... args) -> R {
    try {
      return fn(std::forward<A>(args)...);
    } catch (const c10::Error&) {
      rethrow_c10_as_python();
    }
  };
}

}  // namespace mol
