#!/usr/bin/env bash
# Runs rlmem's tests (CUDA ones included) and benchmarks on a GPU machine in one call.
# Logs and benchmark JSON go to $OUT (flat, so the device tool brings them back).
# Usage: RLMEM_MACHINE=nvidia-h100-x1 scripts/gpu_check.sh [all|tests|families|bench|bench-region|bench-phase|bench-grpo|bench-act|bench-tokens|bench-plan|bench-vmm|bench-verify|bench-verl|bench-prefix|prefix-tests|bench-megatron|bench-rollout|bench-numa|bench-real|bench-colocate|bench-server|bench-trl|serve|refactor-ab|train-real|comm|comm-patch|comm-debug|grpo-dist|two-gpu|bench-two-gpu|server-gpus|comm-gpus|tests-gpus|megatron-4] [args...]
# comm (2 GPUs): tests/test_comm.py and rlmem bench comm; with a newer libnccl assembled by scripts/nccl_parts.sh
# (/tmp/rlmem-nccl/libnccl.so.2), torch loads that one (LD_PRELOAD) and the suspend path runs.
# comm passes its args to rlmem bench comm (COMM_TESTS=0 skips tests/test_comm.py; COMM_VARIANTS picks the NCCL
# settings); comm-debug writes NCCL's INIT/ALLOC log of one group per rank; grpo-dist runs the two-GPU recipe
# tests and the 2.7B example under torchrun on every GPU with comms=keep and comms=suspend (args go to rlmem train).
# bench-grpo passes its args to rlmem bench grpo_colocated (e.g. --parts big-offload --merge);
# bench-act passes its args to rlmem bench activations (e.g. --models qwen2-wide).
# bench-megatron passes its args to rlmem bench megatron (e.g. --parts switch).
# megatron-4 (4 GPUs): rlmem bench megatron_parallel over every layout that fits (tp2, tp2-sp, pp2, dp2 and the
# four-rank tp2pp2, tp4, tp2pp2-vpp) into megatron_parallel-<machine>.json, then the gpus(2) and gpus(4) tests of
# tests/test_megatron_parallel.py (args go to the benchmark, e.g. --layouts tp2pp2,tp4,tp2pp2-vpp;
# MEGATRON4_TESTS=0 skips the tests). Carry .whl with megatron-core. With --comms suspend (every NCCL group
# suspended while the state is away) the carried NCCL is loaded and the file is megatron_parallel_suspend-*.
# bench-colocate passes its args to rlmem bench colocate (e.g. --parts handoff --merge).
# prefix-tests: the CUDA tests of the sampler (its two rooms, rollout/sampler and rollout/remote), serve, colocate and
# a group's shared prompt (tests/test_prefix_sampler.py, tests/test_shared_prompts.py); args go to pytest.
# bench-prefix passes its args to rlmem bench prefix (e.g. --no-train --merge).
# serve runs the CUDA tests of rlmem serve, engine=server and the two-process handoff (args go to pytest);
# bench-server passes its args to rlmem bench grpo_colocated --engine server (e.g. --parts big-offload --merge).
# Carry .whl (torch_memory_saver 0.0.10 for the phase_switch comparison, megatron-core 0.16.1 cp312 for the
# Megatron tests and benchmark, fastapi / starlette / pydantic / uvicorn for rlmem serve, and opentelemetry-api,
# which fastapi 0.155 to 0.165 import); see docs/benchmarks.md.
#
# Every GPU of the machine (four for the four-GPU runs), each call ending within CALL_S seconds (default 540: the
# device tool stops a command at 600), every command under coreutils' timeout with what the call has left:
# server-gpus: rlmem bench grpo_colocated --engine server --gpus <all> --rollout-dtype bf16 --merge, the parts its
#   args name (--parts ...; one or two a call), with --time-budget the call's time left, so a part that would run
#   past the call is cut or not started and the file is still written. The file of earlier calls is merged: from
#   /tmp/rlmem-results while the machine stays warm, else from bench/results/. Where the carried NCCL is staged,
#   server-big-suspend (comms=suspend; the bytes freed per rank in its summary and log) loads it, no other part.
# comm-gpus: rlmem bench comm on all GPUs with the carried NCCL (comm-<machine>.json), then with the machine's own
#   (comm_machine_nccl-<machine>.json); COMM_VARIANTS (default: default) and the args go to both (e.g. --reps 3).
# tests-gpus: the tests marked gpus(n) of GPU_TESTS (default: those that take a world size) with the carried NCCL
#   where staged, -v with durations; args go to pytest (e.g. -k world4 for the four-rank runs).
# Logs are packed at the end into $OUT/logs-<mode>-<pid>.tgz (PACK_LOGS=0: left as files); failures are also
# written as they happen to $OUT/test_failures.log (RLMEM_FAIL_LOG).
# A call carrying .nccl/part.K and .nccl/libnccl.sha256 (scripts/nccl_parts.sh prepare) receives the part first
# and assembles the library in /tmp/rlmem-nccl once all are there, so the parts travel with calls doing other work.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlmem-gpu-check}
mkdir -p "$OUT"
what=${1:-all}
shift || true
machine=${RLMEM_MACHINE:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
# Each failure's report as it happens (tests/conftest.py), should the call's limit cut pytest's summary.
export RLMEM_FAIL_LOG=${RLMEM_FAIL_LOG:-$OUT/test_failures.log}
# The device tool brings back at most 8 files: at the end the logs of this run go into one archive
# (logs-<mode>-<pid>.tgz), the JSON files stay as they are (PACK_LOGS=0 leaves everything).
pack_logs() {
  [[ ${PACK_LOGS:-1} == 1 ]] || return 0
  local logs
  mapfile -t logs < <(cd "$OUT" && find . -maxdepth 1 -type f ! -name '*.json' ! -name '*.tgz' -printf '%P\n')
  ((${#logs[@]})) && tar -C "$OUT" -czf "$OUT/logs-$what-$$.tgz" --remove-files "${logs[@]}"
  return 0
}
# The GPUs' clocks, temperature, power and what holds the clocks back, every 2 s while this runs (queries
# only; GPU_CLOCKS=0: none): a phase whose time moves between runs can be set beside them.
clocks_pid=
if [[ ${GPU_CLOCKS:-1} == 1 ]] && command -v nvidia-smi > /dev/null; then
  reasons=clocks_event_reasons.active  # the older drivers' name for it: clocks_throttle_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv,noheader > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,$reasons \
    --format=csv -l 2 > "$OUT/gpu_clocks-$what-$$.csv" 2>&1 &
  clocks_pid=$!
fi
finish() {
  [[ -n $clocks_pid ]] && kill "$clocks_pid" 2> /dev/null && wait "$clocks_pid" 2> /dev/null
  pack_logs
}
trap finish EXIT
# The call's deadline (bash's SECONDS counts from the script's start) and a command bounded by it.
deadline=$((SECONDS + ${CALL_S:-540}))
bounded() {  # bounded RESERVE CMD...: CMD under timeout, given the call's time left less RESERVE seconds
  local t=$((deadline - SECONDS - $1))
  shift
  if ((t < 30)); then
    echo "not run, ${t} s of the call left: $*" >&2
    return 124
  fi
  timeout -k 10 "$t" "$@"
}
# Wheels carried to the GPU machine (.whl/, git-ignored): see the header.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  # Installed without their dependencies: say at once which of them cannot be imported (a missing dependency
  # turns their tests into skips and their benchmark parts into failures further on).
  python3 - <<'PY' 2>&1 | tee "$OUT/wheels.txt"
import importlib
for name in ("fastapi", "uvicorn", "datasets"):  # the light ones with dependencies of their own
    try:
        importlib.import_module(name)
    except ImportError as e:
        if (getattr(e, "name", None) or "").split(".")[0] != name.split(".")[0]:  # else: not carried
            print(f"carried wheels: {name} cannot be imported: {e}")
PY
fi
# The carried NCCL (scripts/nccl_parts.sh): this call's part received, the library assembled once whole.
nccl_lib=${RLMEM_NCCL_DIR:-/tmp/rlmem-nccl}/libnccl.so.2
if compgen -G ".nccl/part.*" > /dev/null; then
  bash scripts/nccl_parts.sh collect 2>&1 | tee "$OUT/nccl_collect.log"
fi
preload_carried_nccl() {  # torch (started after this) loads the carried NCCL, where it is assembled
  if [[ -f $nccl_lib ]]; then
    export LD_PRELOAD="$nccl_lib${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
  return 0
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, platform; from importlib.metadata import version as v
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", torch.cuda.nccl.version(), "cuda-bindings", v("cuda-bindings"), "transformers", v("transformers"),
      "gpus", torch.cuda.device_count())'
  grep -E 'MemTotal|MemAvailable|HugePages_Total' /proc/meminfo
  cat /sys/kernel/mm/transparent_hugepage/enabled
  nproc
  ls -d /sys/devices/system/node/node* 2>/dev/null | tr '\n' ' '; echo
  nvidia-smi topo -m 2>/dev/null | head -4
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -rs tests "$@" 2>&1 | tee "$OUT/tests.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi

name=${machine:-$(python3 -c 'import torch; from rlmem.benchmarks._common import machine_name as m
print(m(torch.device("cuda", 0)))' 2>/dev/null)}
if [[ $what == serve ]]; then
  python3 -m pytest -q -rs -m cuda tests/test_serve.py tests/test_serve_train.py tests/test_remote_engine.py \
    tests/test_colocate_handoff.py tests/test_colocate_weights.py tests/test_hf_sampler.py tests/test_region_cuda.py "$@" \
    2>&1 | tee "$OUT/tests_serve.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-server ]]; then
  [[ -f bench/results/grpo_server-$name.json ]] && cp "bench/results/grpo_server-$name.json" "$OUT/"
  python3 -m rlmem bench grpo_colocated --engine server --machine "$name" --json "$OUT/grpo_server-$name.json" "$@" \
    2>&1 | tee "$OUT/bench_grpo_server.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-trl ]]; then
  # TRL's GRPOTrainer alone, with RLMemCallback, and with sampler_rollout (carry trl's wheel in .whl; args go
  # to rlmem bench trl, e.g. --parts trl,callback)
  python3 -m rlmem bench trl --machine "$name" --json "$OUT/trl-$name.json" "$@" 2>&1 | tee "$OUT/bench_trl.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == families ]]; then
  # rlmem train on every family x precision x rollout dtype, and engine=server on each family's default cell
  # (args go to rlmem bench families, e.g. --precisions fp16-mixed --server none --merge)
  [[ -f bench/results/families-$name.json ]] && cp "bench/results/families-$name.json" "$OUT/"
  python3 -m rlmem bench families --machine "$name" --json "$OUT/families-$name.json" "$@" \
    2>&1 | tee "$OUT/bench_families.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-region ]]; then
  python3 -m rlmem bench region --machine "$name" --chunk-sweep 256,1024,2048 --json "$OUT/region-$name.json" \
    2>&1 | tee "$OUT/bench_region.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-phase ]]; then
  python3 -m rlmem bench phase_switch --machine "$name" --json "$OUT/phase_switch-$name.json" \
    2>&1 | tee "$OUT/bench_phase_switch.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-grpo ]]; then
  extra=()
  [[ $what == bench-grpo ]] && extra=("$@")
  # --merge keeps parts measured in earlier calls (the parts take minutes each).
  [[ -f bench/results/grpo_colocated-$name.json ]] && cp "bench/results/grpo_colocated-$name.json" "$OUT/"
  python3 -m rlmem bench grpo_colocated --machine "$name" --json "$OUT/grpo_colocated-$name.json" "${extra[@]}" \
    2>&1 | tee "$OUT/bench_grpo_colocated.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-act ]]; then
  extra=()
  [[ $what == bench-act ]] && extra=("$@")
  # --merge keeps models measured in earlier calls
  [[ -f bench/results/activations-$name.json ]] && cp "bench/results/activations-$name.json" "$OUT/"
  python3 -m rlmem bench activations --machine "$name" --json "$OUT/activations-$name.json" "${extra[@]}" \
    2>&1 | tee "$OUT/bench_activations.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-tokens ]]; then
  python3 -m rlmem bench token_budget --machine "$name" --json "$OUT/token_budget-$name.json" \
    2>&1 | tee "$OUT/bench_token_budget.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-plan ]]; then
  extra=()
  [[ $what == bench-plan ]] && extra=("$@")
  python3 -m rlmem bench plan_accuracy --machine "$name" --json "$OUT/plan_accuracy-$name.json" "${extra[@]}" \
    2>&1 | tee "$OUT/bench_plan_accuracy.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == train-real ]]; then
  # rlmem train on the real-work path: a preset-shaped random model with a tokenizer and data made here.
  assets=/tmp/rlmem-assets
  python3 scripts/tiny_assets.py "$assets" 2>&1 | tee "$OUT/train_assets.log"
  for prec in bf16-mixed fp16-mixed; do
    rm -rf "/tmp/rlmem-train-$prec"  # an earlier call's run there, with other keys, would refuse this one
    python3 -m rlmem train model="${TRAIN_MODEL:-qwen2-1.5b}" tokenizer="$assets/tokenizer" data="$assets/arith.jsonl" \
      reward=math steps=3 prompts_per_step=16 group_size=4 max_new_tokens=32 micro_batch_size=16 offload=true \
      precision=$prec save_every=0 progress=false plot=false out_dir="/tmp/rlmem-train-$prec" "$@" \
      2>&1 | tee "$OUT/train_$prec.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi
if [[ $what == all || $what == bench || $what == bench-megatron ]]; then
  extra=()
  [[ $what == bench-megatron ]] && extra=("$@")
  # parts measured in earlier calls are kept (run_.previous() reads the file it will write)
  [[ -f bench/results/megatron-$name.json ]] && cp "bench/results/megatron-$name.json" "$OUT/"
  python3 -m rlmem bench megatron --machine "$name" --json "$OUT/megatron-$name.json" "${extra[@]}" \
    2>&1 | tee "$OUT/bench_megatron.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-real ]]; then
  # SmolLM2-135M-Instruct learning arithmetic (the GGUF file carried in parts and joined in /tmp, see docs/benchmarks.md):
  # args go to rlmem bench real_model, e.g. --model /tmp/smollm2.gguf --parts offload, then --parts nooffload --merge
  [[ -f bench/results/real_model-$name.json ]] && cp "bench/results/real_model-$name.json" "$OUT/"
  python3 -m rlmem bench real_model --machine "$name" --json "$OUT/real_model-$name.json" "$@" \
    2>&1 | tee "$OUT/bench_real_model.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-colocate ]]; then
  [[ -f bench/results/colocate-$name.json ]] && cp "bench/results/colocate-$name.json" "$OUT/"
  python3 -m rlmem bench colocate --machine "$name" --json "$OUT/colocate-$name.json" "$@" \
    2>&1 | tee "$OUT/bench_colocate.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-numa ]]; then
  python3 -m rlmem bench numa --machine "$name" --json "$OUT/numa-$name.json" 2>&1 | tee "$OUT/bench_numa.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-rollout ]]; then
  extra=()
  [[ $what == bench-rollout ]] && extra=("$@")
  # --merge keeps batch sizes measured in earlier calls
  [[ -f bench/results/rollout-$name.json ]] && cp "bench/results/rollout-$name.json" "$OUT/"
  python3 -m rlmem bench rollout --machine "$name" --json "$OUT/rollout-$name.json" "${extra[@]}" \
    2>&1 | tee "$OUT/bench_rollout.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == bench || $what == bench-verify ]]; then
  # the weight update's verification without vLLM (rlmem/benchmarks/verify.py), bf16 and fp32
  python3 -m rlmem bench verify --machine "$name" --json "$OUT/verify-$name.json" 2>&1 | tee "$OUT/bench_verify.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-verl ]]; then
  # verl's FSDP engine through rlmem against verl's own offload (carry verl's wheel and what its engine modules
  # import in .whl: docs/verl.md), the pinned link of rlmem bench region in the same call, then the CUDA tests of
  # TrainState (VERL_TESTS=0 skips them); args go to rlmem bench verl.
  python3 -m rlmem bench verl --machine "$name" --json "$OUT/verl-$name.json" "$@" 2>&1 | tee "$OUT/bench_verl.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  python3 -m rlmem bench region --machine "$name" --json "$OUT/region-$name.json" 2>&1 | tee "$OUT/bench_region.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  if [[ ${VERL_TESTS:-1} == 1 ]]; then
    python3 -m pytest tests/test_state.py tests/test_state_process.py -q -m cuda 2>&1 | tee "$OUT/tests_state_cuda.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
fi
if [[ $what == prefix-tests ]]; then
  python3 -m pytest -q -rs -m cuda tests/test_hf_sampler.py tests/test_gqa.py tests/test_slots.py tests/test_qkv.py \
    tests/test_experts.py tests/test_prefix_sampler.py tests/test_shared_prompts.py tests/test_serve.py \
    tests/test_serve_train.py tests/test_remote_engine.py tests/test_vllm_ipc.py tests/test_colocate_handoff.py \
    tests/test_colocate_weights.py "$@" 2>&1 | tee "$OUT/tests_prefix.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-prefix ]]; then
  [[ -f bench/results/prefix-$name.json ]] && cp "bench/results/prefix-$name.json" "$OUT/"
  bounded 30 python3 -m rlmem bench prefix --machine "$name" --json "$OUT/prefix-$name.json" "$@" \
    2>&1 | tee "$OUT/bench_prefix.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-vmm ]]; then
  python3 -m rlmem bench vmm_calls --machine "$name" --json "$OUT/vmm_calls-$name.json" "$@" 2>&1 | tee "$OUT/bench_vmm_calls.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == comm ]]; then
  preload_carried_nccl
  python3 -c 'import torch; print("torch reports NCCL", torch.cuda.nccl.version())' 2>&1 | tee "$OUT/comm_nccl.txt"
  if [[ ${COMM_TESTS:-1} == 1 ]]; then
    python3 -m pytest -q -rs tests/test_comm.py 2>&1 | tee "$OUT/tests_comm.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
  python3 -m rlmem bench comm --machine "$name" --json "$OUT/comm-$name.json" \
    --variants "${COMM_VARIANTS:-default,buff1m,ctas4,p2p0,connect0,lean}" "$@" 2>&1 | tee "$OUT/bench_comm.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == comm-patch ]]; then
  # Stock NCCL against rlmem's patch (patches/, scripts/nccl_build.sh), both built from one tag: one library
  # travels per call. Call 1 carries .nccl-build/stock (kept in /tmp while the machine stays warm); call 2,
  # at once, carries .nccl-build/patched and runs rlmem bench comm with stock as the baseline and the patched
  # library (NCCL_MEM_KEEP_BACKUP=1) as a variant; its args go to rlmem bench comm.
  stock=/tmp/rlmem-nccl-stock
  if [[ -f .nccl-build/stock/libnccl.so.2 ]]; then
    mkdir -p "$stock" && cp .nccl-build/stock/libnccl.so.2 "$stock/" && echo "stock NCCL staged in $stock"
  fi
  if [[ -f .nccl-build/patched/libnccl.so.2 ]]; then
    if [[ ! -f $stock/libnccl.so.2 ]]; then
      echo "no stock NCCL staged: carry .nccl-build/stock in the call before" >&2
      exit 1
    fi
    export LD_PRELOAD="$stock/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}"
    python3 -m rlmem bench comm --machine "$name" --json "$OUT/comm_nccl_patch-$name.json" \
      --libs "patched=$PWD/.nccl-build/patched/libnccl.so.2" "$@" 2>&1 | tee "$OUT/bench_comm_patch.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
fi
if [[ $what == comm-debug ]]; then
  # What one group allocates, from NCCL's own log (one file per rank under $OUT).
  preload_carried_nccl
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC NCCL_DEBUG_FILE="$OUT/nccl.%h.%p.log" \
    python3 -m rlmem bench comm --machine "$name" --counts 1 --reps 1 --phase-gib 0 "$@" 2>&1 | tail -5
fi
if [[ $what == grpo-dist ]]; then
  # rlmem train under torchrun on every GPU: the 2.7B example, communicators kept and suspended.
  preload_carried_nccl
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  if [[ ${GRPO_DIST_TESTS:-1} == 1 ]]; then
    bounded 20 python3 -m pytest -q -rs tests/test_grpo_dist.py -k "gpus" 2>&1 | tee "$OUT/tests_grpo_dist.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
  for comms in keep suspend; do
    rm -rf "/tmp/rlmem-grpo-dist-$comms"  # an earlier call's run: its keys may differ, its summary is stale
    # each run bounded by the call's time left (less what the other run and the JSON need)
    bounded $([[ $comms == keep ]] && echo "${GRPO_DIST_SUSPEND_S:-120}" || echo 20) \
      python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" -m rlmem train \
      examples/grpo_qwen2_2p7b.yaml comms=$comms progress=false plot=false save_every=0 \
      out_dir="/tmp/rlmem-grpo-dist-$comms" "$@" 2>&1 | tee "$OUT/grpo_dist_$comms.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    cp "/tmp/rlmem-grpo-dist-$comms/summary.json" "$OUT/grpo_dist_${comms}_summary.json" 2>/dev/null
    cp "/tmp/rlmem-grpo-dist-$comms/log.jsonl" "$OUT/grpo_dist_${comms}_log.jsonl" 2>/dev/null
  done
  # Both runs collected into grpo_dist-<machine>.json (GRPO_DIST_TESTS=0 above skips the tests)
  python3 scripts/grpo_dist_json.py "$OUT" "$name" 2>&1 | tee "$OUT/grpo_dist_json.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == refactor-ab ]]; then
  # A change of shape checked on the GPU: the CUDA tests of the sampler, serve, colocate, state and phases,
  # then rlmem bench rollout of the tree before the change (carried as .old/: mkdir .old && git archive REV
  # rlmem | tar -x -C .old) and of this one, in one call (args go to rlmem bench rollout).
  python3 -m pytest -q -rs -m cuda tests/test_hf_sampler.py tests/test_gqa.py tests/test_slots.py \
    tests/test_qkv.py tests/test_serve.py tests/test_serve_train.py tests/test_remote_engine.py \
    tests/test_vllm_ipc.py tests/test_colocate_handoff.py tests/test_colocate_weights.py tests/test_state.py \
    tests/test_state_process.py tests/test_phases.py 2>&1 | tee "$OUT/tests_refactor.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  for tree in old new; do
    root=$PWD; [[ $tree == old ]] && root=$PWD/.old
    PYTHONPATH="$root:/tmp/site" python3 -m rlmem bench rollout --machine "$name" --presets qwen2-2.5b \
      --batches 64 --no-varlen --json "$OUT/rollout_$tree-$name.json" "$@" 2>&1 | tee "$OUT/bench_rollout_$tree.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi
if [[ $what == two-gpu ]]; then
  # The two-GPU tests: a server on the second GPU alone (no context on the first), a server per rank,
  # Megatron-Core with TP / PP / DP (megatron-core carried in .whl), the Megatron example with --tp 2, FSDP2
  # under torchrun, the weight sync's bucketed gather on NCCL (args go to pytest, e.g. -k megatron).
  python3 -m pytest -q -rs -m gpus tests/test_serve.py tests/test_serve_dist.py tests/test_megatron_parallel.py \
    tests/test_megatron.py tests/test_grpo_dist.py tests/test_hf_sampler.py "$@" 2>&1 | tee "$OUT/tests_two_gpu.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == bench-two-gpu ]]; then
  # Megatron on two GPUs (TP, TP+SP, PP, DP), then the 2.7B example with a server per GPU against one process
  # per GPU (args go to rlmem bench grpo_colocated, e.g. --parts server-big-offload,big-offload --merge).
  python3 -m rlmem bench megatron_parallel --machine "$name" --json "$OUT/megatron_parallel-$name.json" \
    2>&1 | tee "$OUT/bench_megatron_parallel.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  [[ -f bench/results/grpo_server-$name.json ]] && cp "bench/results/grpo_server-$name.json" "$OUT/"
  python3 -m rlmem bench grpo_colocated --engine server --gpus 2 --rollout-dtype bf16 --machine "$name" \
    --json "$OUT/grpo_server-$name.json" "$@" 2>&1 | tee "$OUT/bench_grpo_server.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == megatron-4 ]]; then
  f=megatron_parallel-$name.json
  if [[ " $* " == *" --comms suspend "* || " $* " == *" --comms=suspend "* ]]; then
    # NCCL's suspend needs the carried NCCL (the tests then run with it too); its own file
    preload_carried_nccl
    f=megatron_parallel_suspend-$name.json
  fi
  # The benchmark first: its JSON is what the call is for, should the tests run past the call's limit.
  bounded 10 python3 -m rlmem bench megatron_parallel --machine "$name" --json "$OUT/$f" \
    "$@" 2>&1 | tee "$OUT/bench_megatron_parallel.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  if [[ ${MEGATRON4_TESTS:-1} == 1 ]]; then
    bounded 5 python3 -m pytest -q -rs -m gpus tests/test_megatron_parallel.py 2>&1 | tee "$OUT/tests_megatron_4.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
fi
if [[ $what == server-gpus ]]; then
  # GPUS: fewer ranks than GPUs (or, with --device cpu in the args, Gloo ranks on the host)
  gpus=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
  f=grpo_server-$name.json
  kept=${RLMEM_KEPT_DIR:-/tmp/rlmem-results}  # this file between the calls made while the machine stays warm
  mkdir -p "$kept"
  if [[ -f $kept/$f ]]; then
    cp "$kept/$f" "$OUT/"
  elif [[ -f bench/results/$f ]]; then
    cp "bench/results/$f" "$OUT/"
  fi
  suspend=()
  [[ -f $nccl_lib ]] && suspend=(--suspend-nccl "$nccl_lib")
  # The benchmark stops starting (and cuts) parts 45 s before the call's end, to write its file (its clock
  # starts after torch and CUDA are up, up to 15 s later); the timeout 10 s before the end is the net under it.
  bounded 10 python3 -m rlmem bench grpo_colocated --engine server --gpus "$gpus" --rollout-dtype bf16 --merge \
    --time-budget $((deadline - SECONDS - 45)) "${suspend[@]}" --machine "$name" --json "$OUT/$f" "$@" \
    2>&1 | tee "$OUT/bench_grpo_server_gpus.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  [[ -f $OUT/$f ]] && cp "$OUT/$f" "$kept/"
fi
if [[ $what == comm-gpus ]]; then
  # The carried NCCL first (its suspend path is what is measured), leaving COMM_MACHINE_S for the machine's.
  if [[ -f $nccl_lib ]]; then
    bounded "${COMM_MACHINE_S:-150}" env LD_PRELOAD="$nccl_lib${LD_PRELOAD:+:$LD_PRELOAD}" python3 -m rlmem bench \
      comm --machine "$name" --json "$OUT/comm-$name.json" --variants "${COMM_VARIANTS:-default}" "$@" \
      2>&1 | tee "$OUT/bench_comm_carried.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  else
    echo "no carried NCCL at $nccl_lib (scripts/nccl_parts.sh): the machine's NCCL only" | tee "$OUT/bench_comm_carried.log"
    status=1
  fi
  bounded 10 python3 -m rlmem bench comm --machine "$name" --json "$OUT/comm_machine_nccl-$name.json" \
    --variants "${COMM_VARIANTS:-default}" "$@" 2>&1 | tee "$OUT/bench_comm_machine_nccl.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == tests-gpus ]]; then
  preload_carried_nccl
  python3 -c 'import torch; print("torch reports NCCL", torch.cuda.nccl.version())' 2>&1 | tee "$OUT/tests_gpus_nccl.txt"
  read -r -a files <<< "${GPU_TESTS:-tests/test_serve.py tests/test_comm.py tests/test_grpo_dist.py tests/test_serve_dist.py tests/test_state_process.py tests/test_megatron.py tests/test_hf_sampler.py}"
  bounded 10 python3 -m pytest -v -rs --durations=0 -m gpus "${files[@]}" "$@" 2>&1 | tee "$OUT/tests_gpus.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
exit $status
