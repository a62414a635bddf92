"""Loading errors live in `llmserve.load_errors` (layers raise them too); re-exported here."""

from llmserve.load_errors import (
    MissingWeightsError,
    ModelLoadError,
    ModelNotFoundError,
    UnexpectedWeightError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    WeightShapeError,
)

__all__ = [
    "MissingWeightsError",
    "ModelLoadError",
    "ModelNotFoundError",
    "UnexpectedWeightError",
    "UnsafeCheckpointError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "WeightShapeError",
]
