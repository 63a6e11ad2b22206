"""The one prepared script for a lent GPU (issue 53): about 8 minutes on one H200 (not yet
timed on one), no network. On a lease it runs through bench/gpu_lease.sh, which carries the data
and nanoGPT's model.py to the bare machine.

    python bench/gpu_check.py [--nanogpt DIR] [--out docs/results/gpu/gpu_check.md] [--deadline S]

In this order, what issue 53 asks first:

1. the `gpu` tests (tests/e2e/test_gpu.py: probe, train with the closed loop, the Hugging Face path,
   the Probe callback, `qkgeom pretrained --device cuda`, the solve door; each equal to the CPU within
   1e-6 / 1e-5; with --device cpu a dry run of the tests' code, cpu against cpu);
2. the solve door's premise: one probe's 576 logit Grams (256 x 256) solved by torch on the device
   against the same batch through qkgeom.solves (on the host);
3. at the paper preset and at GPT-2-small width (12 layers, d_model 768, 12 heads, context 256):
   seconds per probe against the time of 10 bare training steps, split by part (bench/probe_split.py:
   forward, accumulate, logits, solves, weights, fits, write), and the time inside decompositions;
   then the eager bare step against nanoGPT's model.py, if --nanogpt names a folder holding it (a
   snapshot of karpathy/nanoGPT; not vendored here), else "not measured", taken in turn, beside our
   attention as one QKV matmul (a variant defined here) and each side's kernel time per step by kind
   (gemm, attention, optimizer, ...; the profiles' top 25 written beside --out);
4. the paper preset at the study's real cadence (bench/cadence.py: unit costs from a short run,
   composed at 20,000 steps with a probe every 500): whole-job tokens/s and probe share;
5. the compiled bare step against nanoGPT's at both shapes;
6. many small runs on one device: K paper-preset runs at once through the local pool (--concurrent,
   default K = 1, 4, 8; none: skipped), tokens/s in all against one run;
7. 8 seeds of the paper preset stacked in one process (vmap; bench/stacked_seeds.py) against the same 8
   stepped one after another.

Prints each row as it is measured and rewrites --out after each (a run cut short keeps what it
measured), then the whole markdown table. A section that raises becomes an `error:` row (traceback in
the log) and the rest still run; with --deadline, one that would start with less time left than it is
guessed to need becomes a `not run:` row; `--only WORDS` runs the sections named so (a second call on
a still-warm lease). `--device cpu --quick` runs the same script at small sizes
on any machine, to check it before a lease (writing --out only if one is named).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cadence  # noqa: E402
from common import require_wikitext, sync  # noqa: E402
from paper_gpu import measuring_overrides  # noqa: E402
from probe_split import decomposition_seconds, probe_parts, seconds_per_probe  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom.training.loop import make_optimizer  # noqa: E402
from qkgeom.training.model import GPT, Attention  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GPT2_SMALL = ["model.n_layers=12", "model.d_model=768", "model.n_heads=12", "model.n_ctx=256", "train.batch_size=32"]


def gpu_tests(dev: str) -> list[tuple[str, str]]:
    """(test, PASSED/FAILED/SKIPPED) of `pytest -m gpu tests/e2e/test_gpu.py` on `dev` (QKGEOM_GPU_TESTS_ON:
    on the CPU a dry run of the tests' own code, each comparison then cpu with cpu)."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider", "tests/e2e/test_gpu.py"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "QKGEOM_GPU_TESTS_ON": dev},
    )  # fmt: skip
    return re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) \S*?::(\w+)", r.stdout, flags=re.M) or [
        ("ERROR", r.stdout[-300:])
    ]


def bare_step_rate(cfg: C.RunConfig, step, steps: int) -> float:
    """tokens/s of `step(x, y)` (forward, backward, optimiser) after 3 warm-up steps (compile included there)."""
    return step_rates(cfg, {"step": step}, steps, rounds=1)["step"]


