"""Fails on a source file over MAX_LINES lines that docs/architecture.md does not name as one cohesive
unit (its section "Files over 600 lines", one backticked path per entry, with the reason)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

MAX_LINES = 600
SUFFIXES = (".py", ".h", ".cpp", ".cu", ".cuh", ".sh")


def allowed(doc: Path) -> set[str]:
    if not doc.is_file():
        return set()
    text = doc.read_text(encoding="utf-8")
    match = re.search(r"^#+ Files over 600 lines\s*$(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    return set(re.findall(r"`([^`\s]+\.\w+)`", match.group(1))) if match else set()


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    ok = allowed(root / "docs" / "architecture.md")
    files = subprocess.run(
        ["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split()
    over = []
    for name in files:
        if name.endswith(SUFFIXES) and not name.startswith("third_party/"):
            with open(root / name, encoding="utf-8", errors="replace") as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES and name not in ok:
                over.append(
                    f"{name}: {n} lines (over {MAX_LINES}; split it, or name it in docs/architecture.md)"
                )
    stale = sorted(p for p in ok if p not in files)
    for line in over + [f"docs/architecture.md names {p}, which does not exist" for p in stale]:
        print(line)
    print(f"check_sizes: {len(over) + len(stale)} problem(s)")
    return 1 if over or stale else 0


if __name__ == "__main__":
    sys.exit(main())
