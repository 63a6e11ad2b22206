"""The package's import graph: imports flow one way, with no circle and no arrow running back up.

Every qkgeom import counts, at module level or inside a function. Layer k may import only from
layers < k. The README's "code in five minutes" tree lists the modules in this order.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "qkgeom"
LAYERS = [
    {"errors"},  # the project's error class: everything may raise it
    {"config", "geometry", "stats", "archs", "hooks", "executor", "results"},
    {"pretrained_config"},  # maths, tables, plumbing, the disk
    {"data", "interventions", "model", "plots", "scalars"},
    {"probe"},
    {"pretrained", "train"},
    {"tracking"},
    {"runs", "context"},
    {"analysis"},
    {"sweep", "family", "causal", "export"},
    {"family_study"},
    {"report"},
    {"family_report"},
    {"cli", "__init__"},
]


def imports_of(path: Path) -> set[str]:
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qkgeom":
            parts = node.module.split(".")
            deps |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("qkgeom.")}
            deps |= {"__init__" for a in node.names if a.name == "qkgeom"}  # a bare `import qkgeom`
    return deps - {path.stem}


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    placed = set().union(*LAYERS)
    assert modules == placed, f"unplaced: {modules - placed}, missing: {placed - modules}"


def test_imports_only_point_down():
    level = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    upward = [
        f"{p.stem} (layer {level[p.stem]}) imports {d} (layer {level[d]})"
        for p in sorted(PACKAGE.glob("*.py"))
        for d in sorted(imports_of(p))
        if level[d] >= level[p.stem]
    ]
    assert not upward, "\n".join(upward)


def test_a_bare_import_of_the_package_counts(tmp_path):
    mod = tmp_path / "results.py"
    mod.write_text("def f():\n    import qkgeom\n    return qkgeom.__version__\n")
    assert imports_of(mod) == {"__init__"}
