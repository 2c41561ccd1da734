#!/usr/bin/env bash
# On an accelerator host with no network: install the offline bundle
# (scripts/offline_bundle.sh) once, then run this checkout's cuda checks and
# figures, each step's log under OUTDIR. The checkout's vllm_accel is used
# (first on PYTHONPATH), the bundle's packages beside it.
# Ran on an H100 on 2026-12-07 (sixth session): tests in two calls, decode_env, start.
#
#   bash benchmarks/cuda_host.sh BUNDLE.tar.xz OUTDIR [STEP ...]
#
# Steps (default: tests start): tests (tests/test_cuda.py), start (a cold and
# a warm start of the 1.1B shape; START_ROUNDS=N rounds, START_BASELINE=DIR
# another checkout's starts in turn), serve (its decode step against the
# weight-read floor, first token of 512 tokens, throughput against HF: 3
# rounds), decode_env (the batch-1 step with and without programmatic
# dependent launch, 3 alternating rounds; each engine's start-up line shows
# its tuning benchmarks), decode_ab (the batch-1 step of this checkout against
# AB_BASELINE=DIR, another checkout, in alternating processes: gpu_ab.py
# decode1, 3 rounds), attention_split (the attention launch alone, one pass
# against split-KV: gpu_attention_split.py). TESTS_TIMEOUT=N stops the tests
# after N seconds (default: none); TESTS_SELECT=EXPR runs the cases pytest's
# -k EXPR selects.
# The whole file takes ~17 min on an H100, more than a device call's 10: run
# it in two calls, 'not vision and not molmo and not embeddings and not
# cpu_backend and not graphs_off' (25 cases, 520 s on 2026-12-07), then
# 'vision or molmo or embeddings or cpu_backend or graphs_off' (10 cases; 8
# of them took 423 s).
set -uo pipefail
bundle=${1:?BUNDLE.tar.xz}; out=${2:?OUTDIR}; shift 2
steps=("$@")
((${#steps[@]})) || steps=(tests start)
repo=$(cd "$(dirname "$0")/.." && pwd)
site=${CUDA_HOST_SITE:-/tmp/vllm-accel-site}
mkdir -p "$out"
if [[ ! -f $site/.installed ]]; then
  unpacked=$(mktemp -d)
  tar -xJf "$bundle" -C "$unpacked" && bash "$unpacked"/*/install.sh --target "$site" \
    > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
  touch "$site/.installed"
fi
export PYTHONPATH="$repo:$site" PYTHONUNBUFFERED=1 VLLM_PLUGINS=accel
cd "$repo"
for step in "${steps[@]}"; do
  echo "cuda_host: $step at $SECONDS s"
  case $step in
    tests) timeout "${TESTS_TIMEOUT:-0}" python3 -m pytest tests/test_cuda.py -v \
             -p no:cacheprovider ${TESTS_SELECT:+-k "$TESTS_SELECT"} 2>&1 \
             | tee "$out/test_cuda.log" | grep -E " (PASSED|FAILED|ERROR)|passed|failed" ;;
    start) python3 benchmarks/gpu.py --shape tinyllama --parts start \
             --start-rounds "${START_ROUNDS:-1}" ${START_BASELINE:+--baseline "$START_BASELINE"} \
             --no-spawned-start --out "$out/start.json" > "$out/start.log" 2>&1
           grep -E "^start |start-up|variants" "$out/start.log" | cut -c1-400 ;;
    serve) python3 benchmarks/gpu.py --shape tinyllama --parts floor,decode,ttft,throughput \
             --variants cuda_graphs --out "$out/serve.json" > "$out/serve.log" 2>&1
           tail -40 "$out/serve.log" ;;
    decode_env) python3 benchmarks/gpu.py --shape tinyllama --parts decode_env --rounds 3 \
             --out "$out/decode_env.json" > "$out/decode_env.log" 2>&1
           grep -E "^decode_env|start-up:" "$out/decode_env.log" | cut -c1-600 ;;
    decode_ab) VLLM_ACCEL_BASELINE=${AB_BASELINE:?AB_BASELINE=DIR} OUT=$out \
             python3 benchmarks/gpu_ab.py --shape tinyllama --parts decode1 --rounds 3 \
             > "$out/decode_ab.log" 2>&1
           grep -E "^done|median" "$out/decode_ab.log" | cut -c1-300
           grep -hE "start-up" "$out"/worker*_decode1.log | cut -c1-300 ;;
    attention_split) python3 benchmarks/gpu_attention_split.py --out "$out/attention_split.json" \
             > "$out/attention_split.log" 2>&1
           grep -E "^attention_split|Error" "$out/attention_split.log" | cut -c1-400 ;;
    *) echo "cuda_host: unknown step $step (tests, start, serve, decode_env, decode_ab," \
            "attention_split)" >&2
       exit 2 ;;
  esac
done
echo "cuda_host: done at $SECONDS s"
