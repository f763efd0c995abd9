"""A cluster node that dies by SIGKILL right after it has applied one logged call.

Usage: python -m tests.cluster.node_child METHOD node --store ... (``engram-trio``'s flags)

The node runs as ``engram-trio node`` does, except that once the first LogCall naming METHOD
has been applied (its write committed), the process kills itself with SIGKILL before doing
anything else: the point where a call's write could land without its watermark.
"""

import os
import signal
import sys

from engine import _logbatch
from engine.__main__ import main


def die_after(method: str) -> None:
    real = _logbatch.PartitionLog._apply_call

    async def apply_call(self: _logbatch.PartitionLog, entry: _logbatch.LogCall, place: str):
        result = await real(self, entry, place)
        if entry.method == method:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    _logbatch.PartitionLog._apply_call = apply_call


if __name__ == "__main__":
    die_after(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
