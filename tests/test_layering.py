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


def module_path(name: str) -> Path | None:
    """``mode.x.y`` -> its file (a package's ``__init__.py``), None if not ours."""
    rel = Path(*name.split(".")[1:])
    for path in (ROOT / rel).with_suffix(".py"), ROOT / rel / "__init__.py":
        if path.is_file():
            return path
    return None


def imported_by(name: str) -> set[Path]:
    """Every file of ``mode`` that module ``name`` imports, transitively."""
    seen: set[Path] = set()
    todo = [module_path(name)]
    while todo:
        path = todo.pop()
        for m in imports(path):
            dep = module_path(m)
            if dep is not None and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_nothing_below_config_imports_it():
    """Each layer's options live beside it (``RoutingConfig`` in ``layers/mod.py``, ...): no
    module that ``mode.config`` imports, directly or not, imports ``mode.config`` back."""
    below = imported_by("mode.config") - {ROOT / "config.py"}
    assert ROOT / "layers" / "mod.py" in below and ROOT / "experts" / "moe.py" in below
    offenders = [str(p.relative_to(ROOT)) for p in below if "mode.config" in imports(p)]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "where,forbidden",
    [
        # the primitives; parallel/apply.py composes layers, compile and FSDP on purpose
        (
            ("parallel/mesh.py", "parallel/all_to_all.py", "parallel/expert_parallel.py", "parallel/fsdp.py"),
            "mode.layers",
        ),
        (("kernels",), "mode."),
    ],
    ids=["parallel-imports-no-layers", "kernels-are-leaves"],
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


def test_the_parallel_package_names_one_thing_each():
    """``mode.parallel.parallelize`` is the expert-parallel function, also once the module that
    composes the parallel model (``mode.parallel.apply``) is imported: no module shadows it."""
    import mode.parallel
    import mode.parallel.apply  # noqa: F401
    from mode.parallel import parallelize
    from mode.parallel.expert_parallel import parallelize as expert_parallelize

    assert callable(parallelize) and parallelize is expert_parallelize is mode.parallel.parallelize


def test_routing_holds_decisions_only():
    """``mode.routing`` decides which tokens go where (pure functions, no parameters); moving
    tokens (autograd functions) and modules live beside their users, e.g. ``layers/mod_moves.py``."""
    movers = {}
    for path in modules("routing"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if bases & {"torch.autograd.Function", "Function", "nn.Module", "torch.nn.Module"}:
                    movers[f"{path.relative_to(ROOT)}:{node.name}"] = sorted(bases)
    assert not movers, movers
