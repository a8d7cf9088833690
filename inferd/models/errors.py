class ModelLoadError(Exception):
    """A model source cannot be loaded as given; the message says what to change."""


class ChatTemplateError(ValueError):
    """A chat template is missing or fails to render; the message says why."""
