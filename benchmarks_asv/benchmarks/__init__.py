"""cupyflash's asv suite: GPU benchmarks with their peers (PyTorch SDPA) beside them."""
