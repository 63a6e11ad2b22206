"""What one probe of our GPT at GPT-2-small width (12 layers x 12 heads, d_model 768; a short context:
the counts do not depend on it) would ask of a GPU, counted on any machine:

- host transfers: reads through qkgeom.device.to_host (each a device sync);
- direct copies: `tensor.cpu()` made by qkgeom code outside that door (each a device sync too; the
  accumulator once moved its per-batch sums to the host this way);
- solve round trips: decompositions sent to the host through qkgeom.solves.host (one sync each);
- implicit syncs: `bool(tensor)` made by qkgeom code outside the solve door (an `if` on a device value);
- decompositions left on the device: torch.linalg eigh/eigvalsh/svd/svdvals/qr/cholesky calls made
  outside the solve door, and the matrices in them over 32 x 32, which CUDA solves one after another
  (pytorch/pytorch#175585), one solver call and error check each.

    python bench/probe_syncs.py [LABEL]

Runs against whatever qkgeom is importable (a tree without qkgeom.solves counts every decomposition as
left on the device), so `PYTHONPATH=OTHER_TREE python bench/probe_syncs.py before` gives the before.
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import qkgeom
from qkgeom import config as C
from qkgeom import device as D
from qkgeom.probing import probe as P
from qkgeom.training.model import GPT

try:
    from qkgeom import solves as S
except ImportError:  # a tree from before the solve door
    S = None

PACKAGE = Path(qkgeom.__file__).resolve().parent
DECOMPOSITIONS = {"linalg_eigh", "linalg_eigvalsh", "linalg_svd", "linalg_svdvals", "linalg_qr", "linalg_cholesky_ex"}
n = {"transfers": 0, "copies": 0, "round_trips": 0, "bool": 0, "device_calls": 0, "device_matrices": 0}


def ours() -> bool:
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.endswith(("torch/overrides.py", "torch/_tensor.py", __file__)):
        f = f.f_back
    return f is not None and Path(f.f_code.co_filename).resolve().is_relative_to(PACKAGE)


class Count(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        inside = S is not None and S.solving()
        if not inside and name == "__bool__" and ours():
            n["bool"] += 1
        if not inside and name == "cpu" and not D.converting() and ours():
            n["copies"] += 1
        if not inside and name in DECOMPOSITIONS and ours():
            a = args[0]
            n["device_calls"] += 1
            if a.shape[-1] > 32:
                n["device_matrices"] += a.numel() // (a.shape[-1] * a.shape[-2])
        return func(*args, **(kwargs or {}))


def counted(name, real):
    def f(*a, **k):
        n[name] += 1
        return real(*a, **k)

    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label", nargs="?", default="now", help="what the printed counts are of (e.g. before, after)")
    label = ap.parse_args().label
    real_to_host = D.to_host

    def to_host(t):  # a read inside the solve door is of the host copies: no transfer, no sync
        n["transfers"] += not (S is not None and S.solving())
        return real_to_host(t)

    D.to_host = to_host
    if S is not None:
        S.round_trip = counted("round_trips", S.round_trip)
    held = getattr(P, "_HELD_SCORES", None)  # logit sequences held for one solve (since 2026-12-05) ...
    if held is not None:  # ... as many as a GPU holds (a CPU solves fewer at a time, for its caches)
        held["cpu"] = held["cuda"]
    cfg = C.load("paper", ["model.d_model=768", "model.n_layers=12", "model.n_heads=12", "model.n_ctx=64"])
    torch.manual_seed(0)
    m = GPT(cfg.model, 284).eval()
    idx = torch.randint(0, 284, (4, 64))
    with torch.no_grad(), Count():
        P.probe_gpt(m, idx, C.ProbeSettings(logit_seqs=4))
    print(f"{label}: one probe at GPT-2-small width (12 layers x 12 heads), as a GPU would see it")
    print(f"  host transfers (qkgeom.device.to_host)             {n['transfers']:>6}")
    print(f"  direct copies (tensor.cpu() outside the door)      {n['copies']:>6}")
    print(f"  solve round trips (qkgeom.solves.host)             {n['round_trips']:>6}")
    print(f"  implicit syncs (bool of a tensor, outside the door) {n['bool']:>5}")
    print(f"  decompositions left on the device: calls           {n['device_calls']:>6}")
    print(f"    matrices over 32 x 32 in them (sequential on CUDA) {n['device_matrices']:>4}")


if __name__ == "__main__":
    main()
