"""The package's import graph: wings in one direction, and an order inside each wing.

qkgeom is a ground floor (errors, config, results, provenance, executor) and five wings above it, each a
sub-package: probing -> training -> analysis -> families -> report, then integrations, then the
command line and the package's public face. A module may import only modules placed before it in
ORDER: no circle, no arrow running back up, none into a later wing. Every qkgeom import counts, at
module level or inside a function. The README's "code in five minutes" lists the modules in this order.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "qkgeom"
README = PACKAGE.parent / "README.md"
ORDER = [
    # ground: what every wing may use
    ["errors"],
    ["device", "solves", "arms", "settings", "metrics"],
    ["config"],
    ["results", "provenance", "executor"],
    # probing: q, k, pattern -> rows
    ["probing", "probing.geometry", "probing.hooks", "probing.archs", "probing.inputs"],
    ["probing.alpha", "probing.rows", "probing.logits"],
    ["probing.weights"],
    ["probing.probe"],
    ["probing.hf", "probing.scalars"],
    ["probing.tracking"],
    # training: our GPT, steered
    ["training", "training.model", "training.data", "training.maps", "training.grid"],
    ["training.precision"],
    ["training.interventions"],
    ["training.complement"],
    ["training.loop"],
    ["training.sweep"],
    # analysis: runs -> verdicts
    ["analysis", "analysis.stats", "analysis.prereg"],
    ["analysis.runs", "analysis.rows"],
    ["analysis.context", "analysis.claims", "analysis.spectral", "analysis.arms"],
    ["analysis.records", "analysis.primary", "analysis.families"],
    ["analysis.robustness"],
    ["analysis.layers"],
    ["analysis.ladder", "analysis.shown", "analysis.dose"],
    ["analysis.causal"],
    ["analysis.matched"],
    ["analysis.study"],
    ["analysis.verdict_index"],
    # families: checkpoint families
    ["families", "families.config", "families.export"],
    ["families.revisions"],
    ["families.study"],
    # report: figures and HTML (draw only)
    ["report", "report.plots", "report.layout"],
    ["report.family_plots"],
    ["report.study"],
    ["report.family"],
    # integrations: callbacks over probing.tracking (the core never imports them)
    ["integrations", "integrations.trackers"],
    ["integrations.transformers", "integrations.lightning"],
    ["studies"],
    ["commands"],
    ["cli", "__init__"],
]


def module_name(path: Path) -> str:
    if not path.is_relative_to(PACKAGE):
        return path.stem
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every qkgeom module `path` imports, as dotted names below qkgeom (`from qkgeom.analysis import
    stats` counts as analysis.stats; a bare `import qkgeom` as __init__)."""
    known = {module_name(p) for p in PACKAGE.rglob("*.py")}
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qkgeom":
            base = node.module.removeprefix("qkgeom").lstrip(".")
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                deps.add(sub if sub in known else base or "__init__")
        elif isinstance(node, ast.Import):
            deps |= {a.name.removeprefix("qkgeom.") for a in node.names if a.name.startswith("qkgeom.")}
            deps |= {"__init__" for a in node.names if a.name == "qkgeom"}  # a bare `import qkgeom`
    return deps - {module_name(path)}


def test_every_module_has_a_place():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    placed = {m for layer in ORDER for m in layer}
    assert modules <= placed, f"unplaced: {sorted(modules - placed)}"
    assert len(placed) == sum(map(len, ORDER)), "a module placed twice"


def test_imports_only_point_down():
    level = {m: i for i, layer in enumerate(ORDER) for m in layer}
    upward = [
        f"{module_name(p)} (level {level[module_name(p)]}) imports {d} (level {level.get(d)})"
        for p in sorted(PACKAGE.rglob("*.py"))
        for d in sorted(imports_of(p))
        if level.get(d, 10**6) >= level[module_name(p)]
    ]
    assert not upward, "\n".join(upward)


def private_reaches(path: Path) -> list[str]:
    """Where `path` uses another qkgeom module's private name: `from qkgeom.x import _f`, or `m._f` (at
    any depth of an attribute chain) on a name bound by importing from qkgeom."""
    tree = ast.parse(path.read_text())
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qkgeom":
            for a in node.names:
                bound.add(a.asname or a.name)
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "qkgeom"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """A name one module needs from another is public there, with a docstring (DESIGN.md: no private
    library names reached into)."""
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in private_reaches(p)]
    assert not found, "\n".join(found)


