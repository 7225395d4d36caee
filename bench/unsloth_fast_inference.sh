#!/usr/bin/env bash
# Unsloth's GRPO with fast_inference=True (generation by its own vLLM engine, which shares the base
# weights with training) on the benchmark's workload: Qwen2.5 shapes, LoRA r16 on all linear layers,
# bf16, 64 completions (8 prompts x 8) of 1,024 tokens, dapo loss, beta 0, lr 1e-6; this project's
# clip and truncation settings (bench_unsloth.py --match-ours). Runs on a GPU machine where the
# wheels below were carried in (bench/README.md):
#
#   bash bench/unsloth_fast_inference.sh [RUN...]      RUN: 0.5b, 7b (default: 0.5b 7b)
#
# Needs, in the repository root: .uwhl (bash ../shared/device/make_unsloth_carry.sh .), .vllm2 and
# the first part of the vLLM archive in /root/vp (or VLLM_PART0_DIR), both from make_vllm_carry.sh,
# .whl with pydantic, pydantic-core, annotated-types and typing-inspection, and the benchmark
# tokenizer in .benchdata/tokenizer. vLLM is unpacked into /tmp/site and the Unsloth wheels
# (Unsloth, unsloth_zoo, TRL 1.15, datasets 4.8.5, bitsandbytes) into /tmp/usite, which comes first
# on PYTHONPATH; both are reused when a run before left them there.
#
# UFI_EXTRA adds arguments to every run (e.g. "--load-in-fp8": Unsloth's float8 path, which also needs
# torchao >= 0.15 among the .uwhl wheels, and compressed-tensors with loguru: vLLM 0.26's quantisation
# lookup imports it, and the slim vLLM archive leaves it out) and UFI_TAG a suffix to its file names (e.g.
# "_fp8"). UFI_SAVE_THREADS: CPU threads for saving the random 7B model (default 4, beside a 0.5B
# run; with 4 it took 302 s on an H100 machine's 16 cores).
#
# Each run has a timeout; the whole script ends by DEADLINE seconds (default 550, under a 600 s
# call). A run that was stopped or failed still writes its JSON with the stage it reached and the
# error (type, message, failing frame). The 7B run starts only with at least MIN_7B seconds left
# (default 150); its random model is saved by a low-priority CPU process while the 0.5B run goes on
# (driver.log says when it finished, against the 0.5B run's step times in its log).
# Output, at most 8 files in OUT (default outputs/bench/unsloth-fast): unsloth_fast_<run>.json,
# .log and .progress.jsonl per run, nvidia_smi.log (per-process GPU memory every 5 s), driver.log.
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
DEADLINE=${DEADLINE:-550}
MIN_7B=${MIN_7B:-150}
PY=${PYTHON:-python3}
OUT=${OUT:-outputs/bench/unsloth-fast}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
RUNS=${*:-0.5b 7b}
for r in $RUNS; do case $r in 0.5b|7b) ;; *) echo "unknown run '$r'; runs: 0.5b 7b" >&2; exit 2 ;; esac; done
LOG=$OUT/driver.log
say() { echo "=== $(date +%T) [$SECONDS s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - SECONDS)); }

# --- the two environments -------------------------------------------------------------------
SITE=${UFI_SITE:-/tmp/site} USITE=${UFI_USITE:-/tmp/usite} MODELS=${UFI_MODELS:-/tmp/bench_models}
if [ ! -f "$SITE/vllm/__init__.py" ]; then
  part0=$(ls "${VLLM_PART0_DIR:-/root/vp}"/*.part0 2>/dev/null | head -1)
  part1=$(ls .vllm2/*.part1 2>/dev/null | head -1)
  if [ -z "$part0" ] || [ -z "$part1" ]; then
    say "SETUP FAILED: need ${VLLM_PART0_DIR:-/root/vp}/*.part0 (copied from .vllm1 by the call before) and .vllm2/*.part1 (carried)"
    exit 3
  fi
  say "unpacking vLLM into $SITE"
  mkdir -p "$SITE"
  cat "$part0" "$part1" | "$PY" -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('$SITE')" \
    || { say "SETUP FAILED: unpacking the vLLM archive"; exit 3; }
  # vLLM's small dependencies, and pydantic and its three dependencies from .whl (not its TRL/datasets).
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .vllm2/*.whl \
    .whl/pydantic-*.whl .whl/pydantic_core-*.whl .whl/annotated_types-*.whl .whl/typing_inspection-*.whl >> "$LOG" 2>&1 \
    || { say "SETUP FAILED: installing .vllm2 and pydantic wheels (see driver.log)"; exit 3; }
fi
if [ ! -d "$USITE/unsloth" ]; then
  say "installing the Unsloth wheels into $USITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$USITE" .uwhl/*.whl >> "$LOG" 2>&1 \
    || { say "SETUP FAILED: installing .uwhl (see driver.log)"; exit 3; }
fi
[ -f .benchdata/tokenizer/tokenizer_config.json ] || { say "SETUP FAILED: carry .benchdata (the benchmark tokenizer)"; exit 3; }
export PYTHONPATH=$USITE:$SITE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false BENCH_TOKENIZER=.benchdata/tokenizer \
  HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_DISABLE_STATISTICS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
say "environment ready: PYTHONPATH=$PYTHONPATH; runs: $RUNS"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader >> "$LOG" 2>&1

(while true; do
   echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"; sleep 5
 done > "$OUT/nvidia_smi.log" 2>&1) &
WATCHER=$!

SAVER=""
case " $RUNS " in *" 7b "*)
  if [ ! -f "$MODELS/qwen2.5-7b/config.json" ]; then
    say "saving the random 7B model to $MODELS/qwen2.5-7b on the CPU, in the background"
    (OMP_NUM_THREADS=${UFI_SAVE_THREADS:-4} nice -n 19 "$PY" - "$MODELS/qwen2.5-7b" >> "$LOG" 2>&1 <<'EOF'
import sys, time, torch
import bench._common as c
c.ACTIVE_SHAPE = "qwen2.5-7b"
t = time.perf_counter()
folder = sys.argv[1]
model = c.build_model(seed=0, device="cpu", dtype=torch.bfloat16)
model.save_pretrained(folder + ".tmp")
c.load_tokenizer().save_pretrained(folder + ".tmp")
import os; os.replace(folder + ".tmp", folder)
print(f"=== {time.strftime('%H:%M:%S')} saved the random 7B model in {time.perf_counter() - t:.0f} s", flush=True)
EOF
    ) &
    SAVER=$!
  fi ;;
esac

# run NAME SECONDS ARGS...: one bench_unsloth.py run with a timeout; its JSON, log and progress in OUT.
run() {
  local name=$1 limit=$2; shift 2
  say "run $name (timeout ${limit} s): bench/bench_unsloth.py $*"
  name=$name${UFI_TAG:-}
  timeout -k 15 "$limit" "$PY" bench/bench_unsloth.py "$@" --out "$OUT/unsloth_fast_$name.json" > "$OUT/unsloth_fast_$name.log" 2>&1
  local rc=$?
  say "run $name exited with $rc"
  grep -E "^=== (FAILED|at |in )|^WARNING|^\{\"framework" "$OUT/unsloth_fast_$name.log" | tail -n 12 | tee -a "$LOG"
}
COMMON=(--fast-inference --lora 16 --tokens 1024 --rows 64 --match-ours ${UFI_EXTRA:-})

for r in $RUNS; do
  case $r in
    0.5b)
      limit=$(( $(left) - 25 ))  # the 0.5B result comes first: the 7B run gets what it leaves
      if [ "$limit" -lt 60 ]; then say "run 0.5b: not started, $(left) s left"; continue; fi
      run 0.5b "$limit" "${COMMON[@]}" --shape qwen2.5-0.5b --steps 3 --warmup 1 --model-dir "$MODELS/qwen2.5-0.5b" ;;
    7b)
      if [ -n "$SAVER" ]; then say "waiting for the 7B model to be saved"; wait "$SAVER"; fi
      if [ ! -f "$MODELS/qwen2.5-7b/config.json" ]; then say "run 7b: not started, the random model was not saved (driver.log)"; continue; fi
      if [ "$(left)" -lt "$MIN_7B" ]; then say "run 7b: not started, $(left) s left (MIN_7B=$MIN_7B)"; continue; fi
      run 7b $(( $(left) - 25 )) "${COMMON[@]}" --shape qwen2.5-7b --steps "${STEPS_7B:-2}" --warmup 1 --model-dir "$MODELS/qwen2.5-7b" ;;
  esac
done
kill "$WATCHER" 2>/dev/null
[ -n "$SAVER" ] && kill "$SAVER" 2>/dev/null

for f in "$OUT"/*.log; do  # a file over 16 MiB would not come back: keep its head and tail
  if [ "$(stat -c %s "$f")" -gt 15000000 ]; then
    { head -c 2000000 "$f"; echo; echo "[... cut ...]"; tail -c 12000000 "$f"; } > "$f.cut" && mv "$f.cut" "$f"
  fi
done
"$PY" - "$OUT" <<'EOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
print(f"\n{'run':<6} {'stage':<34} {'step s':>7} {'generate':>9} {'train':>7} {'peak GiB':>9} {'KV GiB':>7} {'vLLM util':>9} {'len':>6}  trainer / error")
for path in sorted(Path(sys.argv[1]).glob("unsloth_fast_*.json")):
    r = json.loads(path.read_text())
    f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"
    vllm = r.get("vllm") or {}
    kv = f"{vllm['kv_cache_gib']:.2f}" if isinstance(vllm.get("kv_cache_gib"), float) else "-"
    util = f"{vllm['gpu_memory_utilization']:.3f}" if isinstance(vllm.get("gpu_memory_utilization"), float) else "-"
    note = r.get("trainer") or ""
    if r.get("error"):
        note = f"{r['error']['type']}: {r['error']['message'][:150]}"
    elif r.get("checks_failed"):
        note += " CHECK FAILED: " + "; ".join(r["checks_failed"])
    print(f"{path.stem.removeprefix('unsloth_fast_'):<6} {str(r.get('stage'))[:34]:<34} {f('step_s', '.2f'):>7} {f('generate_s', '.2f'):>9} "
          f"{f('train_s', '.2f'):>7} {f('peak_gib', '.2f'):>9} {kv:>7} {util:>9} {f('mean_length', '.0f'):>6}  {note}")
EOF
say "done; results in $OUT"
