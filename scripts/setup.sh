#!/usr/bin/env bash
# Installs what mptrain needs on Debian 12 (and any packages named as
# arguments), by package name. Idempotent:
# installs only what is missing, and touches apt only then. The CUDA toolkit
# (nvcc, cuBLAS, cuDNN, NCCL) is used when present under /usr/local/cuda;
# without it the CPU backend is built.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git   # toolchain
  libeigen3-dev                                      # CPU kernels
  libdnnl-dev                                        # CPU products (oneDNN 2.6)
  libgloo-dev                                        # CPU collectives
  libgtest-dev libgmock-dev libbenchmark-dev         # tests and micro-benchmarks
  libcli11-dev nlohmann-json3-dev libfmt-dev         # tools, metrics, formatting
  zlib1g-dev                                         # gzipped data files
  dataset-fashion-mnist                              # the default training data
  fortunes-min                                       # the default text corpus
  gnuplot-nox                                        # mpt-scaler's plots (its pngcairo terminal)
  iproute2 procps                                    # multi-host and process tests
)
# More packages a caller needs (scripts/sanitize.sh: clang and its runtimes).
packages+=("$@")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
