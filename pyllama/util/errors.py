"""Errors that reach users as one clear line (the programs print them and exit with status 1)."""


class PyllamaError(Exception):
    """Base class of every error pyllama reports to a user without a traceback."""


class ModelFileError(PyllamaError):
    """A model file that is missing, corrupt, truncated or of an unsupported kind."""


class ContextLimitError(PyllamaError):
    """A request that does not fit the context it was given."""


class UnsupportedOpError(PyllamaError):
    """A placement that gives layers to a device without the ops they need."""
