#!/usr/bin/env bash
# Builds NCCL with rlmem's suspend/resume patch (patches/nccl-2.30.7-suspend-backups.patch: host backups kept
# from one suspend to the next with NCCL_MEM_KEEP_BACKUP=1, copies asynchronous with one synchronization per
# call) for Hopper only, from an NCCL source tree at the tag the patch is for, and hands the library to
# scripts/nccl_parts.sh to be carried to the GPU machine (which has nvcc but no NCCL sources).
#
#   scripts/nccl_build.sh NCCL_SRC [stock|patched]     # -> .nccl-build/<kind>/libnccl.so.2
#   scripts/nccl_parts.sh prepare-file .nccl-build/patched/libnccl.so.2   # or carry .nccl-build/<kind> (33 MB)
#
# Built side by side, stock and patched differ only by the patch, so the comm benchmark compares them fairly;
# rlmem loads either only when the user opts in (LD_PRELOAD), never by default.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: $0 NCCL_SRC [stock|patched]}
kind=${2:-patched}
root=$PWD
work=$(mktemp -d)
git -C "$src" archive --format=tar HEAD | tar -x -C "$work"
if [[ $kind == patched ]]; then
  (cd "$work" && patch -p1 < "$root/patches/nccl-2.30.7-suspend-backups.patch")
fi
make -C "$work" -j"$(nproc)" src.build NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" \
  CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
mkdir -p ".nccl-build/$kind"
cp -L "$work/build/lib/libnccl.so.2" ".nccl-build/$kind/libnccl.so.2"
# Without its local symbols (58 -> 33 MB): one library then travels to the GPU machine in one call.
strip --strip-unneeded ".nccl-build/$kind/libnccl.so.2"
rm -rf "$work"
ls -l ".nccl-build/$kind"
