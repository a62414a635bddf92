#!/usr/bin/env bash
# What a session with a GPU machine runs there (the workplace's `device` tool), from the repo root:
#
#   bash benchmarks/gpu/device_check.sh TESTS_SECONDS BENCH_SECONDS [bench_gpu.py flags...]
#
# 1. installs the wheels carried in .whl/ (the packages the CUDA image lacks: fastapi, starlette,
#    uvicorn, pydantic(-core), annotated-types/-doc, typing-inspection, opentelemetry-api,
#    llguidance, gguf; the image has aiohttp) into /tmp/site, and builds llmserve (`pip install --no-deps .`);
# 2. builds the benchmark's 1B model on the GPU in the background while
# 3. the CUDA tests run: every test of test_gpu.py, test_gpu_fp8_offload.py, test_gpu_models.py
#    (gpt-oss, the Qwen VL models, Gemma 3 vision, BERT, LoRA), the Triton kernel files (attention,
#    elementwise, grouped MoE, LoRA) and the sampler, graph-runner and offload files (compiled on
#    the GPU instead of interpreted), under TESTS_SECONDS;
# 3b. tensor parallelism on CUDA (benchmarks/gpu/tp_check.py, issue 25): TP=2 over NCCL against TP=1
#    on tiny Llama and Mixtral models where 2 GPUs are visible; on a 1-GPU machine only the engine's
#    refusal ("needs 2 GPUs; 1 visible") is checked. Its lines go to tests.log and are printed;
# 4. times the grouped MoE kernel against the dense fallback (benchmarks/gpu/moe_kernel.py: one
#    Mixtral-width block, T = 1 .. 2048; about a minute) and fp8's matmuls against bf16's
#    (benchmarks/gpu/fp8_matmul.py: a few seconds) unless BENCH_SECONDS is 0;
# 5. runs benchmarks/bench_gpu.py under BENCH_SECONDS (0 skips it);
# 6. with EXTRAS=1 in the environment, instead of bench_gpu.py: CPU offloading
#    (benchmarks/bench_offload.py: 0, 0.5 and 1 GiB at batch 1 and 16), then fp8 next to bf16
#    (bench_offload.py --offload-gb 0 --quantization fp8) and fp8's KL divergence from bf16
#    (`llmserve eval perplexity`), the two "to be measured on a GPU" tables of docs/benchmarks.md;
#    their output goes to extras.log, their JSON to offload.json, fp8.json and fp8_kld.json.
# Everything it prints lands in $OUT (at most 8 files come back): env.txt, install.log, tests.log,
# bench.log (with moe_kernel.py's and fp8_matmul.py's tables first), bench_gpu.json, bench_gpu.png,
# logs.tgz (the engines' own logs, moe_kernel.json and fp8_matmul.json).
#
# The wheels, made here before the run (.whl/ is ignored through .git/info/exclude; the versions
# are this repo's venv's; llguidance is an abi3 wheel for manylinux_2_31):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .whl fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc \
#     typing-inspection opentelemetry-api gguf
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 \
#     --platform manylinux_2_31_x86_64 -d .whl llguidance
# and the device tool's run gets carry [".whl"]. About 3 MB; the embedded model's package (94 MB)
# is too large to carry, so its CUDA test skips there.
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
T_TESTS=${1:-150}
T_BENCH=${2:-240}
shift 2 2>/dev/null || shift $#
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 ||
    { tail -30 "$OUT/install.log"; exit 1; }

if [ "$T_BENCH" -gt 0 ]; then  # the model folder bench_gpu.py reuses (same spec: seed 0, synthetic)
    (cd benchmarks && python3 -c "
from pathlib import Path
from gpu import model, plan
model.build_model(Path('/tmp/model'), plan.GPU_PLAN.model, plan.GPU_PLAN.dtype, 0, 'synthetic', 'cuda')
print('model built')") >"$OUT/bench.log" 2>&1 &
    BUILD=$!
fi

timeout "$T_TESTS" python3 -m pytest -q --tb=short -rfE -p no:cacheprovider -n 6 --timeout 120 \
    tests/models/test_gpu.py tests/models/test_gpu_fp8_offload.py tests/models/test_gpu_models.py \
    tests/unit/test_triton_kernels.py tests/unit/test_triton_moe.py tests/unit/test_triton_lora.py \
    tests/unit/test_sampler_philox.py tests/unit/test_graph_runner.py tests/unit/test_offload.py \
    >"$OUT/tests.log" 2>&1
echo "tests: exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
mkdir -p /tmp/gpu/logs
timeout 300 python3 benchmarks/gpu/tp_check.py --out /tmp/gpu/logs >/tmp/gpu/logs/tp_check.log 2>&1
echo "tp check: exit $?"
tail -6 /tmp/gpu/logs/tp_check.log | tee -a "$OUT/tests.log"

if [ "$T_BENCH" -gt 0 ]; then
    mkdir -p /tmp/gpu/logs
    timeout 100 python3 benchmarks/gpu/moe_kernel.py --out /tmp/gpu/logs >/tmp/gpu/logs/moe_kernel.log 2>&1
    echo "moe kernel: exit $?"
    tail -8 /tmp/gpu/logs/moe_kernel.log
    timeout 60 python3 benchmarks/gpu/fp8_matmul.py --json /tmp/gpu/logs/fp8_matmul.json >/tmp/gpu/logs/fp8_matmul.log 2>&1
    echo "fp8 matmul: exit $?"
    tail -15 /tmp/gpu/logs/fp8_matmul.log
    wait "$BUILD"
    if [ "${EXTRAS:-0}" = 1 ]; then
        M=/tmp/model
        {
            timeout "$T_BENCH" python3 benchmarks/bench_offload.py --model-dir $M --tokenizer synthetic --json "$OUT/offload.json"
            echo "offload: exit $?"
            timeout "$T_BENCH" python3 benchmarks/bench_offload.py --model-dir $M --tokenizer synthetic --offload-gb 0 \
                --quantization fp8 --json "$OUT/fp8.json"
            echo "fp8 speed: exit $?"
            timeout "$T_BENCH" python3 -c "import sys; from llmserve.cli.main import main; sys.exit(main())" eval perplexity --model $M --device cuda --dtype bfloat16 \
                --quantization fp8 --reference-dtype bfloat16 --ctx 512 --json "$OUT/fp8_kld.json"
            echo "fp8 kld: exit $?"
        } >"$OUT/extras.log" 2>&1
        cat "$OUT/extras.log" | grep -v "^Loading\|it/s" | tail -40
        tar czf "$OUT/logs.tgz" -C /tmp/gpu logs 2>/dev/null
        exit 0
    fi
    timeout "$T_BENCH" python3 benchmarks/bench_gpu.py --out /tmp/gpu --model-dir /tmp/model \
        --tokenizer synthetic "$@" >>"$OUT/bench.log" 2>&1
    echo "bench: exit $?"
    tail -45 "$OUT/bench.log"
    cp /tmp/gpu/bench_gpu.json /tmp/gpu/bench_gpu.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs.tgz" -C /tmp/gpu logs 2>/dev/null
fi
