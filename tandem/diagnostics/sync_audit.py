"""Sync audit: every host<->device synchronization in the engine loop, with file:line and count.

Under `torch.cuda.set_sync_debug_mode("warn")` torch issues a UserWarning ("called a
synchronizing CUDA operation") from each synchronizing call: `.item()`, `.tolist()`,
`bool(t)`, `.cpu()`, `nonzero`, boolean-mask indexing, `Stream.synchronize()`, ... The audit
installs a warnings hook for the duration of the loop, walks the live Python stack at each
warning and charges it to the innermost frame inside one of `roots` (the tandem package by
default, plus any extra files such as a test double), so the line reported is the line of
ours that made the sync, not a frame inside torch.

Coverage is torch's: syncs made through its own checks are seen; `Event.synchronize()`,
`torch.cuda.synchronize()` and syncs inside third-party extensions are not. The loop's one
sanctioned wait (`HostResult.wait`) switches the mode off around itself, so it never counts.

    with SyncAudit() as audit:
        while engine.has_unfinished():
            engine.step()
    print(audit.report().format())

`tandem sync-audit [workload options]` does this on a short workload and exits 1 if it found
any sync; without CUDA it says there is nothing to audit and exits 0.
"""
from __future__ import annotations

import argparse
import linecache
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

SYNC_MESSAGE = "called a synchronizing CUDA operation"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../tandem
_THIS_FILE = os.path.normcase(str(Path(__file__).resolve()))
_NO_CUDA = ("sync audit: no CUDA device here. torch's sync-debug mode only sees CUDA "
            "synchronizations, so there is nothing to audit on this machine.")


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    name: str


@dataclass
class SyncSite:
    filename: str
    lineno: int
    function: str
    count: int = 0
    stack: list[Frame] = field(default_factory=list)  # frames in roots at the first hit, outermost first

    @property
    def where(self) -> str:
        return f"{display_path(self.filename)}:{self.lineno}"

    @property
    def code(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()


@dataclass
class SyncReport:
    sites: list[SyncSite]
    cuda: bool = True

    @property
    def total(self) -> int:
        return sum(s.count for s in self.sites)

    def format(self) -> str:
        if not self.cuda:
            return _NO_CUDA
        if not self.sites:
            return "sync audit: 0 host syncs in the loop outside the sanctioned wait (HostResult.wait)."
        lines = [f"sync audit: {self.total} host sync{'s' if self.total != 1 else ''} at "
                 f"{len(self.sites)} site{'s' if len(self.sites) != 1 else ''} outside the sanctioned "
                 "wait (HostResult.wait):"]
        for s in self.sites:
            lines.append(f"  {s.count:6d}x  {s.where}  in {s.function}")
            if s.code:
                lines.append(f"           {s.code}")
            chain = " > ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in s.stack[:-1])
            if chain:
                lines.append(f"           via {chain}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"total": self.total, "sites": [{"where": s.where, "function": s.function,
                                                 "count": s.count, "code": s.code} for s in self.sites]}


def display_path(filename: str) -> str:
    """A path relative to the directory holding the tandem package, where it lies inside it."""
    try:
        return str(Path(filename).resolve().relative_to(PACKAGE_ROOT.parent))
    except ValueError:
        return filename


def _norm_roots(roots: Iterable[str | os.PathLike]) -> tuple[str, ...]:
    return tuple(os.path.normcase(str(Path(r).resolve())) for r in roots)


def in_roots(filename: str, roots: tuple[str, ...]) -> bool:
    """True if `filename` is one of `roots` or lies under one of them (normalized roots)."""
    name = os.path.normcase(os.path.abspath(filename))
    if name == _THIS_FILE:
        return False  # the audit's own hook is never the culprit
    return any(name == r or name.startswith(r + os.sep) for r in roots)


def locate(frames: Iterable[Frame], roots: tuple[str, ...]) -> tuple[Frame | None, list[Frame]]:
    """Given frames innermost first, the innermost one in `roots` (None if none is) and every
    frame in roots, outermost first (for context)."""
    ours = [f for f in frames if in_roots(f.filename, roots)]
    return (ours[0] if ours else None), ours[::-1]


