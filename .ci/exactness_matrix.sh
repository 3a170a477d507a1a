#!/usr/bin/env bash
# The exactness tests (pipelined training against single-process training) under every CPU
# kernel set torch has here (ATEN_CPU_CAPABILITY: default, avx2, and avx512 where the CPU has it)
# and 1 and 2 threads per rank (OMP_NUM_THREADS, read by the ranks and by the references): the
# bounds of tests/tolerances.py must hold whatever rounding the kernels do. Not part of CI (it
# runs the files six times); prints one line per configuration and exits non-zero on a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
FILES=(tests/test_executor.py tests/test_schedules_execute.py tests/test_compression.py
       tests/test_compiled.py tests/test_real_models.py tests/test_async_updates.py
       tests/test_resume.py tests/test_multinode.py tests/test_grad_fusion.py tests/test_split.py
       tests/test_runtime_benchmarks_smoke.py tests/test_bench_hf_smoke.py
       tests/test_tensor_parallel.py tests/test_data_sharding.py tests/test_check.py)
native=$(python3 -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
caps=(default avx2)
[[ "$native" == avx512* ]] && caps+=(avx512)
status=0
for cap in "${caps[@]}"; do
  for threads in 1 2; do
    out=$(ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$threads python3 -m pytest -q \
             -p no:cacheprovider "${FILES[@]}" "$@" 2>&1) || status=1
    line=$(tail -1 <<<"$out")
    echo "ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$threads (native: $native): $line"
    grep -E "^(FAILED|ERROR) " <<<"$out" || true
    [[ "$line" == *failed* || "$line" == *error* ]] && status=1
  done
done
exit $status
