#!/usr/bin/env bash
# Every CUDA check in one command, for a machine with a GPU (CI has none, so every CUDA path also
# has a CPU test that make test runs). Under 8 minutes on one GPU. It runs:
#   1. what the machine is (torch, CUDA, the GPUs),
#   2. every CUDA test of the suite (they skip, with the reason, where there is no GPU),
#   3. a small CUDA run: examples/fsdp_llama.py as 2 islands of 1 rank on CUDA, DiLoCo across them
#      (Gloo between them, since NCCL refuses two ranks of one group on one device; the outer
#      state on the host, the default, so the outer gradient goes from pinned host copies), which
#      must end with one digest on both,
#   3a. the same run with DiLoCo's outer state on the GPU (--outer-state-device same),
#   3b. the same islands' checkpoint (every rank its shards, on CUDA) resumed by 1 island of 1,
#   4. with 4 or more GPUs, the same example as 2 islands x 2 ranks over NCCL inside (FSDP2),
#      Gloo across them (backend auto: the outer state is on the host);
#      with fewer it says that it was skipped and why.
# and prints a summary; the exit status is non-zero when any step failed.
#
#   tools/gpu_check.sh                     # with the python3 that holds a CUDA torch
#   PYTHON=.venv/bin/python tools/gpu_check.sh
#   OUT=/some/dir tools/gpu_check.sh       # keep every step's log there
#   tools/gpu_check.sh --islands           # only the island runs (3, 3a, 3b, 4): a short device call
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
summary=()
failed=0

# step NAME LIMIT_S COMMAND...: runs it with its output in $OUT/NAME.log, prints the log's tail
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  echo "== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 15 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then
    summary+=("PASS  $name ($(($(date +%s) - t0)) s)")
  else
    summary+=("FAIL  $name (exit $rc after $(($(date +%s) - t0)) s; log: $OUT/$name.log)")
    failed=1
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -n 9
step machine 60 "$PY" -c "
import torch
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(' ', i, torch.cuda.get_device_name(i))
"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

# -o addopts= drops the repository's -ra/strict defaults only to add them back explicitly; -rs
# lists every skip with its reason, so a CUDA test that did not run is seen.
only_islands=0
[ "${1:-}" = "--islands" ] && only_islands=1
[ $only_islands -eq 1 ] && summary+=("SKIP  cuda-tests: --islands") || step cuda-tests 300 "$PY" -m pytest -q -p no:cacheprovider -rs --strict-markers \
  tests/unit/test_cuda.py tests/unit/test_cuda_host.py tests/unit/test_zo.py \
  tests/integration/test_cuda_gloo.py

# one_digest NAME RUN_DIR: both islands print the digest of their full state at the end: one
# digest, twice
one_digest() {
  [ -d "$2" ] || return 0
  local digests
  digests=$(grep -rhoE "state [0-9a-f]{8,}" "$2" 2>/dev/null | sort | uniq -c)
  echo "$digests"
  if [ "$(echo "$digests" | grep -c .)" -ne 1 ]; then
    summary+=("FAIL  $1 digests: expected one digest on both islands, got: $digests")
    failed=1
  fi
}

run_dir="$OUT/island-run"
step island-1gpu 240 "$PY" -m isthmus.cli run --peers 2 --nproc-per-peer 1 --no-progress \
  --run-dir "$run_dir" examples/fsdp_llama.py -- --backend gloo --steps 40 --sync-every 10 \
  --checkpoint-dir "$OUT/island-ck" --checkpoint-every 2
one_digest island-1gpu "$run_dir"

# the same islands with DiLoCo's outer state beside the model on the GPU (Gloo carrying CUDA
# tensors) instead of on the host: one digest on both islands again
step island-1gpu-same 240 "$PY" -m isthmus.cli run --peers 2 --nproc-per-peer 1 --no-progress \
  --run-dir "$OUT/island-same" examples/fsdp_llama.py -- --backend gloo --steps 40 \
  --sync-every 10 --outer-state-device same
one_digest island-1gpu-same "$OUT/island-same"

# the checkpoint those islands wrote on CUDA (each rank its shards), resumed by one island of 1
step island-resume 180 "$PY" -m isthmus.cli run --peers 1 --nproc-per-peer 1 --no-progress \
  --run-dir "$OUT/island-resume" examples/fsdp_llama.py -- --backend gloo --steps 60 \
  --sync-every 10 --resume "$OUT/island-ck"
if ! grep -q "resumed from revision" "$OUT/island-resume.log" 2>/dev/null; then
  summary+=("FAIL  island-resume: did not say it resumed from the islands' checkpoint")
  failed=1
fi

if [ "$gpus" -ge 4 ]; then
  # NCCL inside each island, Gloo across them (backend auto: the outer state is on the host;
  # NCCL across would put rank i of both islands on GPU i, which NCCL refuses on one machine)
  step island-nccl 240 "$PY" -m isthmus.cli run --peers 2 --nproc-per-peer 2 --no-progress \
    --run-dir "$OUT/island-nccl" examples/fsdp_llama.py -- --steps 40 --sync-every 10
  one_digest island-nccl "$OUT/island-nccl"
else
  summary+=("SKIP  island-nccl: 2 islands x 2 ranks over NCCL need 4 GPUs, this machine has $gpus")
fi

echo
echo "== gpu_check summary (logs in $OUT)"
printf '%s\n' "${summary[@]}"
exit $failed
