// llmserve._cpu_kernels: JobRuns (job_runs.h), the matmuls' split of their jobs over threads, run
// alone with one thread slowed, for the tests.
#include <omp.h>

#include <atomic>
#include <chrono>
#include <vector>

#include "job_runs.h"
#include "py_util.h"

namespace llmserve {

// job_runs_trial(n, parts, threads, slow_us[, team]): JobRuns' jobs, planned for `threads` threads, run
// by a region of `team` threads (default: `threads`; another size takes JobRuns' static split) whose
// first spins slow_us microseconds a job: (how many times each job of each part ran, part-major; how
// many jobs each thread ran). The tests: every job once, and the slow thread's run taken over.
PyObject* py_job_runs_trial(PyObject*, PyObject* args) {
  long long n, parts, threads, slow_us, team = -1;
  if (!PyArg_ParseTuple(args, "LLLL|L", &n, &parts, &threads, &slow_us, &team)) return nullptr;
  if (team < 0) team = threads;
  if (n < 0 || n >= (1LL << 31) || parts < 1 || threads < 1 || slow_us < 0 || team < 1 || team > 256) {
    PyErr_Format(PyExc_ValueError,
                 "job_runs_trial: bad n=%lld, parts=%lld, threads=%lld, slow_us=%lld or team=%lld", n, parts,
                 threads, slow_us, team);
    return nullptr;
  }
  std::vector<std::atomic<int>> runs_of(n * parts);
  std::vector<long long> by_thread(team, 0);
  Py_BEGIN_ALLOW_THREADS
  const JobRuns runs(n, parts, threads);
#pragma omp parallel num_threads(team)
  {
    const int me = omp_get_thread_num();
    long long mine = 0;
    for (int64_t p = 0; p < parts; ++p)
      runs.each(p, [&](int64_t j) {
        const auto t = std::chrono::steady_clock::now();
        while (me == 0 && std::chrono::steady_clock::now() - t < std::chrono::microseconds(slow_us)) {
        }
        runs_of[p * n + j].fetch_add(1, std::memory_order_relaxed);
        ++mine;
      });
    by_thread[me] = mine;
  }
  Py_END_ALLOW_THREADS
  PyObject *counts = PyList_New(n * parts), *threads_list = PyList_New(team);
  if (!counts || !threads_list) return Py_XDECREF(counts), Py_XDECREF(threads_list), nullptr;
  for (long long i = 0; i < n * parts; ++i) PyList_SET_ITEM(counts, i, PyLong_FromLong(runs_of[i].load()));
  for (long long i = 0; i < team; ++i) PyList_SET_ITEM(threads_list, i, PyLong_FromLongLong(by_thread[i]));
  return Py_BuildValue("(NN)", counts, threads_list);
}

}  // namespace llmserve
