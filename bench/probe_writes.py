"""Probe writes over a run: the old layout (every probe rewrites the whole geometry.parquet and
spectra.npz: O(P^2) bytes for P probes) against the current one (one part file per probe, one
consolidation at the end: O(P)). Both write the same rows, taken from one real probe of the cpu
preset (depth 4, 10 probe sequences), through RunDir's own atomic writer.

    python bench/probe_writes.py [--probes 200] [--depth 4]

Prints, for each layout: bytes written, seconds, and the ratio; checks both read back equal.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from qkgeom import config as C
from qkgeom import results
from qkgeom.probing.probe import probe_gpt
from qkgeom.training.model import GPT

REAL_WRITER = results.atomic_write_bytes


def counting_writer(counter: dict):
    real = REAL_WRITER

    def write(path: Path, data: bytes) -> None:
        counter["bytes"] += len(data)
        real(path, data)

    return write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    cfg = C.load("cpu", [f"model.n_layers={args.depth}"])
    torch.manual_seed(0)
    model = GPT(cfg.model, 284).eval()
    idx = torch.randint(0, 284, (C.probe_n_seqs(cfg), cfg.model.n_ctx))
    rows, spec = probe_gpt(model, idx, cfg.probe.settings)
    kb = sum(v.nbytes for v in spec.values()) / 1e3
    print(f"one probe: {len(rows)} rows, {kb:.1f} kB of spectra; {args.probes} probes")
    out = {}
    for layout in ("rewrite every probe (old)", "one part per probe (now)"):
        counter = {"bytes": 0}
        results.atomic_write_bytes = counting_writer(counter)
        with tempfile.TemporaryDirectory() as tmp:
            rd = results.RunDir(Path(tmp) / "run")
            tic = time.perf_counter()
            geometry, spectra = [], {}
            for step in range(args.probes):
                probe_rows = [{"step": step, "tokens_seen": step, **r} for r in rows]
                if layout.startswith("rewrite"):
                    geometry.extend(probe_rows)
                    rd.write_geometry(geometry)
                    for k, v in {"step": np.int64(step), **spec}.items():
                        spectra.setdefault(k, []).append(v)
                    rd.write_spectra({k: np.stack(v) for k, v in spectra.items()})
                else:
                    rd.append_probe(step, probe_rows, spec)
            if not layout.startswith("rewrite"):
                rd.consolidate_probes()
            seconds = time.perf_counter() - tic
            out[layout] = (counter["bytes"], seconds, rd.read_geometry(), rd.read_spectra())
        results.atomic_write_bytes = REAL_WRITER
        print(f"{layout:28s}: {counter['bytes'] / 1e6:9.1f} MB written in {seconds:7.2f} s")
    (b_old, s_old, g_old, sp_old), (b_new, s_new, g_new, sp_new) = out.values()
    pd.testing.assert_frame_equal(g_old, g_new)
    assert all(np.array_equal(sp_old[k], sp_new[k]) for k in sp_old)
    print(f"ratio old / now: {b_old / b_new:.1f}x bytes, {s_old / s_new:.1f}x time (same rows read back)")


if __name__ == "__main__":
    main()
