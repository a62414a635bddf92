// llmserve._cpu_kernels: the bindings of the shared-memory collectives (shm_comm.cpp) that
// tensor-parallel ranks on one machine use (distributed/shm.py).
#include "py_util.h"

namespace llmserve {

// comm_segment_bytes(world, slot_bytes, bcast_bytes) -> the segment's size
PyObject* py_comm_segment_bytes(PyObject*, PyObject* args) {
  long long world, slot, bcast;
  if (!PyArg_ParseTuple(args, "LLL", &world, &slot, &bcast)) return nullptr;
  return PyLong_FromLongLong(ShmComm::segment_bytes(world, slot, bcast));
}

// comm_new(address, rank, world, slot_bytes, bcast_bytes, timeout_s) -> capsule (the segment
// mapped at `address` by the caller, who keeps it mapped while the capsule lives)
PyObject* py_comm_new(PyObject*, PyObject* args) {
  PyObject* addr;
  long long rank, world, slot, bcast;
  double timeout;
  if (!PyArg_ParseTuple(args, "OLLLLd", &addr, &rank, &world, &slot, &bcast, &timeout)) return nullptr;
  char* base = static_cast<char*>(PyLong_AsVoidPtr(addr));
  if (PyErr_Occurred()) return nullptr;
  if (world < 1 || rank < 0 || rank >= world || slot < 64 || slot % 64 || bcast < 64) {
    PyErr_SetString(PyExc_ValueError, "comm_new: inconsistent rank, world or sizes");
    return nullptr;
  }
  auto comm = new ShmComm(base, rank, world, slot, bcast, timeout);
  PyObject* capsule = PyCapsule_New(comm, kCommCapsule, free_comm);
  if (!capsule) delete comm;
  return capsule;
}

// comm_all_reduce(comm, address, n) -> None: float32 [n] at address summed over the ranks in place
PyObject* py_comm_all_reduce(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_args(nargs, 3, "comm_all_reduce")) return nullptr;
  ShmComm* comm = comm_of(args[0]);
  float* x = ptr<float>(args[1]);
  const int64_t n = PyLong_AsLongLong(args[2]);
  if (!comm || PyErr_Occurred()) return nullptr;
  if (!run_comm([&] { comm->all_reduce(x, n); })) return nullptr;
  Py_RETURN_NONE;
}

// comm_all_gather(comm, src, nbytes, dst) -> None: dst [world * nbytes] = every rank's src in rank order
PyObject* py_comm_all_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_args(nargs, 4, "comm_all_gather")) return nullptr;
  ShmComm* comm = comm_of(args[0]);
  const void* src = ptr<const void>(args[1]);
  const int64_t bytes = PyLong_AsLongLong(args[2]);
  void* dst = ptr<void>(args[3]);
  if (!comm || PyErr_Occurred()) return nullptr;
  if (!run_comm([&] { comm->all_gather(src, bytes, dst); })) return nullptr;
  Py_RETURN_NONE;
}

// comm_broadcast(comm, data: bytes | None) -> bytes: rank 0 sends `data` (and gets it back), the
// others pass None and receive it
PyObject* py_comm_broadcast(PyObject*, PyObject* args) {
  PyObject *capsule, *data;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &data)) return nullptr;
  ShmComm* comm = comm_of(capsule);
  if (!comm) return nullptr;
  if (comm->rank == 0) {
    char* buf;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(data, &buf, &len) < 0) return nullptr;
    if (!run_comm([&] { comm->broadcast_send(buf, len); })) return nullptr;
    Py_INCREF(data);
    return data;
  }
  std::string got;
  if (!run_comm([&] { got = comm->broadcast_recv(); })) return nullptr;
  return PyBytes_FromStringAndSize(got.data(), static_cast<Py_ssize_t>(got.size()));
}

// comm_abort(comm) -> None: every rank's waits end with an error
PyObject* py_comm_abort(PyObject*, PyObject* capsule) {
  ShmComm* comm = comm_of(capsule);
  if (!comm) return nullptr;
  comm->abort();
  Py_RETURN_NONE;
}

}  // namespace llmserve
