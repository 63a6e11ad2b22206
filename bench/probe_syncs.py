"""Host transfers (GPU -> CPU syncs on a GPU) in one probe of our GPT at GPT-2-small width (12 layers x
12 heads, d_model 768; a short context: the count does not depend on it). Every tensor-to-host read
goes through qkgeom.device.to_host, so counting its calls counts the syncs, on any machine.

    python bench/probe_syncs.py [LABEL]
"""

import sys

import torch

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.probing import probe as P
from qkgeom.training.model import GPT

n = {"calls": 0}
real = D.to_host


def counted(t):
    n["calls"] += 1
    return real(t)


D.to_host = counted
cfg = C.load("paper", ["model.d_model=768", "model.n_layers=12", "model.n_heads=12", "model.n_ctx=64"])
torch.manual_seed(0)
m = GPT(cfg.model, 284).eval()
idx = torch.randint(0, 284, (4, 64))
with torch.no_grad():
    P.probe_gpt(m, idx, C.ProbeSettings(logit_seqs=4))
print(sys.argv[1] if len(sys.argv) > 1 else "now", "host transfers per probe (12 layers x 12 heads):", n["calls"])
