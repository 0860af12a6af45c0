"""Exceptions raised by perseus, with Horovod's names kept as aliases of the same classes."""

__all__ = [
    "BadArgumentTypeError",
    "HorovodInternalError",
    "PerseusInternalError",
    "HostsUpdatedInterrupt",
    "HorovodVersionMismatchError",
    "PerseusVersionMismatchError",
    "StallError",
    "MismatchError",
    "NonFiniteGradientError",
    "NotAMemberError",
]


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name). Elastic training treats it as recoverable."""


class PerseusInternalError(HorovodInternalError):
    """A collective failed: a cross-rank mismatch, a stall, a failed or shut-down peer, or a transport error."""


class MismatchError(PerseusInternalError):
    """Ranks disagreed about a collective (shape, dtype, op, root rank, scale factors), or asked for one that
    cannot run (a non-allreduce collective while ranks have joined). Raised on every rank."""


class StallError(PerseusInternalError):
    """Ranks waited longer than the stall shutdown time for a tensor that some ranks never submitted."""


class BadArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (floats where a count is due) where Horovod raises ValueError: an instance of
    both, so that code catching either keeps working."""


class NotAMemberError(ValueError):
    """This rank called a collective of a process set it does not belong to. (A ValueError, as for an
    unregistered set; TensorFlow ops raise it as ``tf.errors.InvalidArgumentError``, as Horovod's do.)"""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed during elastic training."""

    def __init__(self, skip_sync):
        super().__init__()
        self.skip_sync = skip_sync


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf before it was reduced (PERSEUS_NONFINITE_GRADIENTS=raise). Raised on every
    rank of the process set at the same step, naming the tensors and the ranks."""


class HorovodVersionMismatchError(ImportError):
    """A framework was upgraded after perseus was installed in a way perseus cannot use."""

    def __init__(self, name, version, installed_version):
        super().__init__(
            f"Framework {name} installed with version {installed_version} but found version {version}."
        )
        self.name = name
        self.version = version
        self.installed_version = installed_version


PerseusVersionMismatchError = HorovodVersionMismatchError
