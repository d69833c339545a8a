"""gpud: the GPU-memory ledger of one host, and gpuctl, its client.

Kept free of imports: gpuctl imports this package and must start fast.
"""

__version__ = "0.1.0"
