#!/usr/bin/env bash
# One GPU lease, prepared ahead: everything bench/gpu_check.py needs, packed so that a lent machine
# spends its minutes measuring. The device tool sends this repository and nothing beside it (not
# ../shared, not a nanoGPT snapshot) to a bare machine whose python3 already holds torch, pandas,
# pyarrow, scipy, matplotlib, transformers and pytest (the 'cuda' image; nothing can be fetched there).
# So the kit puts WikiText-2 and nanoGPT's model.py in .lease/ (ignored by git), which the call carries.
#
#   here, before the lease:  bash bench/gpu_lease.sh kit NANOGPT_DIR     # NANOGPT_DIR holds model.py
#                            bash bench/gpu_lease.sh run --device cpu --quick   # the same path, checked here
#   the device call:         command "bash bench/gpu_lease.sh run", carry [".lease"], timeout_s 600
#
# `run` prints the machine, then runs gpu_check.py with a deadline inside the call's limit; its table
# and log land in $OUT (they come back with the call) and the table is rewritten after every row, so a
# run cut short keeps what it measured. Commit $OUT/gpu_check.md as docs/results/gpu/gpu_check.md.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.lease

case "${1:-}" in
kit)
    src="${QKGEOM_WIKITEXT_DIR:-../shared/data/wikitext}/wikitext-2"
    nano="${2:?usage: bash bench/gpu_lease.sh kit NANOGPT_DIR (a folder holding the model.py of nanoGPT)}"
    [[ -f "$src/train.txt" ]] || { echo "no WikiText-2 at $src (set QKGEOM_WIKITEXT_DIR)" >&2; exit 2; }
    [[ -f "$nano/model.py" ]] || { echo "no model.py in $nano" >&2; exit 2; }
    git check-ignore -q "$KIT/x" || { echo "$KIT/ is not ignored by git: it would travel as part of the tree" >&2; exit 2; }
    rm -rf "$KIT.tmp" && mkdir -p "$KIT.tmp/wikitext/wikitext-2" "$KIT.tmp/nanogpt"
    cp "$src"/{train,valid,test}.txt "$KIT.tmp/wikitext/wikitext-2/"
    cp "$nano/model.py" "$KIT.tmp/nanogpt/"
    rm -rf "$KIT" && mv "$KIT.tmp" "$KIT"  # whole or not at all
    du -sh "$KIT"
    ;;
run)
    shift
    [[ -d "$KIT/wikitext/wikitext-2" ]] || { echo "no $KIT/: run 'bash bench/gpu_lease.sh kit' first and carry it" >&2; exit 2; }
    out="${OUT:-/tmp/gpu_lease}"
    mkdir -p "$out"
    py="${PYTHON:-python3}"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" QKGEOM_WIKITEXT_DIR="$PWD/$KIT/wikitext" MPLBACKEND=Agg
    {
        date -u
        "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
              "cuda", torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        nproc
    } 2>&1 | tee "$out/machine.txt"
    # the deadline leaves the call time to write and send back what it has
    "$py" bench/gpu_check.py --nanogpt "$KIT/nanogpt" --out "$out/gpu_check.md" --deadline "${DEADLINE:-540}" "$@" \
        2>&1 | tee "$out/gpu_check.log"
    ;;
*)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
