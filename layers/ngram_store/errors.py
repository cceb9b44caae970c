"""``CheckpointError``: the one error of files on disk that do not hold what they say."""


class CheckpointError(ValueError):
    """A model folder, config, index, tensor or table file that cannot be served, named."""
