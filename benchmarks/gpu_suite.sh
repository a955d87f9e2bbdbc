#!/usr/bin/env bash
# The GPU checklist (issue 31): the first thing to run whenever a session is lent a GPU. Sized for
# the device tool's budget (15 minutes of device time a session, the machine's start included):
# the steps' limits add up to 540 s, most valuable first, so a step cut by its limit costs only
# what follows it (FULL=1 adds the 1,000-client and bf16 steps, 150 s more). It writes every figure to $OUT/gpu_suite.txt (OUT defaults to
# benchmarks/gpu-results):
#
#   * engine_speed.py on CUDA, fp32: 10 and 100 clients (mlp, tcnn, cnnbn; sequential, grouped,
#     padded) on digits;
#   * one paper-scale round of MAP (MLPNet, Fashion-MNIST) and the neural-collapse paper's VGG-11
#     (CIFAR-10), and FedMR's ResNet-18 (CIFAR-10) on a quarter of each client's data, projected;
#   * 1,000 clients of Fashion-MNIST (mlp, tcnn; grouped and padded);
#   * the digits table again in bf16 (100 clients);
#   * runs as lanes (issue 43): 20 digits runs packed vs one after another (lanes_speed.py), and
#     NIID-Bench's FMNIST paper-scale seed (20 runs x 50 rounds) through `fedskew bench --pack auto`
#     (target <= 3 min; ~17-19 min before lanes), cut at its limit: the log's progress lines say how far it got.
#
# Data: FEDSKEW_DATA (a folder with Fashion-MNIST's IDX files and CIFAR-10's python batches) when
# set; otherwise random pixels in the official on-disk formats (timing does not depend on pixel
# values; the output says which). On the device tool's machine fedskew's pure-Python dependencies
# that its image lacks (pydantic, pydantic-core, annotated-types, typing-inspection) travel as
# wheels in .whl (device README); then:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. \
#     OUT=$OUT bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu-results}
mkdir -p "$OUT"
LOG="$OUT/gpu_suite.txt"
PY=${PYTHON:-python3}
export PYTHONPATH="${PYTHONPATH:-}:$PWD" PYTHONUNBUFFERED=1
: > "$LOG"
DEVICE=${DEVICE:-cuda}

data=${FEDSKEW_DATA:-}
if [ -z "$data" ]; then  # Fashion-MNIST's IDX layout with random pixels (CIFAR-10: engine_speed.py writes its own)
  data=$(mktemp -d)
  "$PY" - "$data" <<'EOF'
import gzip, struct, sys
import numpy as np
root, rng = sys.argv[1], np.random.default_rng(0)
for prefix, n in (("train", 60000), ("t10k", 10000)):
    with gzip.open(f"{root}/{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 2051, n, 28, 28) + rng.integers(0, 256, n * 784, dtype=np.uint8).tobytes())
    with gzip.open(f"{root}/{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 2049, n) + rng.integers(0, 10, n, dtype=np.uint8).tobytes())
EOF
  echo "data: random pixels in Fashion-MNIST's and CIFAR-10's formats (no FEDSKEW_DATA)" >> "$LOG"
else
  echo "data: $data" >> "$LOG"
fi

step() {  # step SECONDS command...: one timed step, its output and exit status in the log
  local limit=$1; shift
  echo -e "\n\$ $* (limit ${limit}s)" >> "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "(exit $?, $((SECONDS - t0)) s)" >> "$LOG"
}

step 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
step 40 "$PY" -c "import torch, fedskew; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
step 120 "$PY" benchmarks/engine_speed.py --device "$DEVICE" --precision fp32 --clients 10 100 \
  --models mlp tcnn cnnbn --engines sequential grouped padded --rounds 3
step 60 "$PY" benchmarks/lanes_speed.py --device "$DEVICE" --runs 20 --rounds 5 --repeats 1
step 60 "$PY" benchmarks/engine_speed.py --device "$DEVICE" --paper map etf --data "$data" \
  --engines sequential padded --rounds 2
step 100 "$PY" benchmarks/engine_speed.py --device "$DEVICE" --paper fedmr --data "$data" --paper-fraction 0.25 \
  --engines sequential padded --rounds 2
step 140 "$PY" -m fedskew.cli bench niid-bench --scale paper --parts niid-fmnist --seeds 0 --data "$data" \
  --device "$DEVICE" --executor vectorized --pack auto --jobs 1 --out "$OUT/niid-paper"
if [ "${FULL:-0}" = 1 ]; then
  step 90 "$PY" benchmarks/engine_speed.py --device "$DEVICE" --clients 1000 --dataset fmnist --data "$data" \
    --subsample 0.25 --models mlp tcnn --engines grouped padded --rounds 3
  step 60 "$PY" benchmarks/engine_speed.py --device "$DEVICE" --precision bf16 --clients 100 \
    --models mlp tcnn cnnbn --engines sequential grouped padded --rounds 3
fi
echo -e "\nfigures: $LOG" | tee -a "$LOG"
