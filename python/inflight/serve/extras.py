"""The optional dependencies of ``inflight serve`` and ``inflight bench serve``.

The commands' parsers import none of them, so ``inflight --help`` works without the extras; each
command checks for its own before it runs and names the extra to install.
"""

from __future__ import annotations

import importlib.util

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
BENCH_MODULES = ("httpx",)


def require_extra(modules: tuple[str, ...], extra: str) -> None:
    """ValueError (the commands report it and exit 2) when one of ``modules`` is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f'{", ".join(missing)} not installed: pip install "inflight-llm[{extra}]"')
