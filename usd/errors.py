"""What kind of failure an exception is. A `ValueError` (and its subclasses, such as `chat.PromptError`) is the
user's to fix: the server answers 400 with its message, the UI shows it as an input message. An `InternalError` is a
broken invariant of the engine, a bug: the server answers 500 and logs it, the UI asks for a report."""

from __future__ import annotations


class InternalError(RuntimeError):
    """An invariant of the engine does not hold: a bug to report, never the user's input."""


class Failed:
    """An exception a worker thread hands to the thread that consumes its results, to be raised there (the app's
    streaming handlers and the server's jobs run the decode loop on a thread of its own)."""

    def __init__(self, error: BaseException):
        self.error = error
