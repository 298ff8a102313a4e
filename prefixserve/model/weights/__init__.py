"""Weights from files to memory: GGUF reading, the loader, the packed quantized formats and their C
kernels' library, dtypes, and the models known by name."""
