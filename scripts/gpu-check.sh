#!/usr/bin/env bash
# The GPU machine's whole check in one call, from a folder staged by
# scripts/stage-gpu.sh: every test binary, the default mpt-train run, GPT-mini
# in fp16 on one GPU and on every GPU (DDP through mpt-run), a checkpoint
# loaded into PyTorch, and the benchmark against PyTorch. Logs go to $OUT.
#   scripts/gpu-check.sh [build-stage]
set -uo pipefail
stage=${1:-build-stage}
# shellcheck source=scripts/gpu-stage-env.sh
source "$(dirname "$0")/gpu-stage-env.sh"
scripts/gpu-tests.sh "$stage"
echo "== mpt-train, defaults"
"$train" --progress lines --metrics "$out/default.jsonl" 2>&1 | tail -4
echo "== mpt-train, GPT-mini fp16, 1 GPU"
"$train" --model gpt --precision fp16 --steps 300 --eval-batches 20 --progress lines --log-every 50 \
  --metrics "$out/gpt1.jsonl" 2>&1 | tail -9
echo "== mpt-train, GPT-mini fp16, $gpus GPUs (DDP)"
"$run" --nproc_per_node "$gpus" "$train" --model gpt --precision fp16 --steps 300 --eval-batches 20 \
  --progress lines --log-every 50 --metrics "$out/gpt$gpus.jsonl" 2>&1 | grep 'rank 0' | tail -9
echo "== mpt-train, defaults, --parallel dp over $gpus GPUs"
"$train" --parallel dp --progress lines --metrics "$out/default-dp.jsonl" 2>&1 | tail -2
echo "== mpt-scaler sweep, GPT-mini on the GPU"
"$stage/tools/mpt-scaler/mpt-scaler" sweep --model gpt --device cuda --intervals 20,100 --steps 200 --batch 64 \
  --init-scale 1e9 2>&1 | tail -3
echo "== checkpoints in PyTorch"
"$train" --steps 3 --eval-batches 1 --progress none --checkpoint "$out/mlp.safetensors" >/dev/null
"$train" --model gpt --steps 3 --eval-batches 1 --progress none --checkpoint "$out/gpt.safetensors" >/dev/null
python3 scripts/check_torch_checkpoint.py mlp "$out/mlp.safetensors" gpt "$out/gpt.safetensors"
echo "== benchmark"
python3 scripts/bench_vs_torch.py --build "$stage" 2>&1 | tail -8
