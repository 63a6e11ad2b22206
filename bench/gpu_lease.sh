#!/usr/bin/env bash
# One GPU lease, prepared ahead: everything bench/gpu_check.py needs, packed so that a lent machine
# spends its minutes measuring. The device tool sends this repository and nothing beside it (not
# ../shared, not a nanoGPT snapshot) to a bare machine whose python3 already holds torch, pandas,
# pyarrow, scipy, matplotlib, transformers and pytest (the 'cuda' image; nothing can be fetched there).
# So the kit puts WikiText-2 (with the raw validation text the gpu tests read) and nanoGPT's model.py in
# .lease/ (ignored by git), which the call carries.
#
#   here, before the lease:  bash bench/gpu_lease.sh kit NANOGPT_DIR     # NANOGPT_DIR holds model.py
#                            bash bench/gpu_lease.sh run --device cpu --quick   # the same path, checked here
#                            bash bench/gpu_lease.sh lighten      # docs/results out of the call (below)
#   the device call:         command "bash bench/gpu_lease.sh run", carry [".lease"], timeout_s 600
#   at once after it:        bash bench/gpu_lease.sh restore      # docs/results tracked again
#
# A call sends at most 64 MiB: tracked files, untracked ones git does not ignore, the carried kit.
# docs/results (every committed study's records) is ~62 MiB of the tracked files and gpu_check needs
# none of it, so `lighten` untracks it in the index only (`git rm --cached`) and ignores it in
# .git/info/exclude; the files on disk are untouched. `restore` undoes both: run it before any commit.
#
# `run` prints the machine, then runs gpu_check.py with a deadline inside the call's limit; its table
# and log land in $OUT (they come back with the call) and the table is rewritten after every row, so a
# run cut short keeps what it measured; the eager steps' kernel profiles (profile-*.txt) land beside it.
# Commit $OUT/gpu_check.md and the profiles under docs/results/gpu/. A
# second call made at once finds the machine still warm (30 s) and costs no new start: with the minutes
# left, `DEADLINE=S bash bench/gpu_lease.sh run --only WORDS` runs the sections the first left `not run`
# (their rows then come back in a table of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.lease
NOTE="# gpu_lease.sh lighten: 'restore' removes this line and the next"
MARK="/docs/results/"

travel() {  # what a call would send: tracked files, untracked ones git does not ignore, and the kit
    local bytes
    bytes=$( { git ls-files -z; git ls-files -o --exclude-standard -z; } | xargs -0 du -cb 2>/dev/null |
             awk '$2 == "total" {s += $1} END {print s + 0}')  # xargs may split: one total per batch
    bytes=$(( bytes + $(du -sb "$KIT" | cut -f1) ))
    echo "a call sends $(( bytes / 1048576 )) MiB of the 64 MiB allowed"
    (( bytes < 64 * 1048576 )) || { echo "over 64 MiB: the call would be refused ('lighten' first)" >&2; return 2; }
}

case "${1:-}" in
kit)
    src="${QKGEOM_WIKITEXT_DIR:-../shared/data/wikitext}"
    nano="${2:?usage: bash bench/gpu_lease.sh kit NANOGPT_DIR (a folder holding the model.py of nanoGPT)}"
    [[ -f "$src/wikitext-2/train.txt" ]] || { echo "no WikiText-2 at $src/wikitext-2 (set QKGEOM_WIKITEXT_DIR)" >&2; exit 2; }
    # the raw validation text too: the gpu tests' pretrained path builds its vocabulary from it
    [[ -f "$src/wikitext-2-raw/valid.txt" ]] || { echo "no $src/wikitext-2-raw/valid.txt" >&2; exit 2; }
    [[ -f "$nano/model.py" ]] || { echo "no model.py in $nano" >&2; exit 2; }
    git check-ignore -q "$KIT/x" || { echo "$KIT/ is not ignored by git: it would travel as part of the tree" >&2; exit 2; }
    rm -rf "$KIT.tmp" && mkdir -p "$KIT.tmp/wikitext/wikitext-2" "$KIT.tmp/wikitext/wikitext-2-raw" "$KIT.tmp/nanogpt"
    cp "$src"/wikitext-2/{train,valid,test}.txt "$KIT.tmp/wikitext/wikitext-2/"
    cp "$src"/wikitext-2-raw/*.txt "$KIT.tmp/wikitext/wikitext-2-raw/"
    cp "$nano/model.py" "$KIT.tmp/nanogpt/"
    rm -rf "$KIT" && mv "$KIT.tmp" "$KIT"  # whole or not at all
    echo "kit: $(du -sh "$KIT" | cut -f1) in $KIT/"
    travel || true  # says whether 'lighten' is needed
    ;;
lighten)
    [[ -d "$KIT" ]] || { echo "no $KIT/: run 'bash bench/gpu_lease.sh kit NANOGPT_DIR' first" >&2; exit 2; }
    git diff --cached --quiet || { echo "the index holds staged changes: commit or unstage them first" >&2; exit 2; }
    grep -qxF "$NOTE" .git/info/exclude 2>/dev/null || printf '%s\n%s\n' "$NOTE" "$MARK" >>.git/info/exclude
    git rm -r -q --cached -- docs/results
    echo "docs/results untracked in the index and ignored (files on disk untouched); 'restore' undoes it"
    travel
    ;;
restore)
    git reset -q -- docs/results
    if [[ -f .git/info/exclude ]]; then  # the two lines lighten wrote, and nothing else
        awk -v note="$NOTE" -v mark="$MARK" '$0 == note {skip = 1; next} skip && $0 == mark {skip = 0; next}
                                             {skip = 0; print}' .git/info/exclude >.git/info/exclude.tmp
        mv .git/info/exclude.tmp .git/info/exclude
    fi
    git diff --cached --quiet && echo "docs/results tracked again; the index is as HEAD has it" ||
        { echo "the index still differs from HEAD: look at 'git status'" >&2; exit 2; }
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
        # the image's libraries against pyproject's floors: a failure below may be a version's, not the GPU's
        "$py" -c 'import importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("numpy", "pandas", "pyarrow", "scipy", "matplotlib", "transformers",
      "safetensors", "tqdm")))' || true
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        nproc
    } 2>&1 | tee "$out/machine.txt"
    # the deadline leaves the call time to write and send back what it has
    "$py" bench/gpu_check.py --nanogpt "$KIT/nanogpt" --out "$out/gpu_check.md" --deadline "${DEADLINE:-540}" "$@" \
        2>&1 | tee "$out/gpu_check.log"
    ;;
*)
    sed -n '2,24p' "$0" >&2
    exit 2
    ;;
esac
