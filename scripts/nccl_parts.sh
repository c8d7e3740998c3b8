#!/usr/bin/env bash
# Delivers a newer libnccl (nvidia-nccl-cu13, with ncclCommSuspend) to the GPU machine, whose transfers take at
# most 64 MiB per call: the library is compressed, split into parts under .nccl/ (git-ignored), sent one part per
# call while the machine is held, and reassembled there. torch then loads it in place of its bundled NCCL through
# LD_PRELOAD, set before torch starts (scripts/gpu_check.sh does it when the library is there).
#
#   here:            scripts/nccl_parts.sh prepare [VERSION]      # .nccl/part.0 ... part.N and libnccl.sha256
#   or:              scripts/nccl_parts.sh prepare-file LIB       # a library built by scripts/nccl_build.sh
#   GPU, per part:   scripts/nccl_parts.sh receive               # carry ".nccl/part.K" (and .nccl/libnccl.sha256)
#   GPU, at the end: scripts/nccl_parts.sh assemble              # /tmp/rlmem-nccl/libnccl.so.2, checked
#   GPU, any call:   scripts/nccl_parts.sh collect               # receive, and assemble once all are there
#                    (scripts/gpu_check.sh does this at the start of every call that carries a part, so the
#                    parts can travel with calls that do other work)
#   GPU:             LD_PRELOAD=/tmp/rlmem-nccl/libnccl.so.2 python3 -c 'import torch; print(torch.cuda.nccl.version())'
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${RLMEM_NCCL_DIR:-/tmp/rlmem-nccl}
PART_BYTES=${RLMEM_NCCL_PART_BYTES:-54000000}  # the repository and the part together stay under 64 MiB
case "${1:-}" in
  prepare)
    version=${2:-2.32.3}
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps "nvidia-nccl-cu13==$version" -d "$work"
    (cd "$work" && python3 -m zipfile -e ./*.whl x)
    lib=$(find "$work/x" -name 'libnccl.so.2' | head -1)
    rm -rf .nccl && mkdir -p .nccl
    sha256sum "$lib" | cut -d' ' -f1 > .nccl/libnccl.sha256
    xz -T0 -6 -c "$lib" | split -b "$PART_BYTES" -d -a 1 - .nccl/part.
    rm -rf "$work"
    ls -l .nccl
    ;;
  prepare-file)
    # A library built here (scripts/nccl_build.sh) instead of the wheel's.
    lib=${2:?usage: $0 prepare-file PATH/libnccl.so.2}
    rm -rf .nccl && mkdir -p .nccl
    sha256sum "$lib" | cut -d' ' -f1 > .nccl/libnccl.sha256
    xz -T0 -6 -c "$lib" | split -b "$PART_BYTES" -d -a 1 - .nccl/part.
    ls -l .nccl
    ;;
  receive)
    mkdir -p "$DEST"
    for p in .nccl/part.* .nccl/libnccl.sha256; do
      [[ -f $p ]] && cp "$p" "$DEST/"
    done
    ls -l "$DEST"
    ;;
  collect)
    # The parts arrive one per call; the library is whole when their concatenation is a complete xz stream
    # (xz -t fails on a truncated one), and checked against its sha256 as it is assembled.
    lib="$DEST/libnccl.so.2"
    if [[ -f $lib && -f $DEST/libnccl.sha256 ]] \
      && [[ $(sha256sum "$lib" | cut -d' ' -f1) == "$(cat "$DEST/libnccl.sha256")" ]]; then
      echo "NCCL already assembled: $lib"
      exit 0
    fi
    bash scripts/nccl_parts.sh receive
    if compgen -G "$DEST/part.*" > /dev/null && cat "$DEST"/part.* | xz -t 2> /dev/null; then
      bash scripts/nccl_parts.sh assemble
    else
      echo "NCCL parts so far: $(cd "$DEST" && echo part.*)"
    fi
    ;;
  assemble)
    cat "$DEST"/part.* | xz -d > "$DEST/libnccl.so.2.tmp"
    want=$(cat "$DEST/libnccl.sha256")
    got=$(sha256sum "$DEST/libnccl.so.2.tmp" | cut -d' ' -f1)
    [[ $want == "$got" ]] || { echo "checksum mismatch: $got, want $want" >&2; exit 1; }
    mv "$DEST/libnccl.so.2.tmp" "$DEST/libnccl.so.2"
    rm -f "$DEST"/part.*
    LD_PRELOAD="$DEST/libnccl.so.2" python3 -c 'import torch; print("torch reports NCCL", torch.cuda.nccl.version())'
    ;;
  *)
    echo "usage: $0 prepare [VERSION] | prepare-file PATH | receive | assemble | collect" >&2
    exit 2
    ;;
esac
