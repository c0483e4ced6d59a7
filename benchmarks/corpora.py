"""A second public corpus for the comparisons: the Python standard library's own source.

    python -m benchmarks.corpora --out data/python-stdlib.txt        # ~5 MB of Python code

Shakespeare (the embedded corpus) is verse and drama; this is code: a text of a different kind
that ships with every Python installation, so a result that holds on both is not a property of
one corpus. The files are the ``.py`` files under the interpreter's ``stdlib`` directory in
sorted path order, without ``test``/``tests``/``idlelib``/``site-packages`` trees, each preceded
by a ``# file: <relative path>`` line, cut at ``--bytes``. The corpus depends on the Python
version; ``--out`` is written with a JSON sidecar (``<out>.json``) naming the version, the file
count and the SHA-256 of the bytes, and the comparison JSON names the corpus path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3"})


def stdlib_files(root: Path) -> list[Path]:
    """The stdlib's ``.py`` files under ``root`` in sorted relative-path order, skipped trees left out."""
    files = [p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(n_bytes: int, root: Path | None = None) -> tuple[bytes, int]:
    """The first ``n_bytes`` of the concatenated stdlib sources and how many files they draw on."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    parts, size, used = [], 0, 0
    for path in stdlib_files(root):
        chunk = f"# file: {path.relative_to(root).as_posix()}\n".encode() + path.read_bytes() + b"\n"
        parts.append(chunk)
        size, used = size + len(chunk), used + 1
        if size >= n_bytes:
            break
    if size < n_bytes:
        raise SystemExit(f"the stdlib under {root} has only {size} bytes of source; ask for fewer --bytes")
    return b"".join(parts)[:n_bytes], used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("data/python-stdlib.txt"))
    p.add_argument("--bytes", type=int, default=5_000_000)
    args = p.parse_args()
    text, n_files = stdlib_corpus(args.bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(text)
    meta = {
        "corpus": "python-stdlib",
        "python": platform.python_version(),
        "files": n_files,
        "bytes": len(text),
        "sha256": hashlib.sha256(text).hexdigest(),
    }
    Path(f"{args.out}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out}: {len(text):,} bytes from {n_files} files, Python {meta['python']}")


if __name__ == "__main__":
    main()
