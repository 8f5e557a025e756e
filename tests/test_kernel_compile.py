"""Every Triton kernel compiles for the H200 (sm_90), checked on the CPU: the interpreter the
other kernel tests use runs a kernel's Python, so a kernel can pass them and still fail to
compile on the device (found there only with device time). `kernel_compile.py` does the work
in a child process with the interpreter off."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _nvidia_backend() -> bool:
    # Located, not imported: importing Triton here, before tandem.kernels chooses the
    # interpreter, would fix Triton's choice for the other tests of this process.
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin"
                                 / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend (and its ptxas) is not installed")
def test_every_triton_kernel_compiles_for_sm90():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    done = subprocess.run([sys.executable, str(here / "kernel_compile.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.count("ok ") >= 18, done.stdout
    assert done.stdout.count(" pdl") >= 14, done.stdout  # the decode path's kernels, order checked
