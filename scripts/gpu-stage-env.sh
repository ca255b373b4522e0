# Sourced by the GPU machine's scripts, with $stage set to a folder staged by
# scripts/stage-gpu.sh: the log folder, the library path, NCCL's settings,
# the GPU count, and the data sets that Debian's packages provide on the
# development machine.
out=${OUT:-gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
if [[ -d $stage/data && ! -d /usr/share/datasets/fashion-mnist ]]; then
  mkdir -p /usr/share/datasets/fashion-mnist /usr/share/games/fortunes
  cp "$stage"/data/*.gz /usr/share/datasets/fashion-mnist/
  cp "$stage"/data/fortunes /usr/share/games/fortunes/
fi
train="$stage/tools/mpt-train/mpt-train"
run="$stage/tools/mpt-run/mpt-run"
