"""The import directions docs/architecture.md states: every module of quantwm/, kernels/ and app/ imports only
from its own layer or the layers below it."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MEASURES = ("trace", "lpips", "limits", "figures", "metrics", "memory", "analyze", "diagnostics", "runfile",
            "synthetic")


def layer(module: str) -> int:
    """docs/architecture.md's layers, lowest first."""
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else ""
    if sub == "kernels":
        return 0
    if sub == "core":
        return 1
    if sub == "evaluation" and len(parts) > 2 and parts[2] in MEASURES:
        return 2
    if sub == "world":
        return 3
    if (sub == "evaluation" and len(parts) > 2) or sub == "adapters":
        return 4
    if sub == "evaluation":  # the package's own __init__
        return 2
    return 5  # quantwm.cli, quantwm/__init__.py, quantwm.__main__, quantwm.app


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
    assert layer("quantwm.world.generate") < layer("quantwm.evaluation.workbench") < layer("quantwm.app.main")
    cli = ROOT / "quantwm" / "cli.py"
    assert "quantwm.app.main" in set(imported(cli, "quantwm.cli"))  # the scan finds imports inside functions
