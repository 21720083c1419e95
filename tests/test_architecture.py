"""The import directions docs/architecture.md states: every module of quantwm/, kernels/ and app/ imports only
from its own layer or the layers below it; a module's layer is its folder's, and the doc's layer table names the
same folders at the same layers."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# docs/architecture.md's layers, lowest first, read from a module's folder (kernels/ and app/ install as
# quantwm.kernels and quantwm.app); every other module (quantwm/cli.py, quantwm/__init__.py, app/) is layer 5
FOLDERS = {"kernels": 0, "core": 1, "evaluation": 2, "world": 3, "drivers": 4, "adapters": 4}
TOP = 5


def layer(module: str) -> int:
    """The layer of a dotted quantwm module: its folder's, else the top."""
    parts = module.split(".")
    return FOLDERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] in ("kernels", "app"):  # installed as quantwm.kernels and quantwm.app
        parts = ["quantwm", *parts]
    return ".".join(parts)


def is_module(module: str) -> bool:
    """Whether a dotted quantwm name is one of the repository's modules or packages."""
    parts = module.split(".")[1:]
    base, rest = (ROOT / parts[0], parts[1:]) if parts and parts[0] in ("kernels", "app") else (ROOT / "quantwm", parts)
    path = base.joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(path: pathlib.Path, name: str):
    """The quantwm modules a file imports, inside functions too (`from package import module` counts as that
    module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            t = "quantwm." + t if t.split(".")[0] in ("kernels", "app") else t
            if (t == "quantwm" or t.startswith("quantwm.")) and is_module(t):
                yield t


def files():
    for top in ("quantwm", "kernels", "app"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_every_import_goes_to_the_same_layer_or_below():
    wrong = []
    for path in files():
        name = module_name(path)
        for target in imported(path, name):
            if layer(target) > layer(name):
                wrong.append(f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_kernels_import_nothing_of_quantwm_and_the_app_never_imports_kernels():
    for path in files():
        name = module_name(path)
        targets = set(imported(path, name))
        if name.startswith("quantwm.kernels"):
            assert all(t.startswith("quantwm.kernels") for t in targets), (name, targets)
        if name.startswith("quantwm.app"):
            assert not any(t.startswith("quantwm.kernels") for t in targets), (name, targets)


def test_the_layer_rule_sees_a_violation():
    assert layer("quantwm.core.cache") < layer("quantwm.evaluation.metrics") < layer("quantwm.world.generate")
    assert layer("quantwm.world.generate") < layer("quantwm.drivers.workbench") < layer("quantwm.app.main")
    assert layer("quantwm.core.methods.rtn") == layer("quantwm.core") == 1 and layer("quantwm.kernels.quant") == 0
    assert layer("quantwm.adapters.sana_wm") == layer("quantwm.drivers.views") and layer("quantwm.cli") == TOP
    cli = ROOT / "quantwm" / "cli.py"
    assert "quantwm.app.main" in set(imported(cli, "quantwm.cli"))  # the scan finds imports inside functions


def doc_layers() -> dict[str, int]:
    """{folder: layer} from docs/architecture.md's layer table: each row's layer and the folders (backticked
    paths ending in "/") its second column names."""
    out = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for path in re.findall(r"`([\w./]+)/`", cells[1]):
            out[path.rstrip("/").rsplit("/", 1)[-1]] = int(cells[0])
    return out


def test_the_architecture_doc_names_each_folder_at_its_layer():
    doc = doc_layers()
    folders = {p.name for p in (ROOT / "quantwm").iterdir() if (p / "__init__.py").is_file()} | {"kernels", "app"}
    assert folders == set(doc), f"folders {sorted(folders ^ set(doc))} are missing from the code or the doc's table"
    assert doc == {**FOLDERS, "app": TOP}, {f: (doc.get(f), layer(f"quantwm.{f}")) for f in folders}
