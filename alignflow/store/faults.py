"""What goes wrong with stored artifacts: missing or uncommitted (StorageError), files that no longer match their
manifest (CorruptArtifact), and such a file found in a stage's input (CorruptInput)."""

from __future__ import annotations


class StorageError(RuntimeError):
    """A missing, uncommitted or corrupted artifact."""


class CorruptArtifact(StorageError):
    """A committed artifact whose files no longer match its manifest (changed or lost after the commit). Its
    message starts with the artifact's URI and CORRUPT (it crosses Ray by its message)."""

    @property
    def uri(self) -> str:
        return str(self).split(CORRUPT, 1)[0]

    @property
    def detail(self) -> str:
        """The files that do not match, as the message lists them."""
        return str(self).split(CORRUPT, 1)[-1]


CORRUPT = ": files do not match the manifest: "


class CorruptInput(StorageError):
    """A stage's committed input whose files no longer match its manifest, found where the stage read it: set
    aside, so that the pipeline's next run computes it again. Not retried: until then it stays as it is."""


def corrupt_artifacts(err: BaseException) -> list[CorruptArtifact]:
    """The CorruptArtifact errors behind `err`: itself, its causes and contexts, and the exception a Ray task
    or actor raised (RayTaskError's `cause`, which the error re-raised in the caller wraps)."""
    found, seen, todo = [], set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(e, CorruptArtifact) and not isinstance(cause, BaseException):
            found.append(e)
        todo += [e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None]
    return found
