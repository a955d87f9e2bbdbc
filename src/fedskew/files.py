"""The one boundary for files fedskew reads that it did not write in this process.

Every reader of a run folder, a sweep or bench folder, a board, a config or sweep file and a
campaign record goes through :func:`open_file`, :func:`read_bytes`, :func:`read_text`,
:func:`read_json` or :func:`read_yaml`. Each of them:

- opens without blocking and refuses what is not a regular file (a FIFO, a device such as
  ``/dev/zero``, a folder, a socket) in one sentence, before reading a byte;
- does not follow a symbolic link where the file is fedskew's own (``own=True``: a run's
  checkpoint, run.json, a sweep's sweep.yaml): a link there was put by someone else;
- caps the size before reading (:data:`MAX_TEXT` for a record, a board or a config; the caller
  names a larger cap for a checkpoint);
- decodes UTF-8 strictly, parses JSON with its nesting bounded and YAML with the safe loader, its
  aliases and its nesting bounded (:data:`MAX_DEPTH`);
- and, given a pydantic model, validates the result, so that a value that does not fit is one
  sentence naming the file, the field and what was expected.

Every problem is a :class:`FileProblem`, a :class:`~fedskew.config.ConfigError`: the command line
prints it as one sentence and exits with status 2.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from fedskew.config import ConfigError, yaml_problem

MAX_TEXT = 8 << 20  # a record, a summary, a board, a config or sweep file: a few MB at most
MAX_DEPTH = 64  # nesting of YAML or JSON: a config needs 4, a summary 3
MAX_ALIASES = 20  # YAML *name references: a config needs none; an alias bomb needs many


class FileProblem(ConfigError):
    """A file that cannot be read as what it should be: one sentence naming it and why (``reason``:
    the why alone, for a caller that names the file itself)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def _problem(what: str, path, reason: str) -> FileProblem:
    return FileProblem(f"{what} '{path}' {reason}.", f"it {reason}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MB" if n >= 1 << 20 else f"{n:,} bytes"


def open_file(path: str | Path, what: str, *, own: bool = False, limit: int | None = MAX_TEXT):
    """A binary file object of ``path``, a regular file of at most ``limit`` bytes (``None``: no
    cap), opened without following a final symbolic link when ``own``; the caller closes it."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (getattr(os, "O_NOFOLLOW", 0) if own else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise _problem(what, path, "does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _problem(what, path, "is a symbolic link; fedskew does not follow a link where it keeps its own "
                                       "files (copy the file there instead)") from None
        raise _problem(what, path, f"cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _problem(what, path, f"is {_kind(info.st_mode)}, not a regular file; nothing was read from it")
        if limit is not None and info.st_size > limit:
            raise _problem(what, path, f"is {_size(info.st_size)}; such a file is at most {_size(limit)}, so it was "
                                       f"not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, what: str, *, own: bool = False, limit: int | None = MAX_TEXT) -> bytes:
    """The bytes of a regular file (see :func:`open_file`); a file that grows past ``limit`` while
    it is read is refused too."""
    with open_file(path, what, own=own, limit=limit) as fh:
        data = fh.read() if limit is None else fh.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise FileProblem(f"{what} '{path}' is over {_size(limit)}; such a file is at most that, so it was not read.")
    return data


def decode(data: bytes, path: str | Path, what: str) -> str:
    """UTF-8, strictly: one sentence naming the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileProblem(f"{what} '{path}' is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}).") from None


def read_text(path: str | Path, what: str, *, own: bool = False, limit: int | None = MAX_TEXT) -> str:
    return decode(read_bytes(path, what, own=own, limit=limit), path, what)


def _depth(obj: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply containers nest in ``obj`` (iteratively: a deep value does not recurse Python)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(text: str, path: str | Path, what: str, *, finite: bool = False) -> Any:
    """JSON text with its nesting bounded; ``finite``: NaN and Infinity refused."""
    def constant(name: str):
        if finite:
            raise ValueError(f"{name} is not a number this file may hold")
        return float(name.replace("Infinity", "inf"))

    try:
        value = json.loads(text, parse_constant=constant)
    except RecursionError:
        raise FileProblem(f"{what} '{path}' nests deeper than {MAX_DEPTH} levels.") from None
    except ValueError as exc:
        raise FileProblem(f"{what} '{path}' is not valid JSON ({str(exc)[:160]}).") from None
    if _depth(value) > MAX_DEPTH:
        raise FileProblem(f"{what} '{path}' nests deeper than {MAX_DEPTH} levels.")
    return value


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only: no tags that build objects) with aliases and nesting
    bounded: an alias bomb of a few hundred bytes or 20,000 nested brackets is one sentence, not
    gigabytes or a RecursionError."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases_seen = getattr(self, "aliases_seen", 0) + 1
            if self.aliases_seen > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} aliases (*name references); fedskew's files need none")
        self.depth = getattr(self, "depth", 0) + 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.YAMLError(f"it nests deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def parse_yaml(text: str, what: str) -> Any:
    """YAML text through :class:`BoundedLoader`; ``what`` names the file or option in the sentence."""
    if len(text) > MAX_TEXT:
        raise FileProblem(f"{what} is {len(text):,} characters; such a file is at most {MAX_TEXT:,}.")
    try:
        return yaml.load(text, Loader=BoundedLoader)
    except RecursionError:
        raise FileProblem(f"{what} nests deeper than {MAX_DEPTH} levels.") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
        raise FileProblem(f"{what} is not valid YAML ({yaml_problem(exc)[:200]}).") from None


def _validated(value: Any, model, path: str | Path, what: str):
    from pydantic import TypeAdapter, ValidationError

    adapter = model if isinstance(model, TypeAdapter) else TypeAdapter(model)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise FileProblem(f"{what} '{path}': {validation_sentence(exc)}") from None


def validation_sentence(exc) -> str:
    """A pydantic ValidationError as one sentence: the first problem's field, value and expectation."""
    errors = exc.errors()
    err = errors[0]
    field = ".".join(str(p) for p in err["loc"]) or "the whole file"
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"field '{field}' = {shown} is not allowed: {err['msg']}{more}."


def read_json(path: str | Path, what: str, *, model=None, own: bool = False, limit: int = MAX_TEXT,
              finite: bool = False) -> Any:
    """A JSON file through the boundary, validated by ``model`` (a pydantic model, a type or a
    TypeAdapter) when given."""
    value = parse_json(read_text(path, what, own=own, limit=limit), path, what, finite=finite)
    return value if model is None else _validated(value, model, path, what)


def read_yaml(path: str | Path, what: str, *, model=None, own: bool = False, limit: int = MAX_TEXT) -> Any:
    """A YAML file through the boundary, validated by ``model`` when given."""
    value = parse_yaml(read_text(path, what, own=own, limit=limit), f"{what} '{path}'")
    return value if model is None else _validated(value, model, path, what)


def finite_or_none(value: Any) -> float | None:
    """A metric as a float, or None where it is not a finite number (a diverged run's NaN, a
    string or a list in a hand-edited summary)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


__all__ = ["BoundedLoader", "FileProblem", "MAX_DEPTH", "MAX_TEXT", "finite_or_none", "open_file", "parse_json",
           "parse_yaml", "read_bytes", "read_json", "read_text", "read_yaml", "validation_sentence"]
