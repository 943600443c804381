#!/usr/bin/env bash
# Set up dptrain in ./.venv: the package (with test tools given --dev) and, where apt can, the real
# FashionMNIST. torch is pinned by constraints.txt so that a CPU machine never pulls a CUDA build;
# on a GPU machine, install your own torch (>=2.6) into the venv first and it is kept.
#
#   scripts/setup.sh [--dev] [--torchvision]
#
# --torchvision: also the torchvision that matches the venv's torch, for the tutorials' scripts
# (scripts/torchvision-for); where the package index has none for that torch build, one sentence says
# what to do instead, and setup ends with exit status 1.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
torchvision=""
for option in "$@"; do
  case "$option" in
    --dev) extras="[dev]" ;;
    --torchvision) torchvision=yes ;;
    *) echo "setup: unknown option $option; give --dev, --torchvision, or neither." >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "setup: dptrain needs Python 3.10 or newer; set PYTHON to one." >&2; exit 1; }

if [[ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's dataset-fashion-mnist"
    apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || {
      apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null; }
  else
    echo "setup: FashionMNIST is not installed; run 'sudo apt-get install dataset-fashion-mnist'" \
         "or train with --data.download true." >&2
  fi
fi

# --dev: the cluster tests start a private SLURM cluster (tests/slurm_cluster.py) and hosts in network namespaces
# (tests/netns_hosts.py), which need root, Debian's SLURM and munge packages, and `ip` (iproute2); without them
# those tests are skipped, saying why.
if [[ -n "$extras" ]]; then
  cluster_packages=()
  command -v slurmctld >/dev/null || [[ -x /usr/sbin/slurmctld ]] || cluster_packages+=(slurmctld slurmd slurm-client munge)
  command -v ip >/dev/null || [[ -x /usr/sbin/ip ]] || cluster_packages+=(iproute2)
  if (( ${#cluster_packages[@]} == 0 )); then
    :  # installed already
  elif [[ $(id -u) != 0 ]]; then
    echo "setup: the cluster tests will be skipped: they need root and ${cluster_packages[*]}." >&2
  elif command -v apt-get >/dev/null; then
    echo "setup: installing Debian's ${cluster_packages[*]} for the cluster tests"
    apt_cluster=(apt-get install -y -qq --no-install-recommends "${cluster_packages[@]}")
    DEBIAN_FRONTEND=noninteractive "${apt_cluster[@]}" >/dev/null 2>&1 || {
      apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive "${apt_cluster[@]}" >/dev/null; } ||
      echo "setup: installing ${cluster_packages[*]} failed; the cluster tests will be skipped." >&2
  else
    echo "setup: the cluster tests will be skipped: ${cluster_packages[*]} are missing and there is no apt-get." >&2
  fi
fi

[[ -x .venv/bin/python ]] || "$python" -m venv .venv || {
  echo "setup: '$python -m venv' failed; on Debian or Ubuntu install it with 'sudo apt-get install python3-venv'." >&2; exit 1; }
constraint=(-c constraints.txt)
# Keep a torch that is already in the venv (e.g. a CUDA build on a GPU machine).
.venv/bin/python -c 'import torch' 2>/dev/null && constraint=()
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${constraint[@]}" -e ".${extras}"
.venv/bin/python -c 'import torch, dptrain; print(f"setup: dptrain {dptrain.__version__} with torch {torch.__version__} in .venv")'
if [[ -n "$torchvision" ]]; then
  .venv/bin/python scripts/torchvision-for
fi
