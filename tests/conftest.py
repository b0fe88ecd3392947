import sys
from pathlib import Path

import torch

# `from inputs import make_qkv` in every test directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Tests use small tensors: one intra-op thread avoids OpenMP overhead (and makes the
# suite insensitive to other processes sharing the CPU).
torch.set_num_threads(1)
