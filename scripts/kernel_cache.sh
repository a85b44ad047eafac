# Sourced by the device-call scripts (gpu_bench_call.sh, gpu_qwen35_call.sh, gpu_e2e.sh) after OUT is set.
# Triton (FLA's autotune results too) and inductor caches in an ignored folder of the checkout: a warm device machine
# keeps it between calls, so a later call skips the minutes of autotuning and compiling. Autotune results are kept on
# disk (TRITON_CACHE_AUTOTUNING=1, as grpo/model.py sets for every run) and, at exit, the small JSON files with them
# are packed into $OUT/triton_autotune.tgz (`save_autotune_results`, the caller's EXIT trap): unpacked into
# .kernel-cache/triton on the machine that sends the calls and carried back (`carry: [".kernel-cache"]`), a fresh
# machine skips FLA's autotuning (it still compiles the chosen configs, seconds each).
# A machine whose cache holds no autotune results starts from the newest set kept with the logs
# (docs/results/*/triton_autotune.tgz, tracked: it travels with every call). With autotune results alone, FLA's
# check still took ~90 s per head size on a fresh H200 machine (2026-12-04; compiling the chosen configs, we think),
# so the compiled kernels of the libraries (every Triton cache entry without inductor's `triton_*` kernels: FLA's)
# are packed too, into $OUT/triton_kernels.tgz (up to KERNELS_MAX_MB, 15 by default; 0: not packed): unpacked into
# .kernel-cache/triton here and carried (`carry: [".kernel-cache"]`), the next machine should load, not compile them.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.kernel-cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.kernel-cache/inductor}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
save_autotune_results() {
  [ -d "$TRITON_CACHE_DIR" ] || return 0
  local out; out=$(cd "$OUT" && pwd) || return 0
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$out/triton_autotune.tgz" -T - 2>/dev/null \
    && echo "autotune results: $(tar tzf "$out/triton_autotune.tgz" | wc -l) files in $out/triton_autotune.tgz")
  save_library_kernels "$out"
}
save_library_kernels() {  # $1: the folder to write triton_kernels.tgz into
  local out=$1 max=$((${KERNELS_MAX_MB:-15} * 1024 * 1024)) size
  [ "$max" -gt 0 ] || return 0  # KERNELS_MAX_MB=0: not packed (a call that returns 8 files already)
  local dirs; dirs=$(cd "$TRITON_CACHE_DIR" 2>/dev/null && for d in */; do
    [ -n "$(find "$d" -maxdepth 1 -name 'triton_*' -print -quit)" ] || echo "${d%/}"; done)
  # none compiled (no FLA in this call): no file, the call's 8 returned files stay for its logs
  [ -n "$dirs" ] && [ -n "$(cd "$TRITON_CACHE_DIR" && find $dirs -maxdepth 1 -name '*.cubin' -print -quit)" ] \
    || return 0
  (cd "$TRITON_CACHE_DIR" && echo "$dirs" | tar czf "$out/triton_kernels.tgz" -T - 2>/dev/null) || return 0
  size=$(stat -c %s "$out/triton_kernels.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt "$max" ]; then
    rm -f "$out/triton_kernels.tgz"
    echo "library kernels: $((size / 1048576)) MiB packed, over KERNELS_MAX_MB=${KERNELS_MAX_MB:-15}: not kept"
  else
    echo "library kernels: $(tar tzf "$out/triton_kernels.tgz" | grep -c '/$') cache entries, $((size / 1024)) KiB in" \
      "$out/triton_kernels.tgz"
  fi
}
seed_autotune_results() {
  [ -n "$(find "$TRITON_CACHE_DIR" -name '*.autotune.json' 2>/dev/null | head -1)" ] && return 0
  local tgz; tgz=$(ls -1 docs/results/*/triton_autotune.tgz 2>/dev/null | sort | tail -1)
  [ -n "$tgz" ] || return 0
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$tgz" -C "$TRITON_CACHE_DIR" \
    && echo "autotune results: $(tar tzf "$tgz" | wc -l) files from $tgz"
}
seed_autotune_results
