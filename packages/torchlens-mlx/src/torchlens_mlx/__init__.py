"""TorchLens backend for MLX (preview). Importing this package imports no framework; the
backend object (`torchlens_mlx.backend`) imports `mlx` when a capture needs it."""

__version__ = "0.1.0"
