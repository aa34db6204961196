"""Errors a user can fix from the message alone, shared by both floors of the house (serve/ and pipeline/).

`ConfigError` is the one type for a bad setting anywhere: a study file, a search space, an engine flag. Command lines
print a `UserError` without a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every error raised on purpose for a user to read: the message names what is wrong and the fix."""


class ConfigError(UserError, ValueError):
    """A setting is wrong (study file, search space, command line, engine flag). The message names the source, the
    key or flag, the value and the fix."""
