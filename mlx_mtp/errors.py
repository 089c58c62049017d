"""The error every layer may raise about a checkpoint (defined below all of them, so the hub
client and the model code share it without importing each other)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message says why and what to do."""


class ModelLoadError(CheckpointError):
    """A checkpoint whose files cannot be read or whose model cannot be built."""
