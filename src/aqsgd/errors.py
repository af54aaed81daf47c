"""The library's exception types.

Every error that aqsgd raises on bad input derives from :class:`AqsgdError`. Those caused by a bad value
also derive from :class:`ValueError`, so callers that only know the standard library still catch them.
"""

from __future__ import annotations


class AqsgdError(Exception):
    """Base class of every error raised by aqsgd. ``exit_code`` is the status ``aqsgd`` exits with when the
    error ends a command (2: bad input or a failed run)."""

    exit_code = 2


class SpecError(AqsgdError, ValueError):
    """An unknown codec/scheme name or an invalid parameter in a spec string or config."""


class CodecError(AqsgdError, ValueError):
    """A tensor that a codec cannot encode (unsupported dtype, too many dims, ...)."""


class NonFiniteError(CodecError):
    """The tensor to encode holds NaN or +-Inf (or overflows the wire dtype)."""


class DivergedError(AqsgdError, RuntimeError):
    """Training produced a NaN or infinite loss, gradient norm or activation: the run stopped at that step
    without applying it. The message names the step, the value and what to change (learning rate, clipping,
    ``--skip-nonfinite``) and the last complete checkpoint. ``aqsgd`` exits with status 3."""

    exit_code = 3


class Interrupted(KeyboardInterrupt):
    """The process was asked to stop by SIGINT (Ctrl-C) or SIGTERM.

    A :class:`KeyboardInterrupt`, as Python's own Ctrl-C is: handlers of ordinary errors
    (``except Exception``) let it pass. ``signum`` is the signal; ``exit_code`` the conventional status,
    128 + signum (130 for SIGINT, 143 for SIGTERM). The message says where the run stopped and which
    checkpoint continues it, where known.
    """

    def __init__(self, signum: int, message: str | None = None) -> None:
        super().__init__(message or f"interrupted ({signal_name(signum)})")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __reduce__(self):
        return (type(self), (self.signum, str(self)))


def signal_name(signum: int) -> str:
    """``SIGINT`` for 2, ``SIGTERM`` for 15 (``signal N`` for a number the platform does not name)."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PacketError(AqsgdError, ValueError):
    """Bytes that are not a valid packet: truncated, corrupted, wrong magic or version."""


class PacketMismatchError(PacketError):
    """A valid packet that does not match what the receiver expects (codec, shape, dtype, sample ids)."""


class CacheError(AqsgdError, ValueError):
    """Bad use of an activation cache: id out of range, capacity too small, shape mismatch."""


class SchemeError(AqsgdError, ValueError):
    """Bad use of a boundary scheme (wrong side, wrong phase, inconsistent state)."""


class WeightsError(AqsgdError, ValueError):
    """A weights file that does not fit the model: missing keys, wrong shapes, unreadable layout, or a
    module state that cannot be materialized (e.g. an unknown non-persistent buffer)."""


class PeerFailure(AqsgdError):
    """A peer process failed: its connection closed, it sent something malformed, or it stopped responding.

    The message names the peer (its rank and, when the transport knows one, a label such as ``stage 2``).
    ``rank`` holds the peer's rank in the process group, ``label`` its label (or None).
    """

    def __init__(self, message: str, *, rank: int | None = None, label: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.label = label

    def __reduce__(self):  # keyword-only arguments need an explicit reduce to survive pickling
        return (_rebuild_peer_error, (type(self), str(self), self.rank, self.label))


class PeerTimeout(PeerFailure):
    """A peer that did not send (or did not accept) a message within the transport's timeout."""


def _rebuild_peer_error(cls: type[PeerFailure], message: str, rank: int | None,
                        label: str | None) -> PeerFailure:
    return cls(message, rank=rank, label=label)


class TransportError(AqsgdError, ValueError):
    """Bad use of a transport: a rank outside the group or the own rank, a bad channel, too many packets,
    use after ``close()``."""


class ConfigMismatchError(AqsgdError, ValueError):
    """Processes of one job started with different settings (codecs, stage counts, shapes, ...)."""


class DataSourceError(AqsgdError, RuntimeError):
    """A data set, tokenizer or model source that is not available and cannot be prepared here.

    The message always names the command that fixes it (``aqsgd data prepare NAME``, a ``pip`` or
    ``apt-get`` line, or the offline task to use instead).
    """


class DataFileError(DataSourceError, ValueError):
    """The user's own data cannot be used as given: a missing or unreadable file, an unknown file type, a
    malformed line, a missing column, a bad value, empty data, or too little data to hold out for evaluation.

    The message is one line: the option and the file (``--train-file data/train.csv: ...``), the problem and,
    where it is in the file, the line (or record, or row) number.
    """


class ReportError(AqsgdError, ValueError):
    """A run directory that cannot be reported on (missing, no ``metrics.jsonl``), or a bad report option
    (unknown baseline, wrong number of labels)."""


class StageFailedError(AqsgdError, RuntimeError):
    """A process of a distributed run failed and the run was stopped.

    The message is one line: the process at fault (``stage 1``, or ``rank 1`` where no name is known) and
    why, then where the details are (every process's error and traceback). ``rank`` is the global rank at
    fault, ``label`` its name, ``reason`` the why, ``log_path`` the details file (or None), ``exit_code`` the
    status of that process's error (3 for a diverged run; 2 where its error has none of its own).
    """

    def __init__(self, message: str, *, rank: int | None = None, label: str | None = None,
                 reason: str | None = None, log_path: str | None = None,
                 exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.label = label
        self.reason = reason
        self.log_path = log_path
        if exit_code is not None:
            self.exit_code = int(exit_code)

    def __reduce__(self):
        return (_rebuild_stage_failed,
                (type(self), str(self), self.rank, self.label, self.reason, self.log_path, self.exit_code))


def _rebuild_stage_failed(cls: type[StageFailedError], message: str, rank: int | None, label: str | None,
                          reason: str | None, log_path: str | None, exit_code: int | None = None
                          ) -> StageFailedError:
    return cls(message, rank=rank, label=label, reason=reason, log_path=log_path, exit_code=exit_code)
