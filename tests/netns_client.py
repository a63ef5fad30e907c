"""The gateway "host" of tests/test_netns.py: ``python -m tests.netns_client URL PIPELINE N``
sends N requests (0..N-1) through a gateway and prints one JSON line: answers and failures."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from gateway import Gateway


async def main(url: str, pipeline: str, n: int) -> dict[str, Any]:
    async with Gateway(url, pipeline) as gw:
        outcomes = await asyncio.gather(*(gw.predict(v, timeout_s=60.0) for v in range(n)), return_exceptions=True)
    return {"answers": [o if not isinstance(o, BaseException) else None for o in outcomes],
            "errors": [repr(o) for o in outcomes if isinstance(o, BaseException)]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))), flush=True)
