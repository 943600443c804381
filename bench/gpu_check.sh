#!/usr/bin/env bash
# CUDA/nccl checks on a machine with one GPU (CI has none, so this runs by hand):
# the epoch time of the main command's model, every strategy that fits one GPU, a snapshot
# resume against a run never stopped, and `dptrain eval`. Several ranks on one GPU are refused
# by nccl, so the multi-rank paths run at world size 1 here (nccl, the elastic agent, the hooks).
#
#   bench/gpu_check.sh [DATA_ROOT [OUT_DIR [PARTS]]]   # FashionMNIST under DATA_ROOT (default: data)
#
# PARTS (default "speed strategies resume eval") picks what runs; eval needs resume's snapshot.
set -uo pipefail
root=${1:-data}
out=${2:-runs/gpu-check}
parts=${3:-speed strategies resume eval}
dptrain=(python3 -m dptrain)
export PYTHONUNBUFFERED=1
mkdir -p "$out"

python3 - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, nccl {torch.cuda.nccl.version()}")
PY

check() {  # check NAME ARGS...: one training run; its [METRIC] lines, warnings and errors, and its exit code
    local name=$1; shift
    echo "== $name: dptrain train $*"
    rm -rf "${out:?}/$name"  # a fresh run each time (train.resume never refuses a folder with snapshots)
    "${dptrain[@]}" train --data.root "$root" --output.dir "$out/$name" --train.resume never "$@" >"$out/$name.log" 2>&1
    local rc=$?
    grep -E "\[METRIC\]|WARNING|warning|error|Error" "$out/$name.log" | grep -v "^\s*$" | tail -n 6
    echo "   exit $rc"
}

wants() { [[ " $parts " == *" $1 "* ]]; }

if wants speed; then
# The main command's model and data on one GPU: epoch time (the goal is <= 0.5 s).
check single-fp32 --strategy.name single --train.epochs 3 --checkpoint.every_epochs 0
check single-graph --strategy.name single --train.epochs 3 --checkpoint.every_epochs 0 --train.cuda_graph true
check main-command-graph --train.epochs 3 --train.cuda_graph true   # ddp at world size 1: the bare model
check single-bs512 --strategy.name single --train.epochs 3 --train.global_batch_size 512 --checkpoint.every_epochs 0
check single-bs512-graph --strategy.name single --train.epochs 3 --train.global_batch_size 512 --checkpoint.every_epochs 0 --train.cuda_graph true
check single-bf16-graph --strategy.name single --train.epochs 3 --train.bf16 true --checkpoint.every_epochs 0 --train.cuda_graph true

fi

if wants strategies; then
# Through the elastic agent and nccl, one rank.
check ddp --nproc-per-node 1 --train.epochs 1
for hook in fp16 bf16 powersgd ring; do
    check "ddp-$hook" --nproc-per-node 1 --train.max_steps 120 --strategy.ddp.comm_hook "$hook"
done
check fsdp --nproc-per-node 1 --train.max_steps 120 --strategy.name fsdp
check fsdp-bf16 --nproc-per-node 1 --train.max_steps 120 --strategy.name fsdp --strategy.fsdp.param_dtype bfloat16 --strategy.fsdp.reduce_dtype float32
check fsdp-zero2 --nproc-per-node 1 --train.max_steps 120 --strategy.name fsdp --strategy.fsdp.reshard_after_forward false
check zero1 --nproc-per-node 1 --train.max_steps 120 --strategy.name zero1
check dp --train.max_steps 120 --strategy.name dp
fi

compare() {  # compare RUN_A RUN_B: the two runs' final weights
    python3 - "$out/$1/model.pt" "$out/$2/model.pt" "$1 vs $2" <<'PY'
import sys, torch
a, b = (torch.load(p, map_location="cpu") for p in sys.argv[1:3])
equal = all(torch.equal(a[k], b[k]) for k in a)
worst = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a if a[k].is_floating_point())
print(f"   {sys.argv[3]}: torch.equal on every tensor: {equal}; worst difference {worst:.2e} of the tensor's scale")
PY
}
if wants resume; then
# CUDA's default kernels are not deterministic (atomic adds in backward): the same run twice differs.
check whole --nproc-per-node 1 --train.max_steps 300 --checkpoint.every_epochs 0
check whole-again --nproc-per-node 1 --train.max_steps 300 --checkpoint.every_epochs 0
compare whole whole-again
# With deterministic kernels: the same run twice, and a run snapshotted at step 150 and resumed, to step 300.
det=(--nproc-per-node 1 --train.deterministic true)
check det "${det[@]}" --train.max_steps 300 --checkpoint.every_epochs 0
check det-again "${det[@]}" --train.max_steps 300 --checkpoint.every_epochs 0
compare det det-again
check part "${det[@]}" --train.max_steps 150 --checkpoint.every_steps 150
echo "== resume: dptrain train (same run directory) --train.max_steps 300"
"${dptrain[@]}" train --data.root "$root" --output.dir "$out/part" "${det[@]}" --train.max_steps 300 \
    --checkpoint.every_steps 150 >"$out/part-resume.log" 2>&1
echo "   exit $?"
compare det part
fi

if wants eval; then
echo "== dptrain eval --checkpoint $out/part"
"${dptrain[@]}" eval --checkpoint "$out/part" --nproc-per-node 1 --predictions "$out/predictions.csv" 2>&1 | grep -E "METRIC|rror"
echo "   predictions: $(($(wc -l <"$out/predictions.csv") - 1)) rows"
fi
