"""The error every bad fine-tuning input raises: one line for the user (exit status 2)."""

from lambjax.data.sources import DataError


class FinetuneError(DataError):
    """A bad config value, file or dataset; the message names it and what would be valid."""
