"""Streaming JSON reader: walk a large top-level object, decoding one array element at a time."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from utils.errors import ConfigError

CHUNK_CHARS = 1 << 24  # characters read at a time: 16 M, so a 448 MB file is read in ~28 pieces
NUMBER_CHARS = frozenset("0123456789.eE+-")
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class JsonStream:
    """Read a JSON document from a text file piece by piece, holding one chunk and one decoded element at a time.

    `json.load` of COCO train2017 (448 MB) holds about 6x the file in Python objects; walking it
    with `items()` and `elements()` holds a chunk of text and the element in hand. Each element is
    decoded by the json module's C scanner (`JSONDecoder.raw_decode`); an element cut by the end of
    the chunk is decoded again once the next chunk is in. Malformed JSON is a one-line ConfigError
    naming the file and the character offset.
    """

    def __init__(self, file: TextIO, path: Path, chunk_chars: int = CHUNK_CHARS) -> None:
        self.file = file
        self.path = path
        self.chunk_chars = chunk_chars
        self.buffer = ""
        self.pos = 0
        self.consumed = 0  # characters dropped from the front of the buffer: offsets in errors are file offsets
        self.at_eof = False
        self.decoder = json.JSONDecoder()

    def _read_more(self) -> bool:
        """Append the next chunk to the unread rest of the buffer; False at the end of the file."""
        if self.at_eof:
            return False
        chunk = self.file.read(self.chunk_chars)
        self.at_eof = not chunk
        self.consumed += self.pos
        self.buffer = self.buffer[self.pos :] + chunk
        self.pos = 0
        return bool(chunk)

    def _fail(self, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: not valid JSON ({problem} at character {self.consumed + self.pos})")

    def peek(self) -> str:
        """Return the next non-whitespace character without consuming it ('' at the end of the file)."""
        while True:
            self.pos = _WHITESPACE.match(self.buffer, self.pos).end()  # type: ignore[union-attr]  # always matches
            if self.pos < len(self.buffer):
                return self.buffer[self.pos]
            if not self._read_more():
                return ""

    def expect(self, char: str) -> None:
        """Consume `char` (after whitespace) or raise ConfigError."""
        found = self.peek()
        if found != char:
            raise self._fail(f"expected '{char}', found {found!r}" if found else f"expected '{char}', file ends")
        self.pos += 1

    def value(self) -> Any:
        """Decode and return the next JSON value."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as error:
                if self._read_more():
                    continue
                self.pos = error.pos
                raise self._fail(error.msg) from None
            # A number cut by the end of the chunk ("2." of "2.5") decodes as a shorter one: read on and decode again.
            if not isinstance(value, dict | list | str) and self._may_continue(end) and self._read_more():
                continue
            self.pos = end
            return value

    def _may_continue(self, end: int) -> bool:
        """Whether a number or literal decoded up to `end` may go on in the next chunk."""
        return end == len(self.buffer) or self.buffer[end] in NUMBER_CHARS

    def items(self) -> Iterator[str]:
        """Walk an object: yield each key, after which the caller must consume its value (value() or elements())."""
        self.expect("{")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            key = self.value()
            if not isinstance(key, str):
                raise self._fail("expected an object key")
            self.expect(":")
            yield key
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("}")
            return

    def elements(self) -> Iterator[Any]:
        """Walk an array, yielding each element decoded.

        Called per annotation of a COCO file (860k), so an object or array element followed by a
        comma inside the chunk is decoded by the C scanner directly; anything else (whitespace, a
        chunk boundary, the end) takes the general path through value() and peek().
        """
        self.expect("[")
        if self.peek() == "]":
            self.pos += 1
            return
        scan = self.decoder.scan_once
        while True:
            buffer, pos = self.buffer, self.pos
            if pos < len(buffer) and buffer[pos] in "{[":
                try:
                    value, end = scan(buffer, pos)
                except (StopIteration, json.JSONDecodeError):
                    value = end = None  # cut by the chunk's end, or malformed: the general path decides
                if end is not None and end + 1 < len(buffer) and buffer[end] == ",":
                    self.pos = end + 1
                    if buffer[end + 1] not in " \t\n\r":
                        yield value
                        continue
                    yield value
                    self.peek()
                    continue
            yield self.value()
            if self.peek() == ",":
                self.pos += 1
                self.peek()
                continue
            self.expect("]")
            return

    def next_is(self, char: str) -> bool:
        """Whether the next value starts with `char` ('[' for an array, '{' for an object)."""
        return self.peek() == char
