"""One training run: AdamW + warm-up/cosine, periodic validation, probes, checkpoints, resume.

The loop is linear and reads top to bottom. At loop index ``step`` (optimiser steps done):
probe and evaluate if scheduled, write checkpoints if scheduled, stop at the last step, else
take one optimiser step. A checkpoint at step c therefore follows every record with step <= c,
so ``--resume`` keeps those records and continues; data order is a pure function of
(data_seed, step), so the resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.device import check_device
from qkgeom.errors import QKGeomError
from qkgeom.probing.geometry import NumericalWarning
from qkgeom.probing.probe import gpt_weights, probe_gpt
from qkgeom.probing.scalars import TensorBoardLog
from qkgeom.provenance import provenance
from qkgeom.results import LAST_CHECKPOINT, RunDir, folder_lock, kept_checkpoint, read_json, write_json
from qkgeom.training import complement as K
from qkgeom.training import interventions as I
from qkgeom.training.data import Vocab, batch_offsets, fixed_offsets, gather, load_corpus, unigram_baseline
from qkgeom.training.model import GPT
from qkgeom.training.precision import attention_path, cpu_bf16_attention


class TrainingError(QKGeomError, RuntimeError):
    """Training cannot go on (a NaN loss, a run folder that is not resumable, ...)."""


def probe_steps(steps: int, every: int, log_early: bool = True) -> list[int]:
    """0, 1, 2, 4, ... below `every` (if log_early), then multiples of `every`, and the last step."""
    out = set(range(0, steps + 1, every)) | {steps}
    if log_early:
        s = 1
        out.add(0)
        while s < min(every, steps):
            out.add(s)
            s *= 2
    return sorted(out)


def lr_at(step: int, t: C.TrainConfig) -> float:
    """Learning rate of the update taken at loop index `step`: linear warm-up, then cosine."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, t: C.TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not LayerNorm gains/biases), as in nanoGPT."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = t.device.startswith("cuda")  # one kernel for the whole update on GPU; CPU keeps the reference path
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused or None)


@torch.no_grad()
def evaluate(model: GPT, data: np.ndarray, t: C.TrainConfig, n_ctx: int, device: str) -> float:
    """Mean loss over eval_batches fixed batches of the validation split (fused path)."""
    offsets = fixed_offsets(len(data), n_ctx, t.eval_batches * t.batch_size)
    losses = []
    for chunk in np.split(offsets, t.eval_batches):
        x, y = gather(data, chunk, n_ctx)
        losses.append(D.host_float(model.loss(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))))
    return float(np.mean(losses))


# Divergence is declared before anything is probed or checkpointed: a loss far above that of a
# uniform prediction, or weights orders of magnitude above their initial scale (std 0.02; LayerNorm
# gains start at 1), cannot come from a run that is still learning, and such weights make the
# probe's eigenproblems ill-conditioned.
DIVERGED_LOSS_FACTOR = 3.0  # x log(vocab_size), the loss of a uniform prediction
DIVERGED_WEIGHT_RMS = 100.0


def divergence(model: torch.nn.Module) -> str | None:
    """Why the weights look diverged (non-finite, or a tensor's RMS above DIVERGED_WEIGHT_RMS), or None.
    One fused norm over every parameter (a NaN or inf element makes its tensor's norm non-finite), then
    the first offender is described; 0.3 instead of 5 ms a check at the cpu preset."""
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    with torch.no_grad():
        norms = D.host_list(torch.stack(torch._foreach_norm([p for _, p in named])).to(torch.float64))
    for (name, p), norm in zip(named, norms, strict=True):
        if not math.isfinite(norm):  # a non-finite element, or finite ones too large for a float32 norm
            if not torch.isfinite(p).all():
                return f"{name} became non-finite"
            norm = D.host_float(p.double().norm())
        rms = norm / math.sqrt(max(p.numel(), 1))
        if rms > DIVERGED_WEIGHT_RMS:
            return f"{name} has RMS {rms:.3g} (> {DIVERGED_WEIGHT_RMS:g})"
    return None


def _stored_config(rd: RunDir) -> C.RunConfig:
    try:
        return C.from_dict(read_json(rd.config)["config"])
    except (ValueError, KeyError, TypeError) as e:
        raise TrainingError(f"{rd.config} is corrupt ({type(e).__name__}); nothing was changed") from None


