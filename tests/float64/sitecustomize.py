"""Put this folder first on PYTHONPATH and every Python process of a run (workers included) computes in float64.

Python imports `sitecustomize` at start-up from the path; the parity test uses it to show that the
fp32 differences between strategies are rounding: in float64 they vanish.
"""

import torch

torch.set_default_dtype(torch.float64)
