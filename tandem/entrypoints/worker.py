"""A tensor-parallel worker process that rank 0 (or `tandem serve --node-rank N`) started with
`start_worker`: `python -m tandem.entrypoints.worker SPEC`. Its own module, imported by nothing,
so that `-m` runs it once (`tandem.entrypoints.ranks` is imported with the package)."""
import ctypes
import os
import signal
import sys

import msgspec

from tandem.config import resolve_device
from tandem.distributed.auth import SECRET_ENV
from tandem.distributed.worker import Spec, WorkerRuntime
from tandem.entrypoints.ranks import serve_rank


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(argv[0], type=Spec)
    secret = os.environ.pop(SECRET_ENV, "")  # not inherited by anything this process starts
    _die_with_parent()
    cfg = spec.config
    runtime = WorkerRuntime(spec.info, cfg.launch.dist_timeout_s, resolve_device(cfg.device), secret)
    return serve_rank(cfg, runtime)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (no orphans whatever kills rank 0)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
