"""The package's layering, read from its import statements: each layer's options live beside
it, so nothing below ``mode.config`` imports it; ``mode.parallel`` asks modules through
protocols (``mode.routed``) instead of importing layers; the kernels import nothing of ``mode``."""

import ast
from pathlib import Path

import pytest

import mode

ROOT = Path(mode.__file__).parent


def imports(path: Path) -> set[str]:
    """The ``mode`` modules that ``path`` imports (at any depth, type-checking blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mode"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mode"))
    return out


def modules(*parts: str) -> list[Path]:
    return sorted(
        p for part in parts for p in ((ROOT / part).rglob("*.py") if (ROOT / part).is_dir() else [ROOT / part])
    )


@pytest.mark.parametrize(
    "where,forbidden",
    [
        (("layers", "experts", "routing", "kernels", "parallel", "checks.py", "routed.py"), "mode.config"),
        (("parallel",), "mode.layers"),
        (("kernels",), "mode."),
    ],
    ids=["nothing-below-config-imports-it", "parallel-imports-no-layers", "kernels-are-leaves"],
)
def test_layering(where, forbidden):
    offenders = {
        str(p.relative_to(ROOT)): sorted(
            m for m in imports(p) if m.startswith(forbidden) and not m.startswith("mode.kernels")
        )
        for p in modules(*where)
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, offenders
