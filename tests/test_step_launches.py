"""The compiled step's launch proxy (``benchmarks/launch_proxy.py``, ``step_launches.py``): the
counter on code whose launches are known, then one compiled training step of every preset
beside nanoGPT's, against the GPU-step issue's targets. Each runs in its own process: the
proxy switches ``torch.compile`` to the Triton interpreter for the whole process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # torch.compile under the Triton interpreter, in a subprocess

KNOWN = """
from benchmarks.launch_proxy import LaunchCounter, interpret
interpret()
import json, torch
pointwise = torch.compile(lambda x: torch.relu(x) * 2 + 1, fullgraph=True)  # one fused kernel
matmul = torch.compile(lambda x, w: torch.relu(x @ w), fullgraph=True)  # mm (extern) + relu
x, w = torch.randn(8, 16), torch.randn(16, 4)
pointwise(x), matmul(x, w)  # compile outside the count
with LaunchCounter() as c:
    pointwise(x)
    matmul(x, w)
    x.add(1)  # eager: one op
    x.view(2, 64).t().unsqueeze(0)  # views: none
    x.contiguous()  # already contiguous: none
    x.t().contiguous()  # a copy: one
    torch._foreach_add_([x.clone(), w.clone()], 1.0)  # two clones, one multi-tensor op
print(json.dumps({"triton": c.triton, "extern": c.extern, "eager": c.eager}))
"""


def run_python(code: str, *args: str, timeout: int = 900) -> str:
    out = subprocess.run(
        [sys.executable, *(["-c", code] if code else []), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_the_counter_counts_known_launches():
    counts = json.loads(run_python(KNOWN).strip().splitlines()[-1])
    assert counts == {"triton": 2, "extern": 1, "eager": 1 + 1 + 2 + 1}, counts


# Targets the compiled step misses (2026-12-05, measured by the benchmark; see
# benchmarks/RESULTS.md "Compiled launches"): a routed block's router, top-k, gather, scatter
# and gate kernels (MoE: sort, permutation, grouped GEMMs) on top of the dense block's.
# Checked both ways: the day one holds, it must leave this set.
MISSED = {"mod/dense", "mod_random/dense", "moe/dense", "mode_staged/dense", "mode_integrated/dense"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    path = tmp_path_factory.mktemp("launches") / "launches.json"
    # d 64 and 16 tokens: the interpreter's time falls with the shape, the launch counts do not
    # (the benchmark's default shape gives the same verdicts, benchmarks/RESULTS.md).
    shape = ["--d-model", "64", "--seq", "16"]
    run_python("", "-m", "benchmarks.step_launches", *shape, "--json", str(path), timeout=1500)
    return json.loads(path.read_text())


def test_a_compiled_step_launches_little_outside_compiled_code(launches):
    rows = {r["preset"]: r for r in launches["rows"]}
    assert set(rows) == {"nanogpt", "dense", "mod", "mod_random", "moe", "mode_staged", "mode_integrated"}
    for preset, row in rows.items():
        assert row["triton"] > 0, f"{preset}: no Triton kernel counted"
        assert row["eager"] <= row["eager_bound"], f"{preset}: {row['eager']} launches outside compiled code"


def test_compiled_launch_ratios_against_the_targets(launches):
    for r in launches["ratios"]:
        if r["ratio"] in MISSED:
            assert not r["meets"], f"{r['ratio']} = {r['value']:.3f} <= {r['bound']} now: take it out of MISSED"
        else:
            assert r["meets"], f"{r['ratio']} = {r['value']:.3f} > {r['bound']}"
