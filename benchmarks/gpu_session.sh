#!/usr/bin/env bash
# Everything a lent GPU should run, in one command that fits a 10-minute slot: the Triton tests first (the kernels'
# correctness on a real device), then the host time a call, then the GPU targets' bench case. Each step has its own
# time limit, so a slow or failing step still leaves the others' results.
#
#   PYTHON=/opt/torch/.venv/bin/python bash benchmarks/gpu_session.sh [OUTPUT_FOLDER]
#
# Writes gpu-tests.txt, host-overhead.txt, bench-h1024-64x512.{json,md,txt} into OUTPUT_FOLDER (default: $OUT, else
# ./gpu-session). Run from the repository root; uses the source tree (PYTHONPATH=src), not an install.
set -u
python=${PYTHON:-python3}
out=${1:-${OUT:-gpu-session}}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
# glibc's allocator held steady, as the bench's steady condition does (BENCHMARKS.md, "Conditions")
export MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_MMAP_MAX_=0

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, output into NAME, the exit status logged
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name" 2>&1
    local status=$?
    echo "$name: exit $status after $((SECONDS - start)) s" | tee -a "$out/steps.txt"
}

"$python" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    >"$out/versions.txt" 2>&1
step gpu-tests.txt 200 "$python" -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py tests/test_triton_launch.py
step host-overhead.txt 120 "$python" benchmarks/gpu_host_overhead.py --profile
step bench-h1024-64x512.txt 240 "$python" -m bertembed bench --device cuda --hidden 1024 --shape 64x512 --no-isolate \
    --json-out "$out/bench-h1024-64x512.json" --markdown "$out/bench-h1024-64x512.md"
