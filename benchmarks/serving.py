"""Serving benchmark: a load generator against any OpenAI-compatible URL (TTFT, TPOT, inter-token
latency, throughput; JSON + a PNG of latency against request rate).

The implementation ships in the package (``inflight.serve.bench``, also ``inflight bench serve``):

    python benchmarks/serving.py --url http://127.0.0.1:8000 --request-rates 2 4 8 --out r.json --plot p.png
"""

from __future__ import annotations

import sys

from inflight.serve.bench import main

if __name__ == "__main__":
    sys.exit(main())
