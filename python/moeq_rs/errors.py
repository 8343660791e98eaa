"""The moeq_rs exception hierarchy.

Every error moeq_rs raises for bad input is a :class:`MoeqError`; each subclass is also the
builtin exception a Python user would catch for that situation (``ValueError`` for bad data,
``RuntimeError`` for a missing GPU). Messages name the file, tensor, module or config key.
"""

from __future__ import annotations

__all__ = [
    "MoeqError",
    "CheckpointError",
    "ConfigError",
    "UnsupportedSchemeError",
    "LayoutError",
    "CudaUnavailableError",
    "MissingDependencyError",
    "UncheckedRoutingWarning",
]


class MoeqError(Exception):
    """Base class of every moeq_rs error."""


class CheckpointError(MoeqError, ValueError):
    """A checkpoint file or directory is missing, malformed or inconsistent with its config."""


class ConfigError(MoeqError, ValueError):
    """``config.json`` or its ``quantization_config`` is malformed; the message names the key."""


class UnsupportedSchemeError(MoeqError, ValueError):
    """A valid quantization scheme that moeq_rs cannot honour (online transforms, sparse, ...)."""


class LayoutError(MoeqError, ValueError):
    """A tensor layout rule is broken (shape, tile, padding, dtype)."""


class CudaUnavailableError(MoeqError, RuntimeError):
    """The CUDA path was requested but no usable driver or device is present."""


class MissingDependencyError(MoeqError, ImportError):
    """A feature needs an optional package that is not installed (torch: the MoE layers, torch
    tensors out of a checkpoint, the CUDA path). The message names the feature and the package
    to install."""


class UncheckedRoutingWarning(UserWarning):
    """A layer was loaded from a checkpoint whose model family's router moeq_rs has not
    checked against the model's definition: it is routed from config.json's keys (softmax or
    sigmoid top-k, bias, groups, renormalisation, scaling) as for the checked families."""
