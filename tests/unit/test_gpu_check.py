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


def test_its_steps_run_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    figures = run(
        "--device", "cpu", "--gib", "0.02", "--swap-seconds", "2", "--batch-seconds", "0.3",
        "--tmp", str(tmp_path),
    )  # fmt: skip
    assert figures["device"] == "cpu" and figures["weights_gib"] > 0.01
    assert figures["swap_installed"] is True
    assert figures["failed_before"] == 0 and figures["failed_during"] == 0
    assert figures["requests_during"] > 0
    assert figures["double_buffer_refused"] == "budget"
    assert figures["serving_after_refusal"] == "gpu-b"  # the refused load cost nothing
    assert figures["cold_load_s"] > 0 and figures["warm_load_s"] > 0
    for model in ("batching_large", "batching_default"):
        batching = figures[model]
        assert batching["errors"] == 0
        assert set(batching["levels"]) == {"batched", "unbatched"}
        assert batching["unbatched_rps"] > 0 and batching["unbatched_p99_ms"] > 0
        # Batched levels at a p99 no worse than the unbatched best are the comparison's basis.
        assert batching["batched_p99_ms"] is None or (
            batching["batched_p99_ms"] <= batching["unbatched_p99_ms"]
        )


def test_swap_and_batching_can_be_left_out_to_measure_the_loads_alone(tmp_path: Path) -> None:
    figures = run(
        "--device", "cpu", "--gib", "0.02", "--swap-seconds", "0", "--batch-seconds", "0",
        "--tmp", str(tmp_path),
    )  # fmt: skip
    assert figures["cold_load_s"] > 0 and figures["warm_load_s"] > 0
    assert figures["cold_fetch_s"] > 0 and "warm_fetch_s" not in figures  # a hit fetches nothing
    assert "swap_s" not in figures and "batching_large" not in figures