def _prepare(cfg: C.RunConfig, rd: RunDir, resume: bool) -> None:
    """Refuse to overwrite a run; on resume, check the stored config matches."""
    if rd.is_done():
        stored = _stored_config(rd) if rd.config.is_file() else None
        if stored != cfg:
            raise TrainingError(f"run folder {rd.path} holds a finished run with a different config")
        return
    if resume:
        if not rd.config.is_file():
            raise TrainingError(f"cannot resume: {rd.path} has no config.json")
        stored = _stored_config(rd)
        if stored != cfg:
            raise TrainingError(f"cannot resume {rd.path}: its config.json differs from the config given")
    elif rd.config.exists():
        raise TrainingError(f"run folder {rd.path} already holds a run; pass --resume to continue it")


def train(
    cfg: C.RunConfig,
    run_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    tensorboard: str | Path | None = None,
) -> RunDir:
    """Train (or resume) one run into `run_dir`; returns its RunDir once done.json is written.
    tensorboard: a log dir for each probe's layer-mean scalars (qkgeom.probing.scalars).

    The folder is locked for the whole run: a second process on it is refused (FolderLockedError).
    """
    C.validate(cfg)
    check_device(cfg.train.device, "train.device")  # before the folder exists: a refused run writes nothing
    if cfg.train.portable:
        D.check_portable()
    tb = TensorBoardLog(tensorboard) if tensorboard else None  # a missing package fails before training
    # on cuda the float32 matmuls outside autocast may use TF32 (as nanoGPT's), for this run only: the
    # caller's setting comes back after, and every probe measures in full float32 (device.exact_float32)
    precision = D.matmul_precision("high") if cfg.train.device.startswith("cuda") else contextlib.nullcontext()
    try:
        with folder_lock(Path(run_dir)), precision:
            return _train(cfg, RunDir(run_dir), resume, progress, tb)
    finally:
        if tb is not None:
            tb.close()


def _train(cfg: C.RunConfig, rd: RunDir, resume: bool, progress: bool, tb: TensorBoardLog | None = None) -> RunDir:
    """The loop, top to bottom: at loop index `step`, probe / evaluate / checkpoint if scheduled,
    stop at the last step, else take one optimiser step."""
    _prepare(cfg, rd, resume)
    if rd.is_done():
        return rd
    run = _Run(cfg, rd, resumed=resume and rd.last_checkpoint.exists(), tb=tb)  # else: afresh in the same folder
    t = cfg.train
    bar = tqdm(
        total=t.steps, initial=run.start, disable=not progress, desc=rd.path.name, unit="step", dynamic_ncols=True
    )
    with bar:  # closed on an error too: the error's line starts a line of its own
        step = run.start
        while True:
            if step > run.start or not run.resumed:  # records at `start` of a resumed run already exist
                if step in run.schedule:
                    run.probe(step)
                if step % t.eval_every == 0 or step == t.steps:
                    run.evaluate(step)
                run.checkpoint(step)
            if step == t.steps:
                break
            loss = run.train_step(step)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{run.tokens_per_step * (step - run.start) / run.segment():.0f}")
    run.finish()
    return rd


def check_resumable(rd: RunDir, t: C.TrainConfig, schedule: set[int], start: int) -> None:
    """Refuse to resume (changing nothing) unless every record the checkpoint at `start` says
    exists is on disk: each probe in the geometry and spectra, each train and validation row in
    metrics.jsonl. A deleted or truncated file would otherwise finish as a "done" run with holes.
    Damaged files raise TrainingError (or DamagedRunError for a garbled metrics line)."""
    try:
        geometry_steps = set(rd.read_geometry()["step"].astype(int))
        spectra_steps = set(rd.read_spectra().get("step", np.array([], dtype=int)).tolist())
    except Exception as e:  # pyarrow, zipfile and numpy raise several types for damaged files
        raise TrainingError(
            f"cannot resume {rd.path}: geometry.parquet or spectra.npz is corrupt ({type(e).__name__}); "
            "nothing was changed"
        ) from None
    probes = {s for s in schedule if s <= start}
    rows = rd.read_metrics()
    train = {r["step"] for r in rows if r.get("split") == "train"}
    valid = {r["step"] for r in rows if r.get("split") == "valid"}
    geometry = rd.geometry if rd.geometry.exists() else rd.geometry_parts
    spectra = rd.spectra if rd.spectra.exists() else rd.spectra_parts
    expected = [
        (geometry, probes - geometry_steps, "probes at steps"),
        (spectra, probes - spectra_steps, "probes at steps"),
        (rd.metrics, set(range(1, start + 1)) - train, "training steps"),
        (rd.metrics, {s for s in range(start + 1) if s % t.eval_every == 0} - valid, "evaluations at steps"),
    ]
    for path, missing, what in expected:
        if missing:
            shown = sorted(missing)[:5]
            raise TrainingError(
                f"cannot resume {rd.path}: {path.name} lacks {len(missing)} {what} {shown}"
                f"{' ...' if len(missing) > 5 else ''} that the checkpoint at step {start} says happened "
                "(deleted or damaged); nothing was changed"
            )


