"""The store of a decoder's earlier calls: a suffix trie per scope, bounded in bytes, saved and loaded.

Counts only grow: the store forgets by dropping its oldest calls (of any scope) until about half
its bound is used and rebuilding the tries that lost calls (arrays and dicts never shrink in
place, so a rebuild is what makes the measured bytes honest again). A lock serves concurrent calls
from several threads. A saved store is one file: a header line (format, version, depth, calls, a
digest) and one JSON line per call; one that is not such a file, of another version, or damaged
is refused, naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .trie import STRIDE, Branch, SuffixTrie

#: the save file's first line names it; VERSION changes with its layout
FORMAT, VERSION = "specdec-suffix-memory", 1


@dataclass
class _Call:
    scope: str | None
    rows: list[array]  # each row's tokens (prompt and output)

    def nbytes(self) -> int:
        return sys.getsizeof(self) + sys.getsizeof(self.rows) + sum(sys.getsizeof(r) for r in self.rows)

    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def check_scope(scope) -> str | None:
    if scope is not None and not isinstance(scope, str):
        raise TypeError(f"memory_scope must be a str or None, got {type(scope).__name__}")
    return scope


class SuffixMemory:
    """The earlier calls of one decoder, per scope, within ``memory_bytes``; thread-safe."""

    def __init__(self, memory_bytes: int, max_depth: int):
        self.limit, self.max_depth = memory_bytes, max_depth
        self.lock = threading.Lock()
        self.calls: deque[_Call] = deque()  # oldest first
        self.tries: dict[str | None, SuffixTrie] = {}
        self.evicted = 0  # calls dropped to stay within the bound, since the store was made

    # -- reading and adding ----------------------------------------------------------------------
    def draft(self, scope: str | None, context: list[int], **how) -> Branch:
        """:meth:`SuffixTrie.draft` on the scope's trie (an empty branch when it holds none)."""
        with self.lock:
            trie = self.tries.get(scope)
            return trie.draft(context, **how) if trie is not None else Branch()

    def add(self, scope: str | None, rows: list[list[int]]) -> None:
        """Remember one call's rows (prompt and output each), then keep within the bound."""
        if self.limit <= 0 or not rows:
            return
        call = _Call(scope, [array("i", r) for r in rows])
        with self.lock:
            self.calls.append(call)
            self._insert(call)
            self._bound()

    def _insert(self, call: _Call) -> None:
        trie = self.tries.setdefault(call.scope, SuffixTrie(self.max_depth))
        for row in call.rows:
            trie.extend(trie.start(), row)

    def _bound(self) -> None:
        """Drop the oldest calls until the bytes are within the bound (to about half of it, so that
        the rebuild this takes is paid seldom)."""
        used = self._nbytes()
        while used > self.limit and self.calls:
            held = sum(c.tokens() for c in self.calls)
            keep = held * min(0.5 * self.limit / used, 0.9)  # tokens to keep, bytes taken as proportional
            dropped: set[str | None] = set()
            while self.calls and (held > keep or not held):
                call = self.calls.popleft()
                held -= call.tokens()
                dropped.add(call.scope)
                self.evicted += 1
            for scope in dropped:  # arrays and dicts never shrink in place: rebuild what lost calls
                self.tries.pop(scope, None)
                for call in self.calls:
                    if call.scope == scope:
                        self._insert(call)
            used = self._nbytes()

    def _nbytes(self) -> int:
        return (sum(t.nbytes() for t in self.tries.values()) + sum(c.nbytes() for c in self.calls)
                + sys.getsizeof(self.calls) + sys.getsizeof(self.tries))

    # -- what a service needs ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"memory_bytes": self._nbytes(), "memory_calls": len(self.calls),
                    "memory_tokens": sum(c.tokens() for c in self.calls), "memory_scopes": len(self.tries),
                    "memory_evicted": self.evicted}

    def clear(self) -> None:
        with self.lock:
            self.calls.clear()
            self.tries.clear()

    def save(self, path: str | os.PathLike) -> None:
        """Write every call held, oldest first: a header line (format, version, depth, calls, the
        sha256 of what follows), then one JSON line per call; atomically (a temporary file renamed)."""
        with self.lock:
            lines = [json.dumps({"scope": c.scope, "rows": [r.tolist() for r in c.rows]}) for c in self.calls]
        body = "".join(line + "\n" for line in lines).encode()
        header = {"format": FORMAT, "version": VERSION, "max_depth": self.max_depth, "calls": len(lines),
                  "sha256": hashlib.sha256(body).hexdigest()}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        """Replace what is held by the calls saved in ``path`` (then keep within this store's bound).
        A file that is not one, of another version, or damaged (its digest, its calls) is refused
        with a ValueError naming it; the store is left as it was."""
        calls = read_calls(Path(path))
        with self.lock:
            self.calls = deque(calls)
            self.tries = {}
            for call in self.calls:
                self._insert(call)
            self._bound()


def read_calls(path: Path) -> list[_Call]:
    """The calls of a file :meth:`SuffixMemory.save` wrote, validated."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"suffix memory file {str(path)!r} refused: {why}")

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise refuse(f"cannot read it ({exc.strerror or exc})") from None
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise refuse("its first line is not a suffix memory header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise refuse(f"not a {FORMAT} file")
    if header.get("version") != VERSION:
        raise refuse(f"version {header.get('version')!r}, this specdec reads version {VERSION}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise refuse("damaged (its content does not match the digest in its header)")
    calls = []
    for n, line in enumerate(body.splitlines(), start=2):
        try:
            item = json.loads(line)
            scope, rows = check_scope(item["scope"]), item["rows"]
            if not isinstance(rows, list) or not all(
                    isinstance(r, list) and all(type(t) is int and 0 <= t < STRIDE for t in r) for r in rows):
                raise ValueError("rows must be lists of token ids")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise refuse(f"line {n}: {exc}") from None
        calls.append(_Call(scope, [array("i", r) for r in rows]))
    if len(calls) != header.get("calls"):
        raise refuse(f"{len(calls)} calls, its header says {header.get('calls')!r}")
    return calls
