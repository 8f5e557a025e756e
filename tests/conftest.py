import os

# Tests run on the CPU with deterministic kernels; keep thread count modest on 2-core CI.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
