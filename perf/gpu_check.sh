#!/usr/bin/env bash
# The GPU check (CI has no GPU, so this runs by hand), one verdict line per check, in 8 minutes on one GPU:
# perf/gpu_check.py says what each part checks; `python3 perf/gpu_check.py --help` for its options.
#
#   perf/gpu_check.sh [DATA_ROOT [OUT_DIR [PARTS]]]   # FashionMNIST under DATA_ROOT (default: data; else synthetic)
#
# PARTS (default "findings ranks speed resume eval") picks what runs; eval needs resume's snapshot. PYTHON names the
# interpreter (default python3: the one whose torch has CUDA). Exit code 1 when a check failed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
args=(--data-root "${1:-data}" --out "${2:-runs/gpu-check}")
if [[ -n "${3:-}" ]]; then
    read -r -a parts <<<"$3"
    args+=(--parts "${parts[@]}")
fi
exec "${PYTHON:-python3}" "$here/gpu_check.py" "${args[@]}"
