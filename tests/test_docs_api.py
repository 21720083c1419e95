"""docs/api.md renders every public module of quantwm/ (a `::: module` line each), so a new module is documented."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def public_modules() -> set[str]:
    """Dotted names of quantwm/'s modules, leaving out `_`-prefixed ones (__init__, __main__, private helpers)."""
    names = set()
    for path in (ROOT / "quantwm").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if not any(part.startswith("_") for part in parts):
            names.add(".".join(parts))
    return names


def test_api_md_names_every_public_module():
    named = set(re.findall(r"^::: ([\w.]+)\s*$", (ROOT / "docs" / "api.md").read_text(), flags=re.M))
    modules = public_modules()
    assert len(modules) > 40  # the walk found the package
    missing = sorted(modules - named)
    assert not missing, f"docs/api.md leaves out {missing}: add a `::: module` line under its folder's heading"
