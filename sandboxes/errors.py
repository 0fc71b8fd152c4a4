"""The error every sandbox failure derives from, so callers can catch one type."""


class SandboxError(RuntimeError):
    """A sandbox could not start or died, or its image could not be built or read; the message
    says which and why."""
