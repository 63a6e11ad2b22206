"""Follow Q/K geometry during *your own* training run: `qkgeom.Probe`, callable from any loop.

    probe = qkgeom.Probe(model, batch, every=100, out="runs/mine/seed0", seed=0)
    for step in range(steps + 1):
        probe(step, tokens_seen=step * tokens_per_step)   # measures only at its schedule
        ...                                               # your optimiser step
    probe.finish(steps)

The folder it writes is a run folder (results.py owns the layout: config.json, one part file per
probe, consolidated into geometry.parquet and spectra.npz by `finish`, then done.json), so
`qkgeom analyze`, `qkgeom report` and the claims check read it unchanged, and several such folders
(seeds of one design) under one parent form a study. The model is any supported Hugging Face model
(qkgeom.probing.archs: GPT-2, GPT-NeoX, Llama family, ...; its own attention is read through the
transformers attention interface, then restored) or a qkgeom GPT (its hook sites). The callbacks in
qkgeom.integrations are a few lines over this class.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkgeom import device as D
from qkgeom.config import ConfigError, ProbeSettings
from qkgeom.errors import QKGeomError
from qkgeom.probing import archs
from qkgeom.probing.probe import nonfinite_weights
from qkgeom.probing.scalars import TensorBoardLog, layer_means
from qkgeom.provenance import provenance
from qkgeom.results import RunDir, folder_lock, read_json, write_json


class ProbeError(QKGeomError, ValueError):
    """A model or probe batch that qkgeom.Probe cannot measure, or a folder it must not write."""


def probe_schedule(step: int, every: int, log_early: bool = True) -> bool:
    """Whether `step` is a probe step: 0, 1, 2, 4, ... below `every` (if log_early), then every
    multiple of `every` (qkgeom train's schedule, for a run whose length is not known in advance)."""
    if step % every == 0:
        return True
    return log_early and step < every and step & (step - 1) == 0


def _unwrap(model: nn.Module) -> nn.Module:
    """The module that holds the weights: through DistributedDataParallel (.module) and torch.compile."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def readable(model: nn.Module) -> nn.Module:
    """The module Probe reads: `model` unwrapped (DDP, torch.compile), or else the first of its
    sub-modules that is a qkgeom GPT or a supported Hugging Face model (a LightningModule holding
    one, a PEFT wrapper). Raises ProbeError naming what it reads if there is none."""
    model = _unwrap(model)
    for _, sub in model.named_modules():
        try:
            _kind(sub)
            return sub
        except ProbeError:
            continue
    _kind(model)  # raises, naming the model
    return model


def _kind(model: nn.Module) -> str:
    """`gpt` (qkgeom's own model: its hook sites) or `hf` (a supported Hugging Face model)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in archs.ARCHS:
        return "hf"
    try:  # a path lookup, not a walk of every module (readable() asks this of each sub-module)
        model.get_submodule("blocks.0.attn.hook_q"), model.get_submodule("blocks.0.attn.hook_pattern")
        return "gpt"
    except AttributeError:
        pass
    raise ProbeError(
        f"qkgeom.Probe cannot read {type(model).__name__}"
        + (f" (model type {model_type!r})" if model_type else "")
        + f": it reads qkgeom's GPT and Hugging Face models of types {', '.join(sorted(archs.ARCHS))}; "
        "for any other model read q, k with hooks and call qkgeom.measure"
    )


def _n_layers(model: nn.Module, kind: str) -> int | None:
    if kind == "gpt":
        return len(model.blocks)
    if kind == "hf":
        return len(archs.arch_of(model).weights(model)[0])
    return None  # a capture function's model: known at the first probe


def _input_ids(batch: torch.Tensor | dict) -> torch.Tensor:
    """The probe batch as int64 input ids (B, T); a dict's `input_ids`; anything else refused."""
    from qkgeom.probing.hf import ids_problem

    batch = batch["input_ids"] if isinstance(batch, dict) else batch
    if (why := ids_problem(batch)) is not None:
        raise ProbeError(f"the probe batch must be input ids, an integer tensor (batch, seq_len), got {why}")
    return batch.long()


def _checked(every: int, steps: int | None, logit_max_seqs: int, pr: str, alpha: str) -> ProbeSettings:
    """Probe's arguments that need no model: the schedule, the run's length and the settings."""
    if every < 1:
        raise ProbeError(f"every must be a positive number of steps, got {every}")
    if steps is not None and steps < 0:
        raise ProbeError(f"steps (the run's length) must be >= 0, got {steps}")
    try:
        return ProbeSettings.of(logit_max_seqs, pr, alpha)
    except ConfigError as e:
        raise ProbeError(str(e)) from None


def _model_config(model: nn.Module) -> dict | None:
    config = getattr(model, "config", None)
    if hasattr(config, "to_json_string"):
        import json

        return json.loads(config.to_json_string(use_diff=False))
    return None


# capture(model, batch) -> {"q": per-layer (B, H_q, T, E), "k": (B, H_kv, T, E), optional
# "pattern": (B, H_q, T, T) per layer, "w_q", "w_k": per-layer (H, D, E), "causal": bool, "window": int}
Capture = Callable[[nn.Module, torch.Tensor], dict[str, Any]]


class Probe:
    """Measures `model` on one fixed `batch` of input ids (B, T) at steps 0, 1, 2, 4, ... below
    `every`, then every `every` steps, into the run folder `out`.

    steps: the run's length if known (recorded; `finish` takes the final one). seed, data_seed:
    the run's seeds, as analyze groups runs by them. logit_max_seqs: sequences of the batch whose
    T x T logit spectrum is taken (0 = all). pr_convention: `variance` or `singular` PRs;
    alpha_convention: `weightwatcher` or `clauset` alphas (every such row's note names its convention).
    tensorboard: a log dir for the layer-mean scalars (qkgeom.probing.scalars); sinks: (name, fn(step,
    scalars) -> sent) for the host's own trackers (qkgeom.integrations.trackers; sends counted in
    done.json). resume: continue a folder an interrupted run left (probes after the first step probed
    again are replaced); without it such a folder is refused. capture: for any other
    model, a function (model, batch) -> {"q", "k", optional "pattern", "w_q", "w_k", "causal", "window"} with
    the shapes of qkgeom.measure (e.g. read with forward hooks); it runs under no_grad in eval mode.
    The folder is locked from here to `finish`/`close`: a second process on it is refused."""

    def __init__(
        self,
        model: nn.Module,
        batch: torch.Tensor,
        every: int = 100,
        out: str | Path = "runs/probe",
        *,
        steps: int | None = None,
        seed: int = 0,
        data_seed: int | None = None,
        name: str | None = None,
        log_early: bool = True,
        logit_max_seqs: int = 4,
        tensorboard: str | Path | None = None,
        resume: bool = False,
        capture: Capture | None = None,
        sinks: Sequence[tuple[str, Callable[[int, dict[str, float]], bool]]] = (),
        pr_convention: str = "variance",
        alpha_convention: str = "weightwatcher",
    ) -> None:
        self.settings = _checked(every, steps, logit_max_seqs, pr_convention, alpha_convention)
        self.capture = capture
        self.model = _unwrap(model) if capture else readable(model)
        if (first := next(self.model.parameters(), None)) is not None:
            D.check_float64(first.device, "qkgeom.Probe: the model")
        self.kind = "capture" if capture else _kind(self.model)
        self.batch, self.every, self.log_early = _input_ids(batch), every, log_early
        self.steps, self.last_step = steps, -1
        self.rd = RunDir(out)
        self.tb = TensorBoardLog(tensorboard) if tensorboard else None  # a missing package: refused before the lock
        self.sinks = list(sinks)  # the host's trackers (integrations.trackers): the layer-mean scalars per probe
        self.sent = {name: 0 for name, _ in self.sinks}
        self.dropped: dict[str, str] = {}  # sink -> why it was dropped (done.json)
        self.info = self._run_info(name, seed, data_seed)
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(folder_lock(self.rd.path))  # also creates the folder
        try:
            self._open_folder(resume)
        except BaseException:
            self.close()
            raise
        self.t0, self.probe_seconds = time.perf_counter(), 0.0
        self.skipped = ""  # why the last probe due was not taken, if it was not

    @classmethod
    def check_arguments(
        cls, batch: torch.Tensor | dict, every: int, kwargs: dict[str, Any], fixed: Sequence[str] = ()
    ) -> None:
        """Refuse (ProbeError) what `Probe(model, batch, every, out, **kwargs)` would refuse before it sees
        the model: a keyword Probe does not take or the caller sets itself (`fixed`), and bad values of
        every, steps, the batch and the settings. The callbacks build their Probe when training starts;
        they call this when built."""
        import inspect

        if own := sorted(set(fixed) & kwargs.keys()):
            raise ProbeError(f"qkgeom.Probe: {', '.join(own)} is set by the callback itself, not by its caller")
        signature = inspect.signature(cls)
        try:
            signature.bind_partial(None, batch, every, **kwargs)
        except TypeError as e:
            raise ProbeError(f"qkgeom.Probe: {e}") from None
        defaults = {k: p.default for k, p in signature.parameters.items()} | kwargs
        _checked(every, *(defaults[k] for k in ("steps", "logit_max_seqs", "pr_convention", "alpha_convention")))
        _input_ids(batch)

    def _run_info(self, name: str | None, seed: int, data_seed: int | None) -> dict:
        """config.json of the run folder: what was probed, how, and the run's seeds (read by analyze)."""
        inner, batch = self.model, self.batch
        model_type = {"gpt": "qkgeom-gpt", "capture": "custom (capture function)"}.get(
            self.kind, getattr(getattr(inner, "config", None), "model_type", None)
        )
        return {
            "run_id": self.rd.path.name,
            "source": "qkgeom.Probe",  # not a qkgeom train run: no vocab.json, no checkpoints
            "config": {
                "name": name or self.rd.path.name,
                "data": {"source": "external", "tokenizer": "external"},
                "model": {
                    "class": type(inner).__name__,
                    "model_type": model_type,
                    "n_layers": _n_layers(inner, self.kind),
                    "qk_init": "default",
                    "parameters": sum(p.numel() for p in inner.parameters()),
                },
                "train": {
                    "seed": seed,
                    "data_seed": seed if data_seed is None else data_seed,
                    "steps": self.steps,
                    "warmup_steps": 0,
                },
                "probe": {
                    "every": self.every,
                    "log_early": self.log_early,
                    "n_seqs": int(batch.shape[0]),
                    "seq_len": int(batch.shape[1]),
                    "logit_max_seqs": self.settings.logit_seqs or 0,
                    "pr_convention": self.settings.conventions.pr,
                    "alpha_convention": self.settings.conventions.alpha,
                },
                "intervention": {"kind": "none"},
            },
            "model_config": _model_config(inner),  # a Hugging Face model's own config, as it would save it
            "probe_tokens": int(batch.numel()),
            "probe_batch_sha256": hashlib.sha256(D.to_host(batch).tobytes()).hexdigest(),
            "provenance": provenance(),
        }

    def _open_folder(self, resume: bool) -> None:
        """A new run writes config.json; a resumed one must continue the same run, and a consolidation
        it was killed in (geometry.parquet written, the parts still there) is split back into parts."""
        self._check_folder(resume)
        self.resuming = resume and self.rd.config.exists()
        if self.resuming:
            self._check_same_run(read_json(self.rd.config))
            self.rd.parts_from_files()
        else:
            write_json(self.rd.config, self.info)
        self._metrics_resumed = not self.resuming  # the first metrics row after a resume drops the rows it redoes

    def _check_folder(self, resume: bool) -> None:
        rd = self.rd
        if rd.is_done():
            raise ProbeError(f"{rd.path} holds a finished run; choose another out folder or delete it")
        if rd.config.exists() and not resume:
            raise ProbeError(
                f"{rd.path} holds probes of an interrupted run: pass resume=True to continue it "
                "(later probes are replaced), or choose another out folder"
            )
        if rd.config.exists() and read_json(rd.config).get("source") != "qkgeom.Probe":
            raise ProbeError(f"{rd.path} is not a qkgeom.Probe folder; choose another out folder")

    def _check_same_run(self, old: dict) -> None:
        """A resume continues the same model on the same probe batch, or its folder would mix two runs."""
        now, was = self.info["config"], old.get("config", {})
        keys = [("model", k) for k in ("class", "model_type", "n_layers", "parameters")]
        for section, key in keys + [("probe", k) for k in ("n_seqs", "seq_len", "every")]:
            a, b = was.get(section, {}).get(key), now[section][key]
            if a is not None and b is not None and a != b:
                raise ProbeError(
                    f"{self.rd.path} holds a run with {section}.{key} = {a!r}, not {b!r}: a resume must continue "
                    "the same model and probe batch; choose another out folder"
                )
        if old.get("probe_batch_sha256", self.info["probe_batch_sha256"]) != self.info["probe_batch_sha256"]:
            raise ProbeError(
                f"{self.rd.path} was probed on another batch (sha256 differs): a resume must use the same probe "
                "batch; choose another out folder"
            )

    def due(self, step: int) -> bool:
        """Whether `step` is on the probe schedule."""
        return probe_schedule(step, self.every, self.log_early)

    def __call__(self, step: int, tokens_seen: int | None = None, force: bool = False) -> bool:
        """Probe at `step` if it is due (or `force`); True if it probed. tokens_seen: training
        tokens so far (recorded; -1 if not given)."""
        self._open(f"probe step {step}")
        if step < 0:
            raise ProbeError(f"a probe's step must be >= 0, got {step}")
        if not force and (step <= self.last_step or not self.due(step)):
            return False  # (a step seen again: gradient accumulation calls back once per micro-batch)
        tic = time.perf_counter()
        if self.resuming and self.last_step < 0:
            self.rd.drop_probes_after(step - 1)  # what the interrupted run probed from here on is redone
        bad = nonfinite_weights(self.model)
        if bad is not None:  # a diverged model has no geometry; a monitor does not stop the training it watches
            why = f"step {step}: not probed, the model's weights are not finite ({bad})"
            self.rd.append_warning({"step": step, "warning": why})
            self.skipped = why
            warnings.warn(f"qkgeom.Probe: {why}", RuntimeWarning, stacklevel=2)
            return False
        rows, spectra = self.measure()
        rows = [{"step": step, "tokens_seen": -1 if tokens_seen is None else int(tokens_seen), **r} for r in rows]
        self.rd.append_probe(step, rows, spectra)
        if self.tb is not None:
            self.tb.write(step, rows)
        if self.sinks:
            means = layer_means(rows)
            for name, send in list(self.sinks):
                try:
                    self.sent[name] += bool(send(step, means))
                except Exception as e:  # noqa: BLE001 - a host tracker's failure must not end the training run
                    self.drop_sink(name, step, e)
        self.last_step = max(self.last_step, step)
        self.probe_seconds += time.perf_counter() - tic
        return True

    def drop_sink(self, name: str, step: int, error: Exception) -> None:
        """A tracker that raised is reported once (stderr now, done.json at the end) and sent nothing more:
        the geometry is in the run folder either way."""
        why = (
            f"{type(error).__name__} at step {step}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        )
        self.dropped[name] = why
        self.sinks = [(n, f) for n, f in self.sinks if n != name]
        print(f"qkgeom.Probe: tracker {name} failed ({why}); dropped, training goes on", file=sys.stderr)

    @torch.no_grad()
    @D.exact_float32()
    def measure(self) -> tuple[list[dict], dict]:
        """The geometry rows and spectra of the model now, on the probe batch (nothing written).
        The model's training mode, and a Hugging Face model's attention implementation, are restored."""
        from qkgeom.probing.hf import analyse_model
        from qkgeom.probing.probe import probe_gpt

        model = self.model
        was_training = model.training
        device = next(model.parameters()).device
        D.check_float64(device, "qkgeom.Probe: the model")  # moved there after the Probe was made
        model.eval()
        try:
            if self.kind == "gpt":
                return probe_gpt(model, self.batch.to(device), self.settings)
            if self.kind == "capture":
                return self._captured(model, self.batch.to(device))
            impl = model.config._attn_implementation
            try:
                return analyse_model(model, iter([self.batch.to(device)]), settings=self.settings)
            finally:
                if model.config._attn_implementation != impl:
                    model.set_attn_implementation(impl)
        finally:
            model.train(was_training)

    def _captured(self, model: nn.Module, batch: torch.Tensor) -> tuple[list[dict], dict]:
        from qkgeom.probing.probe import activation_geometry

        got = self.capture(model, batch)
        return activation_geometry(
            got["q"], got["k"], got.get("pattern"), got.get("causal", True), got.get("w_q"), got.get("w_k"),
            self.settings, got.get("window"),
        )  # fmt: skip

    def log_metrics(
        self, step: int, loss: float | torch.Tensor, split: str = "train", tokens_seen: int | None = None
    ) -> None:
        """A loss (a float, or a one-element tensor on any device) for the report's curves (metrics.jsonl:
        step, tokens_seen, split, loss)."""
        self._open(f"log step {step}")
        if not self._metrics_resumed:  # what the interrupted run logged from this step on is logged again
            self.rd.truncate_metrics(step - 1)
            self._metrics_resumed = True
        row = {"step": step, "tokens_seen": -1 if tokens_seen is None else tokens_seen, "split": split}
        self.rd.append_metrics({**row, "loss": D.as_float(loss)})

    def finish(
        self, steps: int | None = None, tokens_seen: int | None = None, final_valid_loss: float | None = None
    ) -> Path:
        """Close the run: a last probe at `steps` if it was not probed yet (as qkgeom train probes
        its last step), the probes consolidated, config.json's train.steps set (`steps`, the one
        given at construction, or the last step probed), done.json written last. final_valid_loss:
        recorded (default: the last validation loss logged). Returns the folder."""
        self._open("finish")
        if steps is not None and steps > self.last_step:
            self(steps, tokens_seen, force=True)
        if self.last_step < 0 and not self.rd.geometry_parts.is_dir():
            self.close()
            why = self.skipped or "call the probe at step 0"
            raise ProbeError(f"no probe was taken, so {self.rd.path} would hold no geometry ({why})")
        steps = steps if steps is not None else self.steps if self.steps is not None else self.last_step
        info = read_json(self.rd.config)
        info["config"]["train"]["steps"] = int(steps)
        if info["config"]["model"]["n_layers"] is None:  # a capture function's model: from what it handed over
            info["config"]["model"]["n_layers"] = int(self.rd.read_geometry()["layer"].max() + 1)
        write_json(self.rd.config, info)
        self.rd.consolidate_probes()
        if final_valid_loss is None:
            valid = [r["loss"] for r in self.rd.read_metrics() if r.get("split") == "valid"]
            final_valid_loss = valid[-1] if valid else None
        write_json(
            self.rd.done,
            {
                "step": int(steps),
                "elapsed": time.perf_counter() - self.t0,
                "probe_seconds": self.probe_seconds,
                "final_valid_loss": final_valid_loss,
            }
            | ({"scalars_sent": self.sent} if self.sent else {})
            | ({"sinks_dropped": self.dropped} if self.dropped else {}),
        )
        self.close()
        return self.rd.path

    def _open(self, what: str) -> None:
        """Refuse to write into the folder once it is released: another process may hold it by then."""
        if self._lock is None:
            done = "finished" if self.rd.is_done() else "closed"
            raise ProbeError(f"cannot {what}: the probe of {self.rd.path} is {done}; a new run takes a new Probe")

    def close(self) -> None:
        """Release the folder (and the TensorBoard writer) without finishing the run."""
        if self._lock is None:
            return
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self._lock.close()
        self._lock = None

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None and not self.rd.is_done():
            self.finish()
        else:
            self.close()
