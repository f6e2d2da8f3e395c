"""bench/gpu_check.py, the one command run on a lent GPU: it must not rot between the rare
sessions that have one. Here it runs its steps on the CPU with a small artifact (and, with
no CUDA, says so and exits 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def run(*argv: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_cuda_it_says_so_and_exits_0() -> None:
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine runs the real thing
        return
    assert run() == {"cuda": False}


# Each step can be left out (0 seconds); the two runs below take one of the two long steps
# each, so every step runs once and each is also seen left out.


def test_the_loads_and_the_swap_run_on_the_cpu_with_batching_left_out(tmp_path: Path) -> None:
    figures = run(
        "--device", "cpu", "--gib", "0.02", "--swap-seconds", "2", "--batch-seconds", "0",
        "--tmp", str(tmp_path),
    )  # fmt: skip
    assert figures["device"] == "cpu" and figures["weights_gib"] > 0.01
    assert figures["cold_load_s"] > 0 and figures["warm_load_s"] > 0
    assert figures["cold_fetch_s"] > 0 and "warm_fetch_s" not in figures  # a hit fetches nothing
    assert figures["swap_installed"] is True
    assert figures["failed_before"] == 0 and figures["failed_during"] == 0
    assert figures["requests_during"] > 0
    assert figures["double_buffer_refused"] == "budget"
    assert figures["serving_after_refusal"] == "gpu-b"  # the refused load cost nothing
    assert "batching_large" not in figures and "batching_default" not in figures


def test_batching_runs_on_the_cpu_with_the_swap_left_out(tmp_path: Path) -> None:
    figures = run(
        "--device", "cpu", "--gib", "0.02", "--swap-seconds", "0", "--batch-seconds", "0.3",
        "--tmp", str(tmp_path),
    )  # fmt: skip
    assert figures["cold_load_s"] > 0 and figures["warm_load_s"] > 0
    assert "swap_s" not in figures and "swap_installed" not in figures
    for model in ("batching_large", "batching_default"):
        batching = figures[model]
        assert batching["errors"] == 0
        assert set(batching["levels"]) == {"batched", "unbatched"}
        assert batching["unbatched_rps"] > 0 and batching["unbatched_p99_ms"] > 0
        # Batched levels at a p99 no worse than the unbatched best are the comparison's basis.
        assert batching["batched_p99_ms"] is None or (
            batching["batched_p99_ms"] <= batching["unbatched_p99_ms"]
        )
