"""Typed errors raised by the engines.

The library never prints or exits; `cli/` maps each class to a one-line message and an exit code.
"""


class MlxkitError(Exception):
    """Base class of every error the engines raise on purpose."""

    exit_code = 1


class InputError(MlxkitError, ValueError):
    """Bad user input: a missing file, a malformed spec, inconsistent shapes."""

    exit_code = 2


class ModelLoadError(MlxkitError):
    """A model spec could not be resolved or loaded."""

    exit_code = 3


class OfflineError(ModelLoadError):
    """A hub model was asked for while the hub cannot be reached."""


class RecipeError(InputError):
    """A recipe file does not parse or does not validate."""


class InfeasibleError(MlxkitError):
    """The constraints of a search admit no solution."""

    exit_code = 4


class SingularMatrixError(MlxkitError, ArithmeticError):
    """A linear system is singular (or numerically so) and no null-space handling was asked for."""

    exit_code = 5


class BackendError(MlxkitError, RuntimeError):
    """A required backend (solver, device, package) is missing or failed."""

    exit_code = 6


class NonFiniteError(MlxkitError, ArithmeticError):
    """A computed result (a loss, a merged tensor, a score) came out NaN or infinite."""

    exit_code = 8


class OutputBusyError(MlxkitError):
    """Another run holds the output (its lock file names the host and pid)."""

    exit_code = 9


class ResourceError(MlxkitError):
    """A run would need more memory than the machine or the device has (estimated before any work)."""

    exit_code = 7