def step_rates(cfg: C.RunConfig, steps_of: dict[str, Callable], steps: int, rounds: int = 3) -> dict[str, float]:
    """tokens/s of each `step(x, y)` in `steps_of`: 3 warm-up steps each (compile included there), then
    `rounds` rounds of `steps` steps taken in turn (A, B, C, A, B, C, ...), best round of each, so a
    GPU's clocks and a neighbour's load fall on every side alike."""
    t, dev = cfg.train, cfg.train.device
    x = torch.randint(0, 284, (t.batch_size, cfg.model.n_ctx), device=dev)
    for step in steps_of.values():
        for _ in range(3):
            step(x, x)
    best = dict.fromkeys(steps_of, 0.0)
    for _ in range(rounds):
        for name, step in steps_of.items():
            sync(dev)
            tic = time.perf_counter()
            for _ in range(steps):
                step(x, x)
            sync(dev)
            best[name] = max(best[name], steps * t.batch_size * cfg.model.n_ctx / (time.perf_counter() - tic))
    return best


class FusedQKV(Attention):
    """The bench's variant of our attention, for the eager comparison only (the library keeps three
    matmuls): one matmul against [W_Q | W_K | W_V], as nanoGPT's c_attn, over the same parameters.
    Three matmuls cost, under autocast, three casts of the LayerNorm'd input and two adds of its
    gradient, and three weight-gradient GEMMs of a third the width (tiles that fill fewer of a large
    GPU's SMs); whether that is the eager gap on a GPU is what its row asks."""

    def forward(self, x: torch.Tensor, explicit: bool = False) -> torch.Tensor:
        if explicit:
            return super().forward(x, True)
        B, T, _ = x.shape
        H, E = self.n_heads, self.d_head
        qkv = x @ torch.cat([self.W_Q, self.W_K, self.W_V], dim=1)
        q, k, v = (y.view(B, T, H, E).transpose(1, 2) for y in qkv.split(H * E, dim=-1))
        z = F.scaled_dot_product_attention(self.hook_q(q), self.hook_k(k), v, is_causal=True)
        return z.transpose(1, 2).reshape(B, T, H * E) @ self.W_O


