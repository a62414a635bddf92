"""Errors raised while locating and loading a model. All are `ValueError`s (bad user input) and
name the file, the tensor and what was expected."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """Base class: a model could not be loaded because of what is (or is not) on disk."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The named model, file or folder does not exist or holds no weights."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no native implementation here."""


class UnsupportedTensorTypeError(ModelLoadError):
    """A GGUF tensor is stored in a quantization type this loader cannot dequantize."""


class UnsafeCheckpointError(ModelLoadError):
    """A PyTorch pickle checkpoint tried to do more than hold tensors (run code, import modules)."""


class WeightShapeError(ModelLoadError):
    """A checkpoint tensor's shape disagrees with the shape the config implies."""

    def __init__(self, tensor: str, expected: tuple[int, ...], got: tuple[int, ...], file: str | None = None):
        self.tensor, self.expected, self.got, self.file = tensor, expected, got, file
        where = f" in {file}" if file else ""
        super().__init__(
            f"tensor {tensor!r}{where} has shape {list(got)}, but the model config implies {list(expected)}"
        )

    def with_file(self, file: str) -> WeightShapeError:
        return WeightShapeError(self.tensor, self.expected, self.got, file)


class MissingWeightsError(ModelLoadError):
    """Parameters the architecture needs were not found in the checkpoint."""


class UnexpectedWeightError(ModelLoadError):
    """The checkpoint holds a tensor the architecture has no place for."""