def live_frames(skip: int = 0) -> list[Frame]:
    """The calling thread's Python stack, innermost first (cheaper than traceback.extract_stack)."""
    frame, out = sys._getframe(skip + 1), []
    while frame is not None:
        out.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


class SyncCollector:
    """Counts sync warnings by site. Feed it directly (`record`) or through `SyncAudit`."""

    def __init__(self, roots: Iterable[str | os.PathLike] = ()):
        self.roots = _norm_roots([PACKAGE_ROOT, *roots])
        self.sites: dict[tuple[str, int], SyncSite] = {}

    def record(self, frames: list[Frame], filename: str | None = None, lineno: int | None = None) -> SyncSite:
        """Charge one sync to the innermost frame in roots; failing that, to the warning's
        own location (`filename`:`lineno`), or the innermost frame."""
        site_frame, ours = locate(frames, self.roots)
        if site_frame is None:
            site_frame = Frame(filename, lineno, "?") if filename else frames[0]
        key = (site_frame.filename, site_frame.lineno)
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = SyncSite(site_frame.filename, site_frame.lineno, site_frame.name,
                                              stack=ours[-6:])
        site.count += 1
        return site

    def report(self, cuda: bool = True) -> SyncReport:
        return SyncReport(sorted(self.sites.values(), key=lambda s: (-s.count, s.filename, s.lineno)),
                          cuda)


def is_sync_warning(message, category) -> bool:
    return issubclass(category, UserWarning) and "synchronizing CUDA operation" in str(message)


class SyncAudit:
    """Context manager: sync-debug mode "warn" (when CUDA is present) and a warnings hook that
    counts each sync warning by site; other warnings pass through unchanged.
    `force=True` installs the hook without CUDA (tests feed it synthetic warnings)."""

    def __init__(self, roots: Iterable[str | os.PathLike] = (), force: bool = False):
        self.collector = SyncCollector(roots)
        self.force = force
        self.cuda = False
        self._catch = None
        self._mode = 0

    def __enter__(self) -> "SyncAudit":
        import torch
        self.cuda = torch.cuda.is_available()
        if not (self.cuda or self.force):
            return self
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        # "always": every occurrence counts (the default filter shows each location once).
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation", category=UserWarning)
        passthrough = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            if is_sync_warning(message, category):
                self.collector.record(live_frames(1), filename, lineno)
            else:
                passthrough(message, category, filename, lineno, file, line)

        warnings.showwarning = hook
        if self.cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._catch is None:
            return
        if self.cuda:
            import torch
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)
        self._catch = None

    def report(self) -> SyncReport:
        return self.collector.report(cuda=self.cuda or self.force)


def audit_engine(engine, prompts: list[list[int]], params, roots: Iterable = ()) -> SyncReport:
    """Drive `prompts` through `engine` to the end under the audit (requests added and steps
    run inside it: in a server both happen in the loop)."""
    from tandem.diagnostics.workload import drive
    with SyncAudit(roots) as audit:
        drive(engine, prompts, params)
    return audit.report()


def sync_audit_main(argv: list[str] | None = None) -> int:
    from tandem.diagnostics import workload
    ap = argparse.ArgumentParser(prog="tandem sync-audit",
                                 description="Run a short workload under torch's sync-debug mode and "
                                             "report every host sync in the loop (file:line, count). "
                                             "Exits 1 if there is any.")
    workload.add_workload_args(ap)
    ap.add_argument("--json", metavar="PATH", help="also write the report here")
    args = ap.parse_args(argv)
    import torch
    if args.device == "cpu" or not torch.cuda.is_available():
        print(_NO_CUDA)
        return 0
    engine = workload.build_engine(args)
    prompts, params = workload.make_workload(args, engine)
    workload.warm_up(engine, args)  # compile kernels and fill the allocator cache first
    report = audit_engine(engine, prompts, params)
    print(report.format())
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1))
    return 1 if report.sites else 0


if __name__ == "__main__":
    raise SystemExit(sync_audit_main())
