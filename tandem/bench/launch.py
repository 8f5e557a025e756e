"""Start `python -m tandem.server` as a child process and read what it reports.

For benchmarks that own their server (`tandem bench soak`): a free port, a log file, a wait
for /health, and SIGINT on the way out (the server's clean stop). Also the readers a caller
needs afterwards: the engine's pid, /metrics as numbers, the settled state (nothing running,
waiting or holding KV), a process's resident memory.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    engine_pid: int
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_servers(*specs: tuple[str | Path, Path, list[str]], device: str = "auto",
                    env: dict[str, str] | None = None, start_timeout: float = 300.0) -> Iterator[list[ServerProcess]]:
    """Servers on 127.0.0.1, one per (model, log file, extra options), started together (they
    load at the same time) and stopped with SIGINT (SIGKILL after 30 s). A server that finds
    its port taken (another launcher picked the same free port) starts again on a new one."""
    started: list[tuple[subprocess.Popen, str]] = []
    try:
        started = [_start(model, log, extra, device, env) for model, log, extra in specs]
        servers = []
        for i, (model, log, extra) in enumerate(specs):
            for attempt in range(PORT_ATTEMPTS):
                proc, url = started[i]
                try:
                    servers.append(ServerProcess(url, proc, _wait_healthy(url, proc, log, start_timeout), log))
                    break
                except PortTaken:
                    if attempt == PORT_ATTEMPTS - 1:
                        raise
                    started[i] = _start(model, log, extra, device, env)
        yield servers
    finally:
        for proc, _ in started:
            proc.send_signal(signal.SIGINT)
        for proc, _ in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server exited because another process listens on the port it was given."""


def _start(model: str | Path, log: Path, extra: list[str], device: str,
           env: dict[str, str] | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.server", "--model", str(model), "--port", str(port),
           "--device", device, *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (the server's clean stop), then SIGKILL after 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> int:
    """The engine's pid, once `proc` itself answers 200 on /health: free_port gives the port up
    before the server listens, so another launcher's server may answer there first (PortTaken
    once `proc` exits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            text = log.read_text(errors="replace")
            error = PortTaken if re.search("address already in use", text, re.I) else RuntimeError
            raise error(f"server exited early ({proc.returncode}):\n{text[-3000:]}")
        try:
            r = httpx.get(url + "/health", timeout=1)
            body = r.json() if r.status_code == 200 else None
            if isinstance(body, dict) and body.get("server_pid") == proc.pid:
                return int(body["engine_pid"])
        except (httpx.HTTPError, ValueError):  # ValueError: another service's answer, not JSON
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) ([-+.eE0-9a-z]+)$", text, re.M)}


def histogram_quantiles(before: dict[str, float], after: dict[str, float], name: str,
                        qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """Mean and quantiles (ms, linear inside a bucket) of what a Prometheus histogram `name` (in
    seconds) observed between two `metrics` reads; None where nothing was observed."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    out: dict[str, float | None] = {"mean": None, **{f"p{round(q * 100)}": None for q in qs}}
    if count <= 0:
        return out
    out["mean"] = (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count * 1e3
    bounds = sorted((float(m[1]), after[k] - before.get(k, 0.0)) for k in after
                    if (m := re.fullmatch(re.escape(name) + r'_bucket\{le="([^"]+)"\}', k)) and m[1] != "+Inf")
    for q in qs:
        lo, below = 0.0, 0.0
        for le, cumulative in bounds:
            if cumulative >= q * count:
                share = (q * count - below) / (cumulative - below) if cumulative > below else 1.0
                out[f"p{round(q * 100)}"] = (lo + share * (le - lo)) * 1e3
                break
            lo, below = le, cumulative
    return out


def settled(url: str, kv_usage: float = 0.0, timeout: float = 30.0) -> tuple[bool, dict[str, float]]:
    """(reached, metrics): wait until nothing runs or waits and KV usage is `kv_usage` (the
    engine reports after its last step, so this polls)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["tandem_requests_running"], m["tandem_requests_waiting"], m["tandem_kv_cache_usage"]) == (0, 0, kv_usage):
            return True, m
        if time.monotonic() > deadline:
            return False, m
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time a live process has used (all its threads), None once it is gone
    or without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_end_cpu(cpu1: float | None, cpu0: float | None, wall_s: float, tokens: int) -> dict:
    """A server's front-end process (HTTP, SSE; the engine runs in its child) over a run, from
    two `cpu_seconds` reads: CPU microseconds per streamed token, and its share of one core
    (near 1: it is saturated, and its queue adds to TTFT and bunches tokens)."""
    if cpu0 is None or cpu1 is None or tokens <= 0:
        return {"front_end_cpu_us_per_token": None, "front_end_cpu_share": None}
    return {"front_end_cpu_us_per_token": (cpu1 - cpu0) / tokens * 1e6, "front_end_cpu_share": (cpu1 - cpu0) / wall_s}


def rss_mib(pid: int) -> float | None:
    """Resident memory of a live process (VmRSS), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None
