class ModelError(ValueError):
    """The model path or checkpoint can't be used; the message says why."""
