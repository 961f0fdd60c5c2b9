"""What every benchmark table's header says: the CPU (inflight.ops.describe_cpu), the threads, the commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch


def cpu_header() -> str:
    from inflight.ops import describe_cpu

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads; inflight {commit}"
