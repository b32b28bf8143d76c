"""The AnerError family: every failure a user can cause.

Each message names the offending value and what would be accepted. Internal invariants use
`assert`; nothing here is raised for a bug of ours.
"""


class AnerError(Exception):
    """Base of every error a caller can cause."""


class FormatError(AnerError):
    """A file is not what it claims to be: truncated, wrong magic, wrong version, bad checksum."""


class UnsupportedModelError(AnerError):
    """A well-formed model outside the supported profile (architecture, tensor type, RoPE...)."""


class DataError(AnerError):
    """Training or validation data that cannot be prepared or used as asked."""


class ConfigError(AnerError):
    """An argument outside its accepted range or set."""


class ResourceError(AnerError):
    """An admission estimate over the budget, a missing device or capability."""


class ArtifactError(AnerError):
    """A destination that exists, or an artifact that fails its integrity checks."""
