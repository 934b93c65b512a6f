"""The errors the commands report as one line (`train.cli`): a config that cannot run, a
checkpoint or workdir that cannot be used. Raised by the library, caught by the commands."""


class ConfigError(ValueError):
  """A config that cannot run (a field out of range, a choice this backend lacks, a change a
  workdir's checkpoints do not fit); the message names the field."""


class CheckpointError(RuntimeError):
  """A checkpoint or workdir that cannot be used: nothing to restore, damage found,
  incompatible contents; the message says what was found and what to do."""


class DataError(ValueError):
  """Input data that cannot be read (a glob matching nothing, a missing text field, an empty
  file, invalid UTF-8); the message names the file and, where it can, the line or row."""
