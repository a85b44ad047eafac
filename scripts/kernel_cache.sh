# Sourced by the device-call scripts (gpu_bench_call.sh, gpu_qwen35_call.sh, gpu_e2e.sh) after OUT is set.
# Triton (FLA's autotune results too) and inductor caches in an ignored folder of the checkout: a warm device machine
# keeps it between calls, so a later call skips the minutes of autotuning and compiling. Autotune results are kept on
# disk (TRITON_CACHE_AUTOTUNING=1, as grpo/model.py sets for every run) and, at exit, the small JSON files with them
# are packed into $OUT/triton_autotune.tgz (`save_autotune_results`, the caller's EXIT trap): unpacked into
# .kernel-cache/triton on the machine that sends the calls and carried back (`carry: [".kernel-cache"]`), a fresh
# machine skips FLA's autotuning (it still compiles the chosen configs, seconds each).
# The compiled kernels themselves stay behind (tens of MB). A machine whose cache holds no autotune results starts
# from the newest set kept with the logs (docs/results/*/triton_autotune.tgz, tracked: it travels with every call).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.kernel-cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.kernel-cache/inductor}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
save_autotune_results() {
  [ -d "$TRITON_CACHE_DIR" ] || return 0
  local out; out=$(cd "$OUT" && pwd) || return 0
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$out/triton_autotune.tgz" -T - 2>/dev/null \
    && echo "autotune results: $(tar tzf "$out/triton_autotune.tgz" | wc -l) files in $out/triton_autotune.tgz")
}
seed_autotune_results() {
  [ -n "$(find "$TRITON_CACHE_DIR" -name '*.autotune.json' 2>/dev/null | head -1)" ] && return 0
  local tgz; tgz=$(ls -1 docs/results/*/triton_autotune.tgz 2>/dev/null | sort | tail -1)
  [ -n "$tgz" ] || return 0
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$tgz" -C "$TRITON_CACHE_DIR" \
    && echo "autotune results: $(tar tzf "$tgz" | wc -l) files from $tgz"
}
seed_autotune_results
