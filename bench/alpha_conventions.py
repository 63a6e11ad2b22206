"""qkgeom's alpha against WeightWatcher 0.7.7's own per-layer alpha, and the two conventions against each
other, on 90 matrices (Gaussian, Student-t and low-rank; 8 to 256 eigenvalues; three seeds).

    python bench/alpha_conventions.py   # needs the dev extra weightwatcher==0.7.7

Prints the largest |qkgeom `weightwatcher` alpha - WeightWatcher's| (expected ~1e-14), and how far the
`clauset` convention lies from WeightWatcher's where both fit.
"""

import argparse
import logging

import numpy as np
import torch
import weightwatcher as ww

from qkgeom.probing import alpha as AL

SHAPES = [(128, 128), (384, 128), (128, 32), (128, 19), (64, 8), (128, 12), (512, 256), (128, 64), (64, 20), (64, 9)]


def matrix(rng: np.random.Generator, shape: tuple[int, int], kind: str) -> np.ndarray:
    """A Gaussian, a heavy-tailed (Student-t, 2.5 dof) or a rank-4-plus-noise weight matrix."""
    if kind == "gauss":
        return rng.normal(size=shape) * 0.05
    if kind == "heavy":
        return rng.standard_t(2.5, size=shape) * 0.05
    low = rng.normal(size=(shape[0], 4)) @ rng.normal(size=(4, shape[1])) * 0.01
    return low + rng.normal(size=shape) * 0.001


def main() -> None:
    logging.disable(logging.WARNING)  # WeightWatcher logs every fit
    worst, to_clauset, n = 0.0, [], 0
    for seed in range(3):
        rng = np.random.default_rng(seed)
        layers = []
        for shape in SHAPES:
            for kind in ("gauss", "heavy", "lowrank"):
                lin = torch.nn.Linear(shape[1], shape[0], bias=False)
                with torch.no_grad():
                    lin.weight.copy_(torch.tensor(matrix(rng, shape, kind), dtype=torch.float32))
                layers.append(lin)
        theirs = ww.WeightWatcher(model=torch.nn.Sequential(*layers)).analyze().sort_values("layer_id")["alpha"]
        for lin, alpha in zip(layers, theirs.to_numpy(), strict=True):
            ev = np.linalg.svd(lin.weight.detach().double().numpy(), compute_uv=False) ** 2
            worst = max(worst, abs(alpha - AL.power_law_alpha(ev)["alpha"]))
            clauset = AL.power_law_alpha(ev, convention="clauset")["alpha"]
            if np.isfinite(clauset):
                to_clauset.append(abs(alpha - clauset))
            n += 1
    d = np.array(to_clauset)
    print(f"{n} matrices: max |qkgeom weightwatcher alpha - WeightWatcher 0.7.7| = {worst:.2e}")
    print(
        f"clauset fits {len(d)} of them; |WeightWatcher - clauset|: max {d.max():.3f}, median {np.median(d):.4f}, "
        f"share > 1e-3: {(d > 1e-3).mean():.2f}"
    )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
