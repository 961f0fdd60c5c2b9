"""What every benchmark table's header says: the CPU (inflight.ops.describe_cpu), the threads, the commit."""

from __future__ import annotations

import re
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


def cpu_tag(model_name: str) -> str:
    """The file-name tag of a CPU: its family (epyc, xeon, ...), else its name's first word."""
    low = model_name.lower()
    for family in ("epyc", "xeon", "ryzen", "graviton", "neoverse"):
        if family in low:
            return family
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-").split("-")[0] or "unknown"
