"""Asynchronous CUDA errors: stop cleanly on the first sticky one; launch-blocking for debugging.

A kernel fails long after the Python call that launched it returned; the error surfaces at
the next host<->device interaction (in tandem, usually the sanctioned wait), so the Python
traceback points at where it was *noticed*, not where it happened. Some errors are sticky:
after an illegal address, a device-side assert, a misaligned access, ... the CUDA context is
unusable and every later CUDA call fails too. Only the first error says anything.

`FatalErrorGuard` is the engine's hook: `observe(exc)` in `Engine.step()`'s error path turns
a sticky error into `EngineDeadError` (logged once, with the first error's traceback), and
`check()` makes every later step fail fast with the same message, without touching CUDA.
"""
from __future__ import annotations

import logging
import os
import warnings

log = logging.getLogger("tandem")

# cudaError_t codes after which the context is unusable (CUDA runtime API docs).
STICKY_CODES = {
    214,  # cudaErrorECCUncorrectable
    700,  # cudaErrorIllegalAddress
    702,  # cudaErrorLaunchTimeout
    710,  # cudaErrorAssert
    714,  # cudaErrorHardwareStackError
    715,  # cudaErrorIllegalInstruction
    716,  # cudaErrorMisalignedAddress
    717,  # cudaErrorInvalidAddressSpace
    718,  # cudaErrorInvalidPc
    719,  # cudaErrorLaunchFailure
}
# Their messages, as torch / Triton / the driver print them (lowercase).
STICKY_MESSAGES = (
    "illegal memory access",
    "an illegal instruction was encountered",
    "misaligned address",
    "device-side assert triggered",
    "unspecified launch failure",
    "hardware stack error",
    "invalid program counter",
    "operation not supported on global/shared address space",
    "uncorrectable ecc error",
    "the launch timed out and was terminated",
    "cuda_error_illegal_address",
    "cuda_error_assert",
    "cuda_error_launch_failed",
)

LAUNCH_BLOCKING_WARNING = (
    "CUDA_LAUNCH_BLOCKING=1: every kernel launch now waits for the kernel to finish, so a CUDA "
    "error is raised at the launch that caused it. Overlap is gone: timings (step timeline, "
    "profile, benchmarks) are meaningless under it. Use it to find a failing kernel only.")


def is_sticky_cuda_error(exc: BaseException | None) -> bool:
    """True if `exc` (or an exception it was raised from) is a CUDA error that poisons the
    context. Allocator out-of-memory is not: it is recoverable."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EngineDeadError):
            return True
        if type(exc).__name__ != "OutOfMemoryError":
            code = getattr(exc, "error_code", None)  # torch.AcceleratorError (torch >= 2.8)
            if isinstance(code, int) and code in STICKY_CODES:
                return True
            text = str(exc).lower()
            if any(m in text for m in STICKY_MESSAGES):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_out_of_memory(exc: BaseException) -> bool:
    """Device (torch.OutOfMemoryError) or host memory ran out: the work that asked for it
    fails, the engine does not."""
    return type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError)


class EngineDeadError(RuntimeError):
    """The engine stopped after a sticky CUDA error; the process must be restarted."""

    def __init__(self, first_error: str, where: str | None = None):
        self.first_error, self.where = first_error, where
        super().__init__(f"engine stopped after a sticky CUDA error (the CUDA context is unusable; "
                         f"restart the process). First error: {first_error}")


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message` (torch appends paragraphs of advice)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class FatalErrorGuard:
    """Remembers the first sticky error; logs it once."""

    def __init__(self, logger: logging.Logger = log):
        self.log = logger
        self.error: EngineDeadError | None = None

    @property
    def dead(self) -> bool:
        return self.error is not None

    def check(self) -> None:
        """Raise (a fresh) EngineDeadError if the engine is dead: fail fast, touch nothing."""
        if self.error is not None:
            raise EngineDeadError(self.error.first_error, self.error.where) from None

    def observe(self, exc: BaseException) -> None:
        """Call from an `except` around a step. A sticky CUDA error: log it once (with its
        traceback) and raise EngineDeadError from None. Anything else: return, and let the
        caller re-raise it unchanged."""
        if isinstance(exc, EngineDeadError):
            self.error = self.error or exc
            raise EngineDeadError(exc.first_error, exc.where) from None
        if not is_sticky_cuda_error(exc):
            return
        if self.error is None:
            where = _where(exc)
            self.error = EngineDeadError(first_line(exc), where)
            self.log.error(
                "sticky CUDA error: %s\n  noticed at %s; a CUDA error surfaces at the next host sync, "
                "so the kernel that caused it ran earlier. Rerun with --launch-blocking to raise it at "
                "the failing launch. The CUDA context is unusable: the engine is stopped.",
                first_line(exc), where or "?", exc_info=exc)
        raise EngineDeadError(self.error.first_error, self.error.where) from None


def _where(exc: BaseException) -> str | None:
    import traceback
    tb = traceback.extract_tb(exc.__traceback__)
    return f"{tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name}" if tb else None


def launch_blocking_active() -> bool:
    return os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"


def enable_launch_blocking() -> bool:
    """Set CUDA_LAUNCH_BLOCKING=1 for this process and its children (the server's engine
    process inherits it) and warn (RuntimeWarning) that timings mean nothing under it.
    Returns False, with a second warning, if CUDA was already initialized in this process:
    then the setting cannot take effect here."""
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    warnings.warn(LAUNCH_BLOCKING_WARNING, RuntimeWarning, stacklevel=2)
    import torch
    if torch.cuda.is_initialized():
        warnings.warn("CUDA_LAUNCH_BLOCKING was set after CUDA was initialized in this process, so it "
                      "has no effect here; set it before the first CUDA call (or in the environment).",
                      RuntimeWarning, stacklevel=2)
        return False
    return True
