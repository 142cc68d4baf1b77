#!/usr/bin/env bash
# GPU check for a machine with a CUDA GPU (CI has none): the GPT in bf16 on one GPU through
# raytrain and through a plain PyTorch loop of the same model; tokens/s of each and the
# ratio, MFU and peak memory. About 2-4 minutes on an H100-class GPU.
#   bash bench/gpu.sh [extra args for bench/gpu_throughput.py]
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python bench/gpu_throughput.py "$@"