def test_the_private_name_check_finds_both_forms(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("from qkgeom.config import _build\nfrom qkgeom import results as R\nR._x.y\nR.path.__name__\n")
    assert private_reaches(mod) == ["m.py:1 from qkgeom.config import _build", "m.py:3 R._x"]


def test_a_bare_import_of_the_package_counts(tmp_path):
    mod = tmp_path / "results.py"
    mod.write_text("def f():\n    import qkgeom\n    return qkgeom.__version__\n")
    assert imports_of(mod) == {"__init__"}


def test_the_readme_tree_names_every_module_in_order():
    """The README's tree lists each wing's folder and every module in it, in ORDER."""
    text = README.read_text()
    tree = text[text.index("## The code in five minutes") :]
    tree = tree[: tree.index("\n## ", 5)]
    listed, wing = [], None
    for line in tree.splitlines():
        if m := re.match(r"^qkgeom/(?:([a-z_]+)/)?\s", line):
            wing = m.group(1) or ""
        elif line and not line.startswith(" "):
            wing = None  # configs/, tests/, ...: not the package
        elif wing is not None and (m := re.match(r"^\s{2,}([a-z_]+)\.py\s", line)):
            listed.append(f"{wing}.{m.group(1)}" if wing else m.group(1))
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")} - {"probing", "training", "analysis", "families",
                                                                  "report", "integrations"}  # fmt: skip
    want = [m for layer in ORDER for m in layer if m in modules]
    assert sorted(listed) == sorted(want), f"README tree vs package: {set(want) ^ set(listed)}"
    position = {m: i for i, m in enumerate(want)}
    level = {m: i for i, layer in enumerate(ORDER) for m in layer}
    assert [level[m] for m in listed] == sorted(level[m] for m in listed), "the README tree lists modules out of order"
    assert len(position) == len(listed)


def test_the_report_draws_and_judges_nothing():
    """Measure < judge < draw: no report module imports a statistics library or the analysis' statistics
    (intervals arrive as columns of the tables the analysis wrote), and `qkgeom analyze` / `qkgeom
    verdicts` reach no report code (analysis.study, analysis.verdict_index, families.study)."""
    for p in sorted((PACKAGE / "report").glob("*.py")):
        tree = ast.parse(p.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(n.split(".")[0] == "scipy" for n in names), f"{p.name} imports scipy"
        assert "analysis.stats" not in imports_of(p), f"{p.name} computes statistics"
    for m in ("analysis.study", "analysis.verdict_index", "families.study"):
        path = PACKAGE / (m.replace(".", "/") + ".py")
        assert not any(d.startswith("report") for d in imports_of(path)), m


# What a report module may import beyond the report wing and the ground floor (results, errors, config):
# the analysis' result and the names of what it wrote, and readers that compute nothing.
REPORT_MAY_IMPORT = {
    "analysis.study": "Analysis (the result the report draws) and the names of the tables analyze wrote",
    "analysis.rows": "PARAMETRIC_ONLY, a label",
    "analysis.context": "context_sentence: the context facts in words",
    "analysis.shown": "run_folder: where a run's folder is",
    "analysis.families": "load_family: a family's measured rows, read",
    "families.study": "family_geometry (rows, read), the family claims' names and ids",
    "probing.archs": "one_site: picks a site's rows",
}
WRITERS = ("write_table", "to_csv", "to_parquet", "write_json")


def test_the_report_reads_an_allow_list_and_writes_no_table():
    """The report only draws: each report module imports only REPORT_MAY_IMPORT beyond the report wing
    and the ground floor, and calls no table writer (it writes figures and pages, nothing analyze reads).
    Before issue 55 the ladder page and the family report judged and wrote their tables themselves."""
    ground = {"results", "errors", "config", "device", "metrics"}
    for p in sorted((PACKAGE / "report").glob("*.py")):
        extra = {m for m in imports_of(p) if not m.startswith("report") and m not in ground}
        assert extra <= set(REPORT_MAY_IMPORT), f"{p.name} imports {sorted(extra - set(REPORT_MAY_IMPORT))}"
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)}  # fmt: skip
        assert not calls & set(WRITERS), f"{p.name} writes a table: {sorted(calls & set(WRITERS))}"


# Modules over the cap when it was set (issue 45), to be split along their seams, each frozen at its size
# (issue 55: the list named modules, not sizes, and they grew): a listed module may shrink, never grow,
# and leaves the list once under the cap. Left: training.interventions (2026-12-04: maps, complement);
# on 2026-12-05 probing.geometry (alpha fits -> probing.alpha), analysis.claims (row builders ->
# analysis.rows), analysis.causal (arm vocabulary -> analysis.arms), cli (presets and sittings ->
# qkgeom.studies), report.plots (family and ladder figures -> report.family_plots), probing.probe
# (weight side -> probing.weights), training.loop (bf16 kernel choice -> training.precision), config
# (the config types -> qkgeom.settings). The list is empty: no module may pass the cap.
OVER_CAP: dict[str, int] = {}
CAP = 500


def test_no_module_grows_past_the_cap():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {m for m, n in sizes.items() if n > CAP}
    assert over <= set(OVER_CAP), f"over {CAP} lines: {sorted(over - set(OVER_CAP))}"
    assert not set(OVER_CAP) - over, f"now under the cap, drop from OVER_CAP: {sorted(set(OVER_CAP) - over)}"
    grown = {m: (sizes[m], n) for m, n in OVER_CAP.items() if sizes[m] > n}
    assert not grown, f"frozen modules grew (now, frozen at): {grown}"
