"""benchmarks/grpo_head_loss.py at its CPU size: rltk's rows are correct against float64, every row is there.

The benchmark runs as CI would run it (``--device cpu --tiny``, a subprocess). The peers (Cut
Cross-Entropy, Liger-Kernel) are optional bench dependencies: where one is missing its rows must say
"skipped" with the reason, and where it runs its gradients must agree with float64 too. rltk's torch
backend always runs here, so its rows are never allowed to be skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "grpo_head_loss.py"
sys.path.insert(0, str(SCRIPT.parent))
from grpo_head_loss import METHODS, TINY_SHAPES, TOLERANCES  # noqa: E402

from tests.waits import scaled


def test_the_tiny_cpu_run_has_every_row_and_rltk_matches_float64(tmp_path):
    out, table = tmp_path / "report.json", tmp_path / "table.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out),
                             "--table", str(table)], env=env, capture_output=True, text=True, timeout=scaled(600))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dtype"] == "float32" and report["memory_method"].endswith("MALLOC_MMAP_THRESHOLD_=1048576")
    assert [(s["B"], s["T"], s["H"], s["V"]) for s in report["shapes"]] == [tuple(s) for s in TINY_SHAPES]
    tol = TOLERANCES["float32"]
    for shape in report["shapes"]:
        assert list(shape["methods"]) == list(METHODS)
        rows = shape["methods"]
        # rltk's CPU backend and the plain-torch baselines run on every machine
        for method in ("rltk-torch", "naive", "naive-fp32"):
            r = rows[method]
            assert r["status"] == "ok", (method, r)
            assert r["finite"] and r["time_ms"] > 0 and r["tflops"] > 0
            assert r["errors"]["d_hidden"] <= tol and r["errors"]["d_weight"] <= tol, (method, r["errors"])
            assert r["errors"]["loss_abs"] <= 1e-5, (method, r["errors"])
        # Triton needs a GPU (or the interpreter, which this run turned off): said, not silently dropped
        for method in ("rltk-triton", "rltk-triton-hopper", "rltk-triton-hopper-det"):
            assert rows[method]["status"] == "skipped" and "CUDA" in rows[method]["reason"], method
        for method in ("verl", "cce", "cce-exact", "cce-torch_compile", "liger-grpo", "liger-flce"):
            r = rows[method]
            assert r["status"] in ("ok", "skipped"), (method, r)  # an error is a failure of this script's call
            if r["status"] == "skipped":
                assert r["reason"], method
            else:
                # the peers compute the same loss: same float64 agreement (no filtering on CPU paths)
                assert r["errors"]["d_hidden"] <= tol and r["errors"]["d_weight"] <= tol, (method, r["errors"])
    text = table.read_text()
    for method in METHODS:
        assert text.count(f"| {method} |") == len(TINY_SHAPES), method
    # issue 59's layout: a row per shape, the old and the new kernels side by side with the peers
    header = text[text.index("| N x H x V |"):].splitlines()
    assert "rltk `impl=triton`" in header[0] and "rltk `impl=triton-hopper`" in header[0] and "verl" in header[0]
    for (b, t, h, v), row in zip(TINY_SHAPES, header[2:]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == f"{b * t} x {h} x {v}" and cells[2:5] == ["skipped"] * 3, row
        assert " ms (~" in cells[1] and " GB, dh err " in cells[1], row  # naive runs everywhere