class _Run:
    """The state of one training run and its steps: set-up (fresh or restored from last.pt),
    probe, evaluate, checkpoint, one optimiser step, finish."""

    def __init__(self, cfg: C.RunConfig, rd: RunDir, resumed: bool, tb: TensorBoardLog | None = None) -> None:
        tic = time.perf_counter()
        self.cfg, self.rd, self.resumed = cfg, rd, resumed
        t, m = cfg.train, cfg.model
        threads = t.threads or (1 if t.portable else 0)  # portable: a fixed count (reductions split by it)
        if threads:
            torch.set_num_threads(threads)
        self.device = t.device  # checked by train() before the folder exists
        try:
            vocab = Vocab.from_json(rd.vocab.read_text()) if resumed else None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrainingError(f"cannot resume: {rd.vocab} is missing or corrupt ({type(e).__name__})") from None
        corpus = load_corpus(cfg.data, vocab)
        self.train_data, self.valid_data = corpus.splits["train"], corpus.splits["valid"]
        self.vocab_size, self.unigram_baseline = corpus.vocab.size, unigram_baseline(corpus)
        self.model = GPT(m, corpus.vocab.size, seed=t.seed).to(self.device)
        self.bf16 = C.uses_bf16(t)
        # the training forward (optionally compiled); probes run the eager model's explicit path
        self.forward_loss = torch.compile(self.model.loss) if t.compile else self.model.loss
        self.opt = make_optimizer(self.model, t)
        # bf16 on a CPU: the faster attention kernel here, timed once on this model and batch (before any
        # hook that would see the timing's forwards), cached per machine and shape, recorded
        self.attention = (
            cpu_bf16_attention(self.model, self.forward_loss, cfg, self.train_data)
            if self.bf16 and self.device == "cpu"
            else None
        )
        self.w_q, self.w_k = gpt_weights(self.model)  # (H, D, E) views: in-place updates keep them valid
        iv = cfg.intervention
        self.control = I.SpectrumControl.create(
            iv, self.w_q, self.w_k, t.steps, I.baseline_spectra(iv, rd),
            I.baseline_spectra(iv, rd, I.row_std_metric(iv)) if iv.match_row_std else None,
        )  # fmt: skip
        if self.control.cov is not None:  # the running input covariance, fed by the training forwards
            for li, block in enumerate(self.model.blocks):
                block.hook_attn_in.register_forward_hook(self.control.cov.hook(li))
        if cfg.intervention.instant:  # the zero-training complement, built on the run's initial weights
            w_q0, w_k0 = gpt_weights(GPT(m, corpus.vocab.size, seed=t.seed))
            self.instant = K.instant_controls(iv.instant, w_q0, w_k0, t.steps, iv.layers, iv.floor, iv.control_seqs)
        else:
            self.instant = []
        n_probe = C.probe_n_seqs(cfg)
        offsets = fixed_offsets(len(self.valid_data), m.n_ctx, n_probe)
        self.probe_idx = torch.from_numpy(gather(self.valid_data, offsets, m.n_ctx)[0]).to(self.device)
        self.schedule = set(probe_steps(t.steps, cfg.probe.every, cfg.probe.log_early))
        # the closed loop's control set (interventions.py): training text disjoint from every validation
        # measure, or (control_seqs = 0, v4 as first registered) the probe's own first sequences
        self.control_idx = None
        if iv.control_seqs:
            offsets = fixed_offsets(len(self.train_data), m.n_ctx, iv.control_seqs)  # training text
            self.control_idx = torch.from_numpy(gather(self.train_data, offsets, m.n_ctx)[0]).to(self.device)
        if iv.match_row_std:
            ref_idx = self.control_idx if self.control_idx is not None else self.probe_idx[: I.ROW_STD_SEQS]
            self.control.row_std_inputs = K.CachedInputs(self.model, ref_idx, self.schedule)
        self.kept = set(C.kept_steps(t))  # checkpoints kept beside last.pt
        self.tokens_per_step = t.batch_size * m.n_ctx
        self.loss_ceiling = DIVERGED_LOSS_FACTOR * math.log(corpus.vocab.size)
        self.start, self.elapsed0 = 0, 0.0
        self.parts: dict[int, list[str]] = {}  # probe step -> sha256 of its geometry and spectra parts
        # this process's seconds in each kind of work besides the optimiser steps (done.json): where a
        # whole job's time goes beyond its training steps (bench/train_throughput.py reads them)
        self.probe_seconds = self.eval_seconds = self.checkpoint_seconds = 0.0
        self.tb = tb  # layer-mean scalars per probe, if asked for
        if resumed:
            self._restore()
        else:
            self._start_fresh(corpus, n_probe)
        self.t0 = time.perf_counter()
        self.startup_seconds = self.t0 - tic  # corpus, model, optimiser, probe batch (and a restore)

    def _restore(self) -> None:
        rd = self.rd
        state = rd.load_checkpoint()
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.control.load_state_dict(state["control"])
        self.start, self.elapsed0 = int(state["step"]), float(state["elapsed"])
        start = self.start
        check_resumable(rd, self.cfg.train, self.schedule, start)
        self.parts = {int(k): v for k, v in state.get("parts", {}).items() if int(k) <= start}
        if not (rd.geometry.exists() or rd.spectra.exists()):  # parts as written (a consolidation rewrites them)
            rd.check_parts(self.parts)
        # only now change the folder: back to one part per probe (a consolidated or old-layout file
        # is split), then drop what the loop will recompute
        if rd.geometry.exists() or rd.spectra.exists():
            rd.parts_from_files()
        rd.drop_probes_after(start)
        rd.truncate_metrics(start)

    def _start_fresh(self, corpus, n_probe: int) -> None:
        rd, cfg = self.rd, self.cfg
        rd.path.mkdir(parents=True, exist_ok=True)
        rd.metrics.unlink(missing_ok=True)
        # vocab first: a folder with config.json always has its vocabulary
        rd.write_vocab(corpus.vocab.to_json())
        write_json(
            rd.config,
            {
                "run_id": rd.path.name,
                "config": C.to_dict(cfg),
                "provenance": provenance(),
                "tokens_per_step": self.tokens_per_step,
                "vocab_size": corpus.vocab.size,
                "data_folder": str(corpus.folder),
                "probe_steps": sorted(self.schedule),
                "kept_checkpoints": sorted(self.kept),
                "probe_n_seqs": n_probe,
                "probe_tokens": n_probe * cfg.model.n_ctx,
                "probe_logit_seqs": cfg.probe.settings.logit_count(n_probe),
                "notes": I.notes(cfg.intervention, cfg.model.qk_init),
                "attention_path": self.attention,  # bf16 on a CPU: the kernel timed fastest here (else null)
            },
        )

    def clock(self) -> float:
        """Training seconds, summed over resumed segments."""
        return self.elapsed0 + time.perf_counter() - self.t0

    def segment(self) -> float:
        """Seconds of this process's segment."""
        return self.clock() - self.elapsed0

    def check_finite(self, step: int) -> None:
        why = divergence(self.model)
        if why:
            raise TrainingError(
                f"training diverged by step {step} ({why}); lower train.lr "
                f"(finished records and checkpoints in {self.rd.path} are kept)"
            )

    @D.exact_float32()  # measured in full float32 whatever training allows (train() allows TF32 on cuda)
    def probe(self, step: int) -> None:
        tic = time.perf_counter()
        self.check_finite(step)  # divergence is caught before any eigen-solve sees the weights
        self.model.eval()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NumericalWarning)
            rows, spec = probe_gpt(self.model, self.probe_idx, self.cfg.probe.settings)
        for w in caught:  # a numerical fallback is recorded, never fatal
            self.rd.append_warning({"step": step, "warning": str(w.message)})
        rows += self.control.rows(step)
        if self.control_idx is not None:  # the row std on the control set: the none run's is the arms' target
            rows += K.control_rows(self.model, self.control_idx, self.w_q, self.w_k)
        if self.instant and step > 0 and step % self.cfg.probe.every == 0:
            rows += self._instant(step, rows)
        self.model.train()
        rows = [{"step": step, "tokens_seen": step * self.tokens_per_step, **r} for r in rows]
        self.parts[step] = self.rd.append_probe(step, rows, spec)  # one part per probe: linear I/O over a run
        if self.tb is not None:
            self.tb.write(step, rows)
        self.probe_seconds += time.perf_counter() - tic

    def _instant(self, step: int, rows: list[dict]) -> list[dict]:
        """The zero-training complement at this probe, relative to this run's own probe values."""
        n_layers, n_heads = len(self.w_k), self.w_k[0].shape[0]
        current = {}
        needed = {I.controlled_metric(ctl.cfg) for _, ctl in self.instant}
        needed |= {I.row_std_metric(ctl.cfg) for _, ctl in self.instant if ctl.cfg.match_row_std}
        for metric in needed:
            table = torch.full((n_layers, n_heads), float("nan"), dtype=torch.float64)
            for r in rows:
                if r["metric"] == metric and r["head"] >= 0 and r["site"] == "none":
                    table[r["layer"], r["head"]] = r["value"]
            current[metric] = table
        return K.instant_rows(self.model, self.probe_idx, self.instant, step, current, self.control_idx)

    def evaluate(self, step: int) -> None:
        tic = time.perf_counter()
        self.check_finite(step)
        val = evaluate(self.model, self.valid_data, self.cfg.train, self.cfg.model.n_ctx, self.device)
        self.rd.append_metrics(
            {
                "step": step,
                "tokens_seen": step * self.tokens_per_step,
                "split": "valid",
                "loss": val,
                "elapsed": self.clock(),
            }
        )
        self.eval_seconds += time.perf_counter() - tic

    def checkpoint(self, step: int) -> None:
        t = self.cfg.train
        if step not in self.kept and step % t.checkpoint_every and step != t.steps:
            return
        tic = time.perf_counter()
        self.check_finite(step)  # never let a diverged state overwrite the last good checkpoint
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "control": self.control.state_dict(),
            "parts": {str(k): v for k, v in self.parts.items()},  # each probe part's sha256: resume checks them
            "step": step,
            "elapsed": self.clock(),
        }
        if step in self.kept:
            self.rd.save_checkpoint(state, kept_checkpoint(step))
        if step % t.checkpoint_every == 0 or step == t.steps:
            self.rd.save_checkpoint(state, LAST_CHECKPOINT)
        self.checkpoint_seconds += time.perf_counter() - tic

    def train_step(self, step: int) -> float:
        """The update at loop index `step` (data and lr are pure functions of it); its loss."""
        t, m = self.cfg.train, self.cfg.model
        lr = lr_at(step, t)
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y = gather(
            self.train_data, batch_offsets(len(self.train_data), m.n_ctx, t.batch_size, t.data_seed, step), m.n_ctx
        )
        device_type = self.device.split(":")[0]
        with (
            torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.bf16),
            attention_path(self.attention["path"] if self.attention else None),
        ):
            loss = self.forward_loss(torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device))
        loss_value = D.host_float(loss)
        if not math.isfinite(loss_value) or loss_value > self.loss_ceiling:
            raise TrainingError(
                f"loss became {loss_value:.4g} at step {step} (lr={lr:.3g}); training diverged, lower train.lr "
                f"(finished records and checkpoints in {self.rd.path} are kept)"
            )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        self.opt.step()
        self.control.apply(self.w_q, self.w_k, step + 1)
        self.rd.append_metrics(
            {
                "step": step + 1,
                "tokens_seen": (step + 1) * self.tokens_per_step,
                "split": "train",
                "loss": loss_value,
                "lr": lr,
                "grad_norm": D.host_float(grad_norm),
                "elapsed": self.clock(),
            }
        )
        return loss_value

    def finish(self) -> None:
        tic = time.perf_counter()
        self.rd.consolidate_probes()  # parts -> geometry.parquet, spectra.npz (one O(run) write)
        write_json(
            self.rd.done,
            {
                "step": self.cfg.train.steps,
                "elapsed": self.clock(),
                "final_valid_loss": self.rd.read_metrics()[-1]["loss"],
                "probe_seconds_last_segment": self.probe_seconds,
                "eval_seconds_last_segment": self.eval_seconds,
                "checkpoint_seconds_last_segment": self.checkpoint_seconds,
                "consolidate_seconds": time.perf_counter() - tic,
                "startup_seconds_last_segment": self.startup_seconds,
                "segment_seconds": self.segment(),
                "attention_path": self.attention,
                # facts known here, written once (the context box and `qkgeom train` read them)
                "n_parameters": sum(p.numel() for p in self.model.parameters()),
                "tokens_seen": self.cfg.train.steps * self.tokens_per_step,
                "vocab_size": self.vocab_size,
                "unigram_baseline": self.unigram_baseline,
            },
        )