def ours(cfg: C.RunConfig, compiled: bool, fused_qkv: bool = False):
    """Our GPT's training step at cfg's shape (bf16 autocast on cuda, fused AdamW as the trainer);
    fused_qkv: its attention as FusedQKV (same parameters and values)."""
    model = GPT(cfg.model, 284).to(cfg.train.device)
    if fused_qkv:
        for block in model.blocks:
            block.attn.__class__ = FusedQKV  # no state of its own: the same module, another forward
    opt = make_optimizer(model, cfg.train)
    loss_fn = torch.compile(model.loss) if compiled else model.loss
    dtype = cfg.train.device.split(":")[0]

    def step(x, y):
        with torch.autocast(dtype, dtype=torch.bfloat16, enabled=dtype == "cuda"):
            loss = loss_fn(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return model, step


def nanogpt(folder: Path, cfg: C.RunConfig, compiled: bool):
    """nanoGPT's GPT (model.py from `folder`) at cfg's shape, its own configure_optimizers (fused AdamW)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", folder / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = cfg.model
    conf = mod.GPTConfig(block_size=m.n_ctx, vocab_size=284, n_layer=m.n_layers, n_head=m.n_heads,
                         n_embd=m.d_model, dropout=0.0, bias=True)  # fmt: skip
    model = mod.GPT(conf).to(cfg.train.device)
    opt = model.configure_optimizers(0.1, cfg.train.lr, (0.9, 0.95), cfg.train.device.split(":")[0])
    fwd = torch.compile(model) if compiled else model
    dtype = cfg.train.device.split(":")[0]

    def step(x, y):
        with torch.autocast(dtype, dtype=torch.bfloat16, enabled=dtype == "cuda"):
            _, loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return model, step


def door_premise(dev: str, quick: bool) -> str:
    """The solve door's premise (qkgeom.solves), timed: the eigenvalues of one probe's logit Grams at
    GPT-2-small width (4 sequences x 12 heads x 12 layers of 256 x 256, float32) solved by torch on the
    device, against the same batch through the door (copied to the host, solved there, copied back)."""
    from qkgeom.probing.geometry import robust_eigvalsh

    n, t = (48, 64) if quick else (576, 256)
    x = torch.randn(n, t, t, device=dev)
    gram = x.transpose(-1, -2) @ x

    def timed(fn) -> float:
        fn()
        sync(dev)
        tic = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - tic

    on_device = timed(lambda: torch.linalg.eigvalsh(gram))
    door = timed(lambda: robust_eigvalsh(gram, fast=True))
    return f"{n} x {t}^2 float32: on the device {on_device:.3f} s, through the door {door:.3f} s"


def concurrent_runs(dev: str, quick: bool, counts: list[int]) -> list[tuple[str, str]]:
    """Many small runs on one device: K runs of the paper preset (~5 M parameters) at once through the
    local pool (each worker cores // K threads; K = 1 runs in this process, K > 1 each in a spawned one),
    for each K: tokens/s in all from each run's own clock after its start-up (done.json's
    segment_seconds), and over the wall time with start-ups."""
    from qkgeom.training.grid import RunSpec
    from qkgeom.training.sweep import execute

    steps = 20 if quick else 200
    over = [f"train.device='{dev}'", "data.source='wikitext-2'", f"train.steps={steps}", f"probe.every={steps}",
            f"train.warmup_steps={steps // 20}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
            *(["model.n_layers=2", "train.batch_size=8"] if quick else [])]  # fmt: skip
    cores = os.cpu_count() or 1
    out: list[tuple[str, str]] = []
    base, against = None, "one run" if counts and counts[0] == 1 else f"{counts[0] if counts else 0} at once"
    for k in counts:
        runs = [RunSpec(f"r{k}_{i}", {}, C.load("paper", [*over, f"train.seed={i}"])) for i in range(k)]
        with tempfile.TemporaryDirectory() as tmp:
            tic = time.perf_counter()
            st = execute(runs, Path(tmp), k, max(1, cores // k), "local", None)
            wall = time.perf_counter() - tic
            done = [json.loads((Path(tmp) / r.run_id / "done.json").read_text()) for r in runs
                    if (Path(tmp) / r.run_id / "done.json").is_file()]  # fmt: skip
        ok = sum(s["status"] == "done" for s in st)
        # each run's own clock after its start-up: the runs overlap, so their rates add up
        rate = sum(d["tokens_seen"] / d["segment_seconds"] for d in done)
        base = rate if base is None else base  # the first count's row is the reference
        ratio = f"{rate / base:.2f}x {against}" if base else "no reference: no run of the first row finished"
        tokens = sum(d["tokens_seen"] for d in done)
        out.append((f"{k} paper-preset runs at once ({steps} steps each, {ok}/{k} done)",
                    f"{rate:,.0f} tokens/s in all ({ratio}); with start-ups, "
                    f"{tokens / wall:,.0f} tokens/s over {wall:.0f} s wall"))  # fmt: skip
    return out


class Table(list):
    """(check, result) rows, each printed as it comes and the whole table rewritten to `out` (None: not
    written), so a run cut short by a lease's time limit still leaves what it measured."""

    def __init__(self, out: Path | None) -> None:
        super().__init__()
        self.out = out

    def append(self, row: tuple[str, str]) -> None:
        super().append(row)
        print(f"| {row[0]} | {row[1]} |", flush=True)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(f"# bench/gpu_check.py, {time.strftime('%Y-%m-%d')}\n\n{self.markdown()}\n")

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self

    def markdown(self) -> str:
        return "| check | result |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in self)


def probe_rows(label: str, cfg: C.RunConfig, dev: str, quick: bool) -> list[tuple[str, str]]:
    """One probe at cfg's shape against 10 bare steps, its split by part, its time inside decompositions."""
    model = GPT(cfg.model, 284).to(dev).eval()  # one model and probe batch for the whole probe and its parts
    idx = torch.randint(0, 284, (C.probe_n_seqs(cfg), cfg.model.n_ctx), device=dev)
    probe_s = seconds_per_probe(model, idx, cfg.probe.logit_max_seqs, dev)
    _, step = ours(cfg, False)
    rate = bare_step_rate(cfg, step, 5 if quick else 20)
    ten = 10 * cfg.train.batch_size * cfg.model.n_ctx / rate
    rows = [(f"{label}: one probe", f"{probe_s:.3f} s (10 bare steps: {ten:.3f} s; {probe_s / ten:.2f}x)")]
    probe_parts(model, idx, cfg.probe.logit_max_seqs, dev)  # warm-up
    split = probe_parts(model, idx, cfg.probe.logit_max_seqs, dev)
    rows.append((f"{label}: probe split", ", ".join(f"{k} {v:.3f} s" for k, v in split.items())))
    whole, solving = decomposition_seconds(model, idx, cfg.probe.logit_max_seqs, dev)
    rows.append((f"{label}: decompositions on the host", f"{solving:.3f} s of a {whole:.3f} s probe"))
    return rows


# kernel (or, on a CPU, aten op) names -> kind, first match wins: where an eager step's device time goes
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "splitk", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam", "multi_tensor")),
    ("layer norm", ("layer_norm", "gammabeta")),
    ("loss", ("softmax", "nll_loss")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def step_profile(cfg: C.RunConfig, step, steps: int, out: Path | None) -> tuple[float, dict[str, float]]:
    """(device ms per step, ms per step by KERNEL_KINDS) of `step` under torch.profiler: kernel time on
    cuda, aten ops' own CPU time on a CPU; the whole table, top 25, written to `out` if given."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = cfg.train.device
    on_gpu = dev.startswith("cuda")
    x = torch.randint(0, 284, (cfg.train.batch_size, cfg.model.n_ctx), device=dev)
    step(x, x)
    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        for _ in range(steps):
            step(x, x)
        sync(dev)
    events = prof.key_averages()

    def own_ms(e) -> float:  # an event's own time on the measured side, ms over the whole profile
        if not on_gpu:
            return e.self_cpu_time_total / 1e3
        # kernels alone, as torch's own table sums them: not runtime calls (cudaLaunchKernel, on the host),
        # not record_function ranges drawn on the device's timeline (the optimizer's step: pytorch#130730)
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            return 0.0
        return e.self_device_time_total / 1e3

    kinds: dict[str, float] = {}
    for e in events:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + own_ms(e) / steps
    if out is not None:
        sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        out.write_text(events.table(sort_by=sort, row_limit=25, max_name_column_width=90) + "\n")
    return sum(kinds.values()), kinds


def step_rows(label: str, cfg: C.RunConfig, compiled: bool, nanogpt_dir: Path | None, quick: bool,
              profiles: Path | None = None):  # fmt: skip
    """Our bare training step at cfg's shape, against nanoGPT's model.py's if a folder is given, taken in
    turn; eager, also our attention as one QKV matmul (FusedQKV) and each side's device time per step
    by kernel kind (tables written into `profiles`)."""
    kind = "compiled" if compiled else "eager"
    sides = {"ours": ours(cfg, compiled)[1]}
    if not compiled:
        sides["ours, one QKV matmul"] = ours(cfg, False, fused_qkv=True)[1]
    if nanogpt_dir is not None:
        sides["nanoGPT"] = nanogpt(nanogpt_dir, cfg, compiled)[1]
    rates = step_rates(cfg, sides, 5 if quick else 30, rounds=1 if quick else 3)  # quick checks the code
    mine, theirs = rates["ours"], rates.get("nanoGPT")
    if theirs:
        text = f"{mine:,.0f} vs nanoGPT {theirs:,.0f} tokens/s ({mine / theirs:.2f}x)"
    else:
        text = f"{mine:,.0f} tokens/s; nanoGPT not measured (--nanogpt)"
    if compiled:
        return [(f"{label}: bare step, {kind}", text)]
    fused = rates["ours, one QKV matmul"]
    base = "nanoGPT" if theirs else "ours"
    text += f"; ours with one QKV matmul {fused:,.0f} ({fused / (theirs or mine):.2f}x {base})"
    rows = [(f"{label}: bare step, {kind}", text)]
    parts = []
    for name in [n for n in ("ours", "nanoGPT") if n in sides]:
        slug = f"{label.split(':')[0].replace(' ', '-').lower()}-{name.lower()}"
        total, kinds = step_profile(cfg, sides[name], 3, profiles / f"profile-{slug}.txt" if profiles else None)
        split = ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        wall = 1e3 * cfg.train.batch_size * cfg.model.n_ctx / rates[name]  # kernels well under it: launch-bound
        parts.append(f"{name} {total:.2f} of {wall:.2f} wall ({split})" if total else f"{name}: none recorded")
    what = "kernel" if cfg.train.device.startswith("cuda") else "op"
    rows.append((f"{label}: eager step's {what} time, ms/step", "; ".join(parts)))
    return rows


def paper_job_rows(dev: str, quick: bool) -> list[tuple[str, str]]:
    """The paper preset's unit costs from a short run, composed at the study's own cadence."""
    n_steps = 20 if quick else 300
    extra = QUICK if quick else []
    paper = C.load("paper", [f"train.device='{dev}'", "data.source='wikitext-2'", *extra])
    with tempfile.TemporaryDirectory() as tmp:
        u = cadence.measure(C.load("paper", [*extra, *measuring_overrides(n_steps, dev, False)]), Path(tmp) / "run")
    job = cadence.compose(u, paper.train, paper.probe)
    return [
        ("paper preset: bare step", f"{u.bare_tokens_per_s:,.0f} tokens/s"),
        (f"paper preset: whole job at its cadence ({paper.train.steps} steps, {job['n_probes']} probes)",
         f"{job['tokens_per_s']:,.0f} tokens/s; probes {100 * job['probe_share']:.1f}%; "
         f"{job['overhead']:.3f}x its training steps"),
    ]  # fmt: skip


QUICK = ["model.n_layers=2", "train.batch_size=8"]


def stacked_rows(dev: str, quick: bool) -> list[tuple[str, str]]:
    """8 seeds of the paper preset stacked with vmap against the same 8 stepped one after another
    (bench/stacked_seeds.py): the other way to fill a GPU with small runs than processes at once."""
    from stacked_seeds import compare

    n = 2 if quick else 8
    r = compare(C.load("paper", [f"train.device='{dev}'", *(QUICK if quick else [])]), n, 3 if quick else 10, 1)
    slow = ", ".join(f.split("for ")[-1] for f in r.fallbacks)  # torch: "... batching rule for aten::op"
    note = f"; vmap runs one seed at a time in: {slow}" if slow else ""
    return [(f"{n} paper-preset seeds stacked (vmap) vs one after another",
             f"{r.stacked:,.0f} vs {r.separate:,.0f} tokens/s in all ({r.stacked / r.separate:.2f}x); "
             f"losses within {r.loss_gap:.1e}{note}")]  # fmt: skip


def sections(args: argparse.Namespace) -> list[tuple[str, float, Callable[[], list[tuple[str, str]]]]]:
    """(what, seconds it is guessed to need on an H200, rows) in the order they run: what the issue asks
    first, the compiles (a minute or more each) and the many-runs rows last."""
    dev, quick = args.device, args.quick
    shapes = {
        "paper": C.load("paper", [f"train.device='{dev}'", *(QUICK if quick else [])]),
        # quick: the width (d_model 768, 12 heads) in 2 layers at the quick batch; GPT2_SMALL's first item,
        # n_layers=12, was overridden at once, leaving the paper's width under this label
        "GPT-2-small width": C.load(
            "paper", [f"train.device='{dev}'", *([*QUICK, *GPT2_SMALL[1:3]] if quick else GPT2_SMALL)]
        ),
    }
    out: list = []
    out.append(("gpu tests", 120, lambda: [(f"gpu test: {t}", status) for status, t in gpu_tests(dev)]))
    out.append(("solve door: one probe's logit Grams", 15,
                lambda: [("solve door: one probe's logit Grams", door_premise(dev, quick))]))  # fmt: skip
    for label, cfg in shapes.items():
        out.append((f"{label}: one probe", 30, lambda label=label, cfg=cfg: probe_rows(label, cfg, dev, quick)))
        eager = partial(step_rows, label, cfg, False, args.nanogpt, quick, args.profiles)
        out.append((f"{label}: bare step, eager", 45, eager))
    out.append(("paper preset: whole job at its cadence", 90, lambda: paper_job_rows(dev, quick)))
    if not quick:
        for label, cfg in shapes.items():
            out.append((f"{label}: bare step, compiled", 150,
                        lambda label=label, cfg=cfg: step_rows(label, cfg, True, args.nanogpt, quick)))  # fmt: skip
    if args.concurrent:
        out.append((f"{', '.join(map(str, args.concurrent))} paper-preset runs at once", 150,
                    lambda: concurrent_runs(dev, quick, args.concurrent)))  # fmt: skip
    out.append(("8 paper-preset seeds stacked in one process", 90, lambda: stacked_rows(dev, quick)))
    return [s for s in out if not args.only or any(w in s[0] for w in args.only)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nanogpt", type=Path, help="folder holding nanoGPT's model.py (a karpathy/nanoGPT snapshot)")
    ap.add_argument("--quick", action="store_true", help="small sizes: check the script (e.g. on a CPU)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "gpu" / "gpu_check.md")
    ap.add_argument("--concurrent", type=int, nargs="*", default=[1, 4, 8],
                    help="numbers of runs at once on the device to time (none: skip; default 1 4 8)")  # fmt: skip
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds: a section that would start with less time left than it is guessed to need "
                         "is not run, and says so in its row (a lease's call is cut at 600 s)")  # fmt: skip
    ap.add_argument("--only", nargs="+", metavar="WORDS",
                    help="run only the sections whose name holds one of these (e.g. compiled stacked): a second "
                         "call on a still-warm lease finishing what the first left")  # fmt: skip
    args = ap.parse_args()
    require_wikitext()
    tic = time.monotonic()
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA device (or --device cpu --quick to check the script)")
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        sys.exit(f"--nanogpt {args.nanogpt}: no model.py there")
    rows = Table(args.out if not args.quick or args.out != ap.get_default("out") else None)
    args.profiles = rows.out.parent if rows.out is not None else None  # the eager steps' profile tables
    name = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu"
    rows.append(("device", f"{name}; torch {torch.__version__}"))
    for what, need, run in sections(args):
        left = args.deadline - (time.monotonic() - tic)
        if left < need:
            rows.append((what, f"not run: {left:.0f} s left of the {args.deadline:.0f} s deadline, it needs ~{need} s"))
            continue
        try:
            rows += run()
        except Exception as e:  # one broken section must not cost the lease the rows after it
            traceback.print_exc()
            rows.append((what, f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]))
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    rows.append(("gpu_check.py wall time", f"{time.monotonic() - tic:.0f} s"))
    print(f"\n{rows.markdown()}")
    if rows.out is not None:
        print(f"\nwrote {rows.out}")


if __name__ == "__main__":
    main()
