// What the extension's binding files share (module.cpp, module_comm.cpp): tensors passed as
// addresses, argument-count checks, and running a collective with the GIL released.
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>

#include "shm_comm.h"

namespace llmserve {

template <typename T>
inline T* ptr(PyObject* o) {
  return static_cast<T*>(PyLong_AsVoidPtr(o));
}

inline bool check_args(Py_ssize_t nargs, Py_ssize_t want, const char* name) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
  return false;
}

inline const char* const kCommCapsule = "llmserve.ShmComm";

inline void free_comm(PyObject* capsule) { delete static_cast<ShmComm*>(PyCapsule_GetPointer(capsule, kCommCapsule)); }

inline ShmComm* comm_of(PyObject* o) { return static_cast<ShmComm*>(PyCapsule_GetPointer(o, kCommCapsule)); }

// A collective's CommError as a RuntimeError (the executor's failure path catches those).
template <typename F>
bool run_comm(F&& f) {
  std::string error;
  Py_BEGIN_ALLOW_THREADS;
  try {
    f();
  } catch (const CommError& e) {
    error = e.what();
  }
  Py_END_ALLOW_THREADS;
  if (error.empty()) return true;
  PyErr_SetString(PyExc_RuntimeError, error.c_str());
  return false;
}

// The shared-memory collectives' bindings (module_comm.cpp), listed in module.cpp's method table.
PyObject* py_comm_segment_bytes(PyObject*, PyObject* args);
PyObject* py_comm_new(PyObject*, PyObject* args);
PyObject* py_comm_all_reduce(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* py_comm_all_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* py_comm_broadcast(PyObject*, PyObject* args);
PyObject* py_comm_abort(PyObject*, PyObject* capsule);
PyObject* py_job_runs_trial(PyObject*, PyObject* args);  // module_jobs.cpp

}  // namespace llmserve
