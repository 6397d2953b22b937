"""The user-error family: problems the user fixes in their input.

Everything here means "your config, data or cluster settings are wrong",
never "alignflow broke". The CLI prints a user error as one `error:` line
and exits 2; stage tasks do not retry one (the same input fails the same
way). Other exceptions are bugs or infrastructure faults, shown with their
traceback and retried.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every error that names a wrong input (field, file, row, key)."""


class ConfigError(UserError, ValueError):
    """A configuration problem, with the source and the field it concerns."""


class DataError(UserError, ValueError):
    """A dataset problem, naming the source, the row and the key."""


class PromptTooLongError(DataError):
    """No prompt of a split fits `data.max_prompt_tokens`."""


class InsufficientResourcesError(ConfigError):
    """A stage's actors need more Ray resources than the cluster has."""


class StartError(Exception):
    """A service the run starts (the Prefect API, a local Ray) did not come up; the message names its log.
    Not the user's input, but nothing a traceback explains better: the CLI prints one `error:` line."""
