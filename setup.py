"""Builds llmserve's optional C++ CPU kernels (block-quantized matmuls, src/llmserve/csrc/).

Everything else about the package is in pyproject.toml. The extension needs only a C++17 compiler
and OpenMP, not torch's headers; each instruction set is compiled into the same library
(per-file `#pragma GCC target`) and picked at run time from the CPU's features. `optional=True`:
where it cannot be built, llmserve still installs and runs its quantized layers on torch ops.
"""

from setuptools import Extension, setup

CSRC = "src/llmserve/csrc"

setup(
    ext_modules=[
        Extension(
            "llmserve._cpu_kernels",
            sources=[
                f"{CSRC}/{name}.cpp"
                for name in (
                    "module",
                    "qgemm_avx512",
                    "qgemm_avx2",
                    "qgemm_q6_avx512",
                    "qgemm_q6_avx2",
                    "qgemm_q4k",
                    "decoder_stack",
                    "decoder_act",
                    "decoder_moe",
                    "decoder_cache_rows",
                    "shm_comm",
                    "decoder_lora",
                    "module_comm",
                    "module_jobs",
                )
            ],
            depends=[
                f"{CSRC}/{name}"
                for name in (
                    "qgemm.h",
                    "job_runs.h",
                    "decoder_stack.h",
                    "vec_exp.h",
                    "shm_comm.h",
                    "py_util.h",
                    "act_quant.inc",
                    "avx2_tile.inc",
                )
            ],
            include_dirs=[CSRC],
            language="c++",
            extra_compile_args=[
                "-O3",
                "-std=c++17",
                "-fopenmp",
                "-fno-math-errno",
                "-Wno-maybe-uninitialized",
            ],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
