"""The library's exception types.

Every error that aqsgd raises on bad input derives from :class:`AqsgdError`. Those caused by a bad value
also derive from :class:`ValueError`, so callers that only know the standard library still catch them.
"""

from __future__ import annotations


class AqsgdError(Exception):
    """Base class of every error raised by aqsgd."""


class SpecError(AqsgdError, ValueError):
    """An unknown codec/scheme name or an invalid parameter in a spec string or config."""


class CodecError(AqsgdError, ValueError):
    """A tensor that a codec cannot encode (unsupported dtype, too many dims, ...)."""


class NonFiniteError(CodecError):
    """The tensor to encode holds NaN or +-Inf (or overflows the wire dtype)."""


class PacketError(AqsgdError, ValueError):
    """Bytes that are not a valid packet: truncated, corrupted, wrong magic or version."""


class PacketMismatchError(PacketError):
    """A valid packet that does not match what the receiver expects (codec, shape, dtype, sample ids)."""


class CacheError(AqsgdError, ValueError):
    """Bad use of an activation cache: id out of range, capacity too small, shape mismatch."""


class SchemeError(AqsgdError, ValueError):
    """Bad use of a boundary scheme (wrong side, wrong phase, inconsistent state)."""


class DataSourceError(AqsgdError, RuntimeError):
    """A data set, tokenizer or model source that is not available and cannot be prepared here.

    The message always names the command that fixes it (``aqsgd data prepare NAME``, a ``pip`` or
    ``apt-get`` line, or the offline task to use instead).
    """
