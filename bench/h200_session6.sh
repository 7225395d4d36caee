#!/usr/bin/env bash
# The device-tool calls of the sixth session (2026-12-01, late night): issue 20's same-call
# comparison with Unsloth. One background driver (phase run) does everything in order, writing to
# /root/bg; the calls only start it and wait for it, so no single call hits the 10-minute limit.
#   A (carry .whl .uwhl .benchdata): install, start the driver, wait     W (no carry): wait, collect
#   B (carry .whl .uwhl .benchdata, a fresh machine): a drift run with --profile-slow, then the 7B
#     comparisons (driver phase run7b)
# A call that runs past its limit kills every process it started, background ones included (seen:
# the first driver died with call A at 600 s). Keep WAIT well under the call's timeout_s.
# Phase B needs about 25 minutes: B (WAIT=480, timeout_s 600), then W calls until driver.done;
# Unsloth's 7B step at 16 x 8192 takes more than 9 minutes (its first generation had not ended
# after 530 s on a shared GPU).
# Our code runs from the working tree (PYTHONPATH=$PWD first; the wheel in /tmp/site supplies the
# entry points). Unsloth runs with its own site (/tmp/usite: Unsloth 2026.10.9, TRL 1.15, datasets
# 4.8.5), never with vLLM on the path.
set -uo pipefail
phase=${1:?phase A|W|run}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false BENCH_TOKENIZER=/root/benchdata/tokenizer HF_HUB_OFFLINE=1
OURS="env PYTHONPATH=$PWD:/tmp/site"
UNS="env PYTHONPATH=$PWD:/tmp/usite HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_DISABLE_STATISTICS=1"
BG=/root/bg
collect() { mkdir -p $OUT/bg && cp -r $BG/. $OUT/bg/ 2>/dev/null; tail -n 5 $BG/driver.log; }
wait_driver() {  # up to $1 seconds
  for i in $(seq $(( $1 / 10 ))); do [ -f $BG/driver.done ] && break; sleep 10; done
  collect; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
}
case $phase in
A)
  mkdir -p $BG && rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/usite .uwhl/*.whl
  cp -r $PWD /root/tree  # the driver outlives this call's copy of the tree
  (cd /root/tree && nohup bash bench/h200_session6.sh run > $BG/driver.log 2>&1 &)
  wait_driver ${WAIT:-480}
  ;;
B)
  mkdir -p $BG && rm -rf /root/benchdata && cp -r .benchdata /root/benchdata
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/usite .uwhl/*.whl
  cp -r $PWD /root/tree
  (cd /root/tree && nohup bash bench/h200_session6.sh run7b > $BG/driver.log 2>&1 &)
  wait_driver ${WAIT:-480}
  ;;
W)
  wait_driver ${WAIT:-570}
  ;;
run)
  echo "=== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  # The 7B model for Unsloth, saved once, on 4 CPU threads while the 0.4B runs go on.
  (OMP_NUM_THREADS=4 $UNS python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --save-only \
     > $BG/save7b.log 2>&1; echo "saved $(date +%T)" >> $BG/save7b.log) &
  echo "=== ours 0.4B LoRA 64x256 $(date +%T)"
  $OURS python3 bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 8 --warmup 2 \
    --variants eager default lean lean-eager lean-nooffload all --out $BG/mem_0.4b.json 2>&1 | grep -v '^step ' > $BG/mem_0.4b.log
  tail -n 80 $BG/mem_0.4b.log
  echo "=== Unsloth 0.4B LoRA 64x256 $(date +%T)"
  $UNS timeout 600 python3 bench/bench_unsloth.py --lora 16 --tokens 256 --rows 64 --steps 3 --warmup 1 \
    --out $BG/unsloth_0.4b.json > $BG/unsloth_0.4b.log 2>&1
  tail -n 5 $BG/unsloth_0.4b.log
  wait  # the saved 7B model
  bash bench/h200_session6.sh run7b-only
  ;;
run7b)
  echo "=== drift: 0.4B eager LoRA, 20 passes, tables of any pass 1.5x the median $(date +%T)"
  $OURS timeout 300 python3 bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 20 --warmup 2 \
    --variants eager --torch-profile $BG/slow --profile-slow 1.5 --out $BG/drift.json 2>&1 | grep -v '^step ' > $BG/drift.log
  tail -n 4 $BG/drift.log; ls $BG/slow 2>/dev/null
  (OMP_NUM_THREADS=4 $UNS python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --save-only \
     > $BG/save7b.log 2>&1)
  bash bench/h200_session6.sh run7b-only
  ;;
run7b-only)
  echo "=== 7B 16x8192: four processes at once (each one's peak memory is its own; seconds are shared) $(date +%T)"
  # Every process's device memory every 10 s: Unsloth reports its peak only at the end.
  (while [ ! -f $BG/driver.done ]; do
     echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"; sleep 10
   done > $BG/nvidia_smi_apps.log 2>&1 &)
  for v in ${OURS_7B:-long-lean qlora-long}; do  # "long" (merged decoding) measured 34.2 GiB before
    $OURS timeout 1500 python3 bench/profile_memory.py --shape qwen2.5-7b --lora 16 --tokens 8192 --rows 16 --steps 1 \
      --warmup 0 --variants $v --out $BG/mem7b_$v.json > $BG/mem7b_$v.log 2>&1 &
  done
  $UNS timeout 1500 python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --tokens 8192 --rows 16 \
    --micro-rows 1 --steps 1 --warmup 0 --out $BG/unsloth_7b.json > $BG/unsloth_7b.log 2>&1 &
  $UNS timeout 1500 python3 bench/bench_unsloth.py --shape qwen2.5-7b --model-dir /root/m7b --tokens 8192 --rows 16 \
    --micro-rows 1 --steps 1 --warmup 0 --load-in-4bit --out $BG/unsloth_7b_4bit.json > $BG/unsloth_7b_4bit.log 2>&1 &
  while [ -n "$(jobs -rp)" ]; do
    sleep 30; echo "--- $(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  done
  for f in $BG/mem7b_*.log $BG/unsloth_7b*.log; do echo "== $f"; grep -v '^step ' $f | tail -n 12; done
  echo "=== done $(date +%T)"; touch $BG/driver.done
  ;;
esac
