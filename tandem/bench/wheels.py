"""`tandem bench wheels`: what a GPU run needs that the GPU image lacks, into git-ignored folders.

- `.whl/`: wheels for Python 3.12 on x86-64 Linux of the packages the image does not have
  (the server's, structured output's, GGUF's, the openai client the server tests import), at
  the versions this environment runs (so the GPU run tests what CI tests). No dependencies are
  resolved there: the list below is the closure of tandem's imports minus the image's packages
  (docs/benchmarks.md names the image's list).
- `.model/tokenizer`: the built-in model's tokenizer, saved as an HF tokenizer (the GGUF it
  comes from is not carried); tests read it through TANDEM_TEST_TOKENIZER, `tandem bench
  grammar` through --tokenizer.

On the GPU machine: `python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

# Not on the GPU image (docs/benchmarks.md, "What travels with the suite"); their own
# dependencies that the image lacks are listed too (pip runs with --no-deps there).
PACKAGES = (
    "fastapi", "starlette", "uvicorn", "msgspec", "pyzmq",  # the server
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "opentelemetry-api",
    "xgrammar", "apache-tvm-ffi",  # structured output
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "gguf",  # GGUF checkpoints (the built-in model's loader)
    "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio",  # the server tests' client
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pinned(names: tuple[str, ...] = PACKAGES) -> list[str]:
    """NAME==VERSION for each, at the version installed here."""
    missing = [n for n in names if not _version(n)]
    if missing:
        raise SystemExit(f"not installed here, so no version to pin: {', '.join(missing)}")
    return [f"{n}=={_version(n)}" for n in names]


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def download_command(dest: Path, specs: list[str], python_version: str) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + specs


def save_tokenizer(dest: Path) -> None:
    from tandem.bench.presets import load_tokenizer
    load_tokenizer(None).save_pretrained(dest)


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench wheels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", default=".whl", help="wheel folder (emptied first)")
    ap.add_argument("--tokenizer", default=".model/tokenizer", help="where the tokenizer is saved")
    ap.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    ap.add_argument("--no-tokenizer", action="store_true")
    args = ap.parse_args(argv)
    wheels = Path(args.wheels)
    shutil.rmtree(wheels, ignore_errors=True)  # no stale versions beside the pinned ones
    wheels.mkdir(parents=True)
    subprocess.run(download_command(wheels, pinned(), args.python_version), check=True)
    print(f"{wheels}/: {len(list(wheels.glob('*.whl')))} wheels, {size_mib(wheels):.1f} MiB")
    if not args.no_tokenizer:
        tok = Path(args.tokenizer)
        shutil.rmtree(tok, ignore_errors=True)
        save_tokenizer(tok)
        print(f"{tok}/: {size_mib(tok):.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
