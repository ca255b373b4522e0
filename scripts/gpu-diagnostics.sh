#!/usr/bin/env bash
# The diagnostics on a GPU machine, in one call, from a folder staged by
# scripts/stage-gpu.sh (MPT_STAGE_DATA=1 for the training runs): mpt-doctor's
# report and all-reduce tests, a problem it must find, and training runs on
# every GPU with their step-time breakdown and GPU samples. Logs go to $OUT.
#   scripts/gpu-diagnostics.sh [build-stage]
set -uo pipefail
stage=${1:-build-stage}
# shellcheck source=scripts/gpu-stage-env.sh
source "$(dirname "$0")/gpu-stage-env.sh"
doctor="$stage/tools/mpt-doctor/mpt-doctor"

echo "== mpt-doctor"
"$doctor"; echo "exit status $?"
"$doctor" --json >"$out/doctor.json"; echo "--json exit status $?"
echo "== mpt-doctor --comm (sums: 3 * (i % 7 + 1) for 2 participants)"
"$doctor" --comm --sizes 4096 1048576 16777216 268435456 --iterations 20 | sed -n '/All-reduce/,$p'
echo "== mpt-doctor with LOCAL_RANK=$gpus (must be a problem, exit status 1)"
MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 RANK=0 WORLD_SIZE=2 LOCAL_RANK=$gpus LOCAL_WORLD_SIZE=$((gpus + 1)) \
  "$doctor" | grep -A1 PROBLEM; echo "exit status ${PIPESTATUS[0]}"

echo "== mpt-train GPT-mini fp16 on $gpus GPUs (DDP): banners, breakdown, samples"
"$run" --nproc_per_node "$gpus" "$train" --model gpt --precision fp16 --steps 300 --eval-batches 20 \
  --progress lines --log-every 50 --metrics "$out/ddp.jsonl" 2>&1 | grep -E 'rank [0-9]+ of|ms/step|warning|done' | head -30
grep '"event":"step"' "$out/ddp.jsonl" | tail -2
grep '"event":"epoch"' "$out/ddp.jsonl" | tail -1
echo "GPU samples: $(grep -c '"event":"gpu"' "$out/ddp.jsonl")"; grep '"event":"gpu"' "$out/ddp.jsonl" | tail -2

echo "== mpt-train MLP --parallel dp over $gpus GPUs"
"$train" --parallel dp --steps 300 --log-every 100 --eval-batches 4 --progress lines \
  --metrics "$out/dp.jsonl" 2>&1 | grep -E 'rank 0 of|ms/step|warning|done'

echo "== imbalance: DDP while another job loads GPU $((gpus - 1))"
CUDA_VISIBLE_DEVICES=$((gpus - 1)) "$train" --model gpt --steps 100000 --progress none >/dev/null 2>&1 &
load=$!
sleep 5
"$run" --nproc_per_node "$gpus" "$train" --model gpt --precision fp16 --steps 200 --eval-batches 5 \
  --progress lines --log-every 25 --metrics "$out/imbalance.jsonl" 2>&1 | grep -E 'warning|ms/step' | head -12
kill "$load"; wait "$load" 2>/dev/null
grep '"event":"step"' "$out/imbalance.jsonl" | tail -1
