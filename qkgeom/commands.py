"""What each `qkgeom` command does: one library call and what it prints (cli.py turns argv into the
Namespace these read). Heavy imports stay inside each command, so `qkgeom --help` starts fast, and the
reading commands (analyze, report, verdicts) and a refused config import no torch (tests/e2e/test_cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkgeom import config as C
from qkgeom.errors import QKGeomError
from qkgeom.studies import records_dir, sweep_study


def cmd_train(args: argparse.Namespace) -> int:
    """`qkgeom train`: one run (or its resume) into a run folder."""
    cfg = C.load(args.config, args.overrides)  # a bad config is refused before torch is imported
    from qkgeom.training.loop import train

    out = Path(args.out) if args.out else Path(args.runs) / "train" / C.run_id(cfg)
    rd = train(cfg, out, resume=args.resume, progress=not args.no_progress, tensorboard=args.tensorboard)
    print(f"run complete: {rd.path}")
    done = json.loads(rd.done.read_text())
    if "unigram_baseline" in done:
        loss, base, tokens = done["final_valid_loss"], done["unigram_baseline"], done["tokens_seen"]
        where = "below" if loss < base else "not yet below"
        print(
            f"  validation loss {loss:.3f} nats/token, {where} the unigram baseline {base:.3f}, after "
            f"{tokens:,} tokens ({tokens / done['n_parameters']:.2f} per parameter)"
        )
    print(f"  next: qkgeom report {rd.path}   (figures, per-layer table, context)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """`qkgeom sweep`: a grid of runs; exit 1 if any run failed."""
    _, _, res = sweep_study(args)
    return 1 if res is not None and res.failed else 0


def _folder(path: str) -> None:
    """A reading command's DIR, refused before the analysis' imports (pandas, scipy, matplotlib: 1.4 s)."""
    if not Path(path).is_dir():
        raise QKGeomError(f"{path} is not a folder")


def _analyze(path: str | Path):
    """Analyse a folder of runs (with a family study's trends), printing one warning line per skipped run."""
    from qkgeom.families.study import analyze_study

    a = analyze_study(path)
    for msg in a.skipped:
        print(f"warning: {msg}", file=sys.stderr)
    return a


def _ladder(path: str | Path, report: bool = False) -> bool:
    """A token ladder is analysed by analysis.ladder (analysis.study.ladder_tables, and with `report` its
    page, report.study.write_ladder_report); print its verdicts."""
    from qkgeom.analysis.runs import is_ladder
    from qkgeom.analysis.study import format_verdict_table, ladder_tables

    if not is_ladder(path):
        return False
    _, table, _, _ = ladder_tables(path)
    if report:
        from qkgeom.report.study import write_ladder_report

        page = write_ladder_report(path)
    print(format_verdict_table(table))
    print(
        f"\nwrote {Path(path) / 'claims.csv'}, {Path(path) / 'verdicts.csv'}" + (f"; report: {page}" if report else "")
    )
    return True


def cmd_analyze(args: argparse.Namespace) -> int:
    """`qkgeom analyze`: the judged tables of a folder of runs (no report code is imported)."""
    _folder(args.dir)
    from qkgeom.analysis.study import format_claims

    if _ladder(args.dir):
        return 0
    a = _analyze(args.dir)
    if a.blind:
        print(f"BLIND: {a.blind} (the checks below; outcomes are read at the registered n)\n")
    print(format_claims(a.claims))
    n_traj = a.trajectories.groupby(["intervention", "qk_init", "n_layers", "layer"]).ngroups
    print(
        f"\n{a.geometry['run_id'].nunique()} runs, {n_traj} seed-averaged layer trajectories; "
        f"wrote {a.claims_path} and {a.path / 'summary.csv'} (and .parquet)"
    )
    return 0


def cmd_verdicts(args: argparse.Namespace) -> int:
    """`qkgeom verdicts`: DIR/VERDICTS.md from every committed study's primaries."""
    _folder(args.dir)
    from qkgeom.analysis.verdict_index import terminal_summary, verdicts_index
    from qkgeom.results import atomic_write_bytes

    text = verdicts_index(args.dir)
    atomic_write_bytes(Path(args.dir) / "VERDICTS.md", text.encode())
    print(f"{terminal_summary(text)}\n\nall columns, and the registered amendments: {Path(args.dir) / 'VERDICTS.md'}")
    return 0


def cmd_amend(args: argparse.Namespace) -> int:
    """`qkgeom amend`: register a changed pre-registration as a new version."""
    from qkgeom.analysis.prereg import RecordError, register_version, seal_records, write_pin

    if not Path(args.dir).is_dir():  # never create the folder it names
        raise RecordError(f"{args.dir} is not a folder: nothing to amend")
    if not args.note.strip():  # every kind of amendment says what and why
        raise RecordError("qkgeom amend needs a --note saying what changed and why")
    if args.pin and args.seal:  # one amendment a call: --seal was dropped without a word
        raise RecordError("--pin and --seal are two amendments: run qkgeom amend once for each")
    if args.pin:
        write_pin(args.dir)
        print(f"{args.dir}: pinned (pre-registration and claims.csv digests in preregistration_pin.json: {args.note})")
        return 0
    if args.seal:
        sealed = seal_records(args.dir)
        print(f"{args.dir}: sealed {len(sealed)} record(s) by their data ({args.note.strip()})")
        return 0
    entry = register_version(args.dir, args.note, args.sweep)
    print(f"{args.dir}: pre-registration version {entry['version']} registered ({entry['note']})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`qkgeom report`: the HTML report of a study, a run, a ladder or a `qkgeom pretrained` folder."""
    _folder(args.dir)
    from qkgeom.analysis.families import family_tables
    from qkgeom.report.family import family_study_section, write_family_report
    from qkgeom.report.study import write_report
    from qkgeom.results import is_pretrained_output

    if is_pretrained_output(args.dir):  # a model or checkpoint family from `qkgeom pretrained`
        family_tables(args.dir)  # judged and written, then drawn
        print(f"report: {write_family_report(args.dir)}")
        return 0
    if _ladder(args.dir, report=True):
        return 0
    print(f"report: {write_report(_analyze(args.dir), family_study_section(args.dir))}")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    """`qkgeom study`: sweep, analyze and report; an accumulating study is analysed from its records."""
    from qkgeom.analysis.study import format_verdicts
    from qkgeom.families.study import analyse_families, is_family_study
    from qkgeom.report.family import family_study_section
    from qkgeom.report.study import write_report

    spec, out, res = sweep_study(args)
    if res is None:  # --dry-run
        return 0
    records = records_dir(spec)
    if records is not None:  # an accumulating study: it is analysed from all its committed records
        from qkgeom.training.grid import expand, write_manifest

        write_manifest(spec, expand(spec), records)
        out = records
    if is_family_study(out):  # runs that kept log-spaced checkpoints: each read as a checkpoint family
        analyse_families(out, progress=not args.no_progress)
    if _ladder(out, report=True):
        return 1 if res.failed else 0
    a = _analyze(out)
    report = write_report(a, family_study_section(out))
    if a.blind:
        print(f"BLIND: {a.blind}")
    print(format_verdicts(a.claims))
    print(f"\nall claims: {a.claims_path} (or qkgeom analyze {out})\nreport: {report}")
    return 1 if res.failed else 0


def cmd_pretrained(args: argparse.Namespace) -> int:
    """`qkgeom pretrained`: a Hugging Face model or checkpoint family, measured and reported."""
    from qkgeom.probing.archs import check_model_type, resolve_revision

    for rev in args.revision or [None]:  # an unsupported local model: one line at once, nothing imported
        check_model_type(args.model, rev)
    flags = {
        "model": args.model,
        "revisions": args.revision or None,
        "family": args.family,
        "every": args.every,
        "all_revisions": args.all_revisions,
        "text": args.text,
        "tokenizer": args.tokenizer,
        "n_tokens": args.n_tokens,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "strip_special_tokens": args.strip_special_tokens,
        "early_max_step": args.early_max_step,
        "device": args.device,
    }  # flags given on the command line override the --config file; --set overrides both
    overrides = [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None] + args.overrides
    from qkgeom.families.config import load_pretrained

    pc = load_pretrained(args.config, overrides)
    if not (pc.all_revisions or pc.family):  # one model folder, or one a revision: refused before the imports
        for rev in pc.revisions or [None]:
            resolve_revision(pc.model, rev)
    slug = pc.model.strip("/").replace("/", "__")
    out = Path(args.out) if args.out else Path(args.runs) / "pretrained" / slug
    if args.dry_run:
        return _list_revisions(pc, out)
    from transformers.utils import logging as hf_logging

    from qkgeom.analysis.families import family_tables
    from qkgeom.families.revisions import run_pretrained
    from qkgeom.report.family import write_family_report

    # the command's stderr is its own bars and one-line errors: transformers' notes on the user's config
    # (read outside probing.hf.hf_quiet) would otherwise stand above a refusal's single line
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    folders = run_pretrained(pc, out, args.executor, args.address, progress=not args.no_progress)
    family_tables(out, pc.early_max_step)  # judged and written, then drawn
    report = write_family_report(out)
    print(f"{len(folders)} revision(s) of {pc.model} -> {out}\nreport: {report}")
    return 0


def _list_revisions(pc, out: Path) -> int:
    """`qkgeom pretrained ... --dry-run`: the revisions the command would measure, and which are done."""
    from qkgeom.config import safe_name
    from qkgeom.families.revisions import family_revisions
    from qkgeom.results import RunDir

    revisions = family_revisions(pc)
    done = [RunDir(out / safe_name(rev or "main")).is_done() for rev in revisions]
    for rev, ok in zip(revisions, done, strict=True):
        print(f"{'done   ' if ok else 'to do  '}{rev or 'main'}")
    print(f"{len(revisions)} revision(s) of {pc.model} ({sum(done)} done) -> {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`qkgeom export`: a run's kept checkpoints as Hugging Face GPT-2 folders."""
    from qkgeom.families.export import export_run

    folders = export_run(args.run, args.out)
    print(f"exported {len(folders)} checkpoints as GPT-2 folders: " + ", ".join(f.name for f in folders))
    print(f"analyse them with: qkgeom pretrained {args.out} --all-revisions")
    return 0
