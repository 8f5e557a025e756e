"""OpenAI-compatible HTTP server: FastAPI front end, engine loop in its own process (ZMQ IPC).

Importing this package stays light: the engine process imports it too.
"""


def serve_main(argv: list[str]) -> int:
    """`tandem serve ...`; returns the exit status."""
    from tandem.server.cli import main
    return main(argv)
