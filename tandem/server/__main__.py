"""`python -m tandem.server ...` (the guard matters: the engine process is spawned, which imports this)."""
import sys

from tandem.server import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
