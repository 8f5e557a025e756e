"""The launcher's wait for its own server (tandem.bench.launch): free_port gives the port up
before the server listens, so another launcher's server can answer on it first (CI, run 68:
a test with --api-key got 200 from another test's server without a key)."""
import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tandem.bench import launch


@contextmanager
def health_server(server_pid: int):
    """An HTTP server on a free port whose /health answers 200 for process `server_pid`."""
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "server_pid": server_pid, "engine_pid": server_pid + 1}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def port_taken_server(log) -> subprocess.Popen:
    """A stand-in server that loads for a moment, then fails to listen as uvicorn does."""
    script = ("import time; time.sleep(1.0); "
              "print('ERROR: [Errno 98] error while attempting to bind on address: address already in use'); "
              "raise SystemExit(1)")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)


def test_another_server_on_the_port_is_not_taken_for_ours(tmp_path):
    log = tmp_path / "server.log"
    proc = port_taken_server(log)
    with health_server(server_pid=proc.pid + 100_000) as url:  # healthy, but not `proc`
        with pytest.raises(launch.PortTaken, match="address already in use"):
            launch._wait_healthy(url, proc, log, timeout=30)


def test_a_server_without_the_port_taken_fails_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('no weight files'); raise SystemExit(1)"],
                                stdout=out, stderr=subprocess.STDOUT)
    with pytest.raises(RuntimeError, match="no weight files") as failure:
        launch._wait_healthy("http://127.0.0.1:9", proc, log, timeout=30)
    assert not isinstance(failure.value, launch.PortTaken)


def test_running_servers_starts_again_on_a_new_port_when_its_port_was_taken(tmp_path, monkeypatch):
    """The first start finds another server on its port and exits; the second one comes up."""
    log = tmp_path / "server.log"
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    starts = []
    with health_server(server_pid=ours.pid + 100_000) as foreign_url, health_server(server_pid=ours.pid) as our_url:
        def start(model, log, extra, device, env):
            starts.append(model)
            return (port_taken_server(log), foreign_url) if len(starts) == 1 else (ours, our_url)

        monkeypatch.setattr(launch, "_start", start)
        with launch.running_servers(("m", log, []), start_timeout=30) as (srv,):
            assert (srv.url, srv.proc, srv.engine_pid) == (our_url, ours, ours.pid + 1)
    assert starts == ["m", "m"] and ours.poll() is not None  # stopped on the way out


def test_a_real_server_given_a_taken_port_starts_again_on_a_free_one(tiny_text_model, tmp_path, monkeypatch):
    """The fault as it happens: another server listens on the port the launcher picked. The
    real server fails to listen there ("address already in use"), and the launcher starts it
    again on a free port, where it answers as itself."""
    repo = Path(__file__).resolve().parents[1]
    with health_server(server_pid=-1) as foreign:
        taken = int(foreign.rsplit(":", 1)[1])
        picks, real_free_port = [], launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: picks.append(0) or (taken if len(picks) == 1 else real_free_port()))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        log = tmp_path / "server.log"
        with launch.running_servers((tiny_text_model, log, ["--max-model-len", "128", "--log-level", "warning"]),
                                    device="cpu", env=env, start_timeout=120) as (srv,):
            assert len(picks) == 2 and not srv.url.endswith(f":{taken}")
            assert httpx.get(srv.url + "/health").json()["server_pid"] == srv.proc.pid
