"""Does a whole probe repeat bit for bit from one fresh process to the next on a CPU?

Each of N fresh processes builds the same seeded GPT, probes it once with probe_gpt (the run's own probe
batch size, logit spectra of 4 sequences) and prints a digest of every row (layer, head, site, metric ->
value, bits) and of every spectrum. Prints how many distinct results the N processes gave and, for each
minority result, the rows where it left the majority and by how much (largest relative difference).

    python bench/probe_repeat.py [--processes 20] [--parallel 2] [--width 768 --layers 12 --heads 12 --ctx 256]

Runs against whatever qkgeom is importable, so `PYTHONPATH=OTHER_TREE python bench/probe_repeat.py`
checks another tree, and `QKGEOM_VML_WARMUP=0` leaves oneMKL's vector-math kernels unsettled, as qkgeom
did before 2026-12-05 (see bench/vml_race.py). `--parallel 2` runs two processes at a time, as the runs
that found differences did.

2026-12-05, this project's 2-core CPU (oneMKL's first-call race, bench/vml_race.py): at GPT-2-small width
(~40 s a process) 2 of 64 processes at 4f9568c gave layer 0's logit row std 7e-6 apart. At the paper
preset (`--width 256 --layers 6 --heads 4 --ctx 128`, ~5 s a pair), 120 processes each: with
QKGEOM_VML_WARMUP=0 one gave the weight side's per-head PRs and alphas of layers 3-5 up to 6.8e-10 apart
(the second thread's half of the process's first vector-math call, a float64 sqrt of 6,144 singular
values); settled, 1 distinct result.
"""

import argparse
import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

CHILD = """
import hashlib, json, sys
import numpy as np, torch
from qkgeom import config as C
from qkgeom.probing.probe import probe_gpt
from qkgeom.training.model import GPT
width, layers, heads, ctx = map(int, sys.argv[1:5])
cfg = C.load("paper", [f"model.d_model={width}", f"model.n_layers={layers}", f"model.n_heads={heads}",
                       f"model.n_ctx={ctx}"])
torch.manual_seed(0)
model = GPT(cfg.model, vocab_size=284).eval()
idx = torch.randint(0, 284, (C.probe_n_seqs(cfg), ctx))
rows, spectra = probe_gpt(model, idx, C.ProbeSettings.of(cfg.probe.logit_max_seqs))
values = {"|".join(str(r.get(c)) for c in ("layer", "head", "site", "metric")): r.get("value") for r in rows}
digest = hashlib.sha1()
for key in sorted(spectra):
    digest.update(key.encode() + np.ascontiguousarray(spectra[key]).tobytes())
print(json.dumps({"values": values, "spectra": digest.hexdigest()}))
"""


def run_one(shape: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *shape], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def key_of(result: dict) -> str:
    return json.dumps(result, sort_keys=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=2, help="processes at a time")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=256)
    args = ap.parse_args()
    shape = [str(v) for v in (args.width, args.layers, args.heads, args.ctx)]
    results: list[dict] = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for result in pool.map(run_one, [shape] * args.processes):
            results.append(result)
            print(f"\r{len(results)}/{args.processes} processes", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    counts = Counter(key_of(r) for r in results)
    major = json.loads(counts.most_common(1)[0][0])
    print(f"d_model {args.width}, {args.layers} layers x {args.heads} heads, context {args.ctx}: "
          f"{len(counts)} distinct result(s) in {args.processes} processes ({len(major['values'])} rows)")  # fmt: skip
    for key, n in counts.most_common()[1:]:
        other = json.loads(key)
        apart = {k: v for k, v in other["values"].items() if not (v == major["values"][k] or v != v)}
        rel = max((abs(v - major["values"][k]) / abs(major["values"][k]) for k, v in apart.items()), default=0.0)
        names = sorted({k.split("|", 2)[2] for k in apart})
        layers = sorted({k.split("|")[0] for k in apart})
        same = "equal" if other["spectra"] == major["spectra"] else "apart"
        print(f"  {n} process(es): {len(apart)} rows apart (layers {', '.join(layers) or '-'}: {', '.join(names)}), "
              f"largest relative difference {rel:.1e}; spectra {same}")  # fmt: skip


if __name__ == "__main__":
    main()
