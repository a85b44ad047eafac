#!/usr/bin/env bash
# FlashAttention-4 (PyPI `flash-attn-4`, kernels in CUTLASS's Python DSL, compiled at run time) and its wheels for the
# GPU machine (Python 3.12, CUDA 13, x86-64), cut so each half fits one device call (64 MiB with the working tree):
#   bash scripts/fa4_wheels.sh download        # here: wheels into .fa4whl/1 (small ones + first half of the CUDA 13
#                                               # libs wheel, ~56 MB) and .fa4whl/2 (its second half, ~46 MB)
#   bash scripts/fa4_wheels.sh stage           # device call 1, carry .fa4whl/1: keep it in /tmp while the machine is warm
#   bash scripts/fa4_wheels.sh install         # device call 2 (back to back), carry .fa4whl/2: join, install to /tmp/fa4-site
# then `export PYTHONPATH=/tmp/fa4-site:$PYTHONPATH` and e.g. `python scripts/bench_attention.py --kernels flash fa4`.
set -euo pipefail
cd "$(dirname "$0")/.."
FA4=${FA4_VERSION:-4.0.0b40}
CUTLASS=${CUTLASS_DSL_VERSION:-4.8.1}
case "${1:-}" in
download)
  rm -rf .fa4whl/1 .fa4whl/2 .fa4whl/tmp && mkdir -p .fa4whl/1 .fa4whl/2 .fa4whl/tmp
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  for w in "flash-attn-4==$FA4" "nvidia-cutlass-dsl==$CUTLASS" "nvidia-cutlass-dsl-libs-base==$CUTLASS" \
           "nvidia-cutlass-dsl-libs-core==$CUTLASS" "nvidia-cutlass-dsl-libs-cu13==$CUTLASS" quack-kernels \
           "apache-tvm-ffi<0.2" torch-c-dlpack-ext; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
      -d .fa4whl/tmp "$w"
  done
  big=$(ls .fa4whl/tmp/nvidia_cutlass_dsl_libs_cu13-*.whl)
  half=$(( ($(stat -c %s "$big") + 1) / 2 ))
  split -b "$half" -d "$big" ".fa4whl/tmp/$(basename "$big").part"
  mv ".fa4whl/tmp/$(basename "$big").part00" .fa4whl/1/ && mv ".fa4whl/tmp/$(basename "$big").part01" .fa4whl/2/
  rm "$big" && mv .fa4whl/tmp/*.whl .fa4whl/1/ && rmdir .fa4whl/tmp
  du -sh .fa4whl/1 .fa4whl/2 ;;
stage)
  mkdir -p /tmp/fa4-stage && cp .fa4whl/1/* /tmp/fa4-stage/ && ls -la /tmp/fa4-stage ;;
install)
  cp .fa4whl/2/* /tmp/fa4-stage/
  cd /tmp/fa4-stage
  for p in *.part00; do cat "$p" "${p%00}01" > "${p%.part00}" && rm "$p" "${p%00}01"; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fa4-site ./*.whl
  PYTHONPATH=/tmp/fa4-site python3 -c "import flash_attn.cute as f; print('flash-attn-4 imports:', f.__file__)" ;;
*) echo "usage: $0 download|stage|install" >&2; exit 2 ;;
esac
