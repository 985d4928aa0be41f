"""Name-keyed registries for swappable components (heads, drafters, targets, prompt sets, policies).

Configs name components (`model.head=markov`); code never imports from config strings. Reports and tests iterate a
registry (`ordered()`: the order the module registers its entries) instead of repeating its names, so that a new
entry reaches every comparison and every parametrized test; an entry may carry a display `label`.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict of named builders whose errors list what exists.

    >>> heads = Registry("model.head")
    >>> @heads.register("none")
    ... def build_none(): ...
    """

    def __init__(self, key: str) -> None:
        self.key = key  # the config key this registry answers, used in error messages
        self._items: dict[str, T] = {}  # in registration order
        self._labels: dict[str, str] = {}

    def register(self, name: str, *, label: str | None = None) -> Callable[[T], T]:
        """Decorator adding `obj` under `name` (shown as `label` in reports); refuses duplicates."""

        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.key}: '{name}' is already registered")
            self._items[name] = obj
            if label is not None:
                self._labels[name] = label
            return obj

        return add

    def add(self, name: str, obj: T, *, label: str | None = None) -> T:
        """Register `obj` under `name` without a decorator."""
        return self.register(name, label=label)(obj)

    def unregister(self, name: str) -> T:
        """Remove `name` and return its entry (tests register throwaway entries and remove them again)."""
        self._labels.pop(name, None)
        return self._items.pop(name)

    def resolve(self, name: str) -> T:
        """Return the entry for `name`, or raise a ValueError listing the valid names."""
        if name not in self._items:
            raise ValueError(unknown_name_message(self.key, name, self.names()))
        return self._items[name]

    def names(self) -> list[str]:
        """The names, sorted (error messages, pinned lists)."""
        return sorted(self._items)

    def ordered(self) -> list[str]:
        """The names in registration order (report rows and comparisons follow the module's own order)."""
        return list(self._items)

    def label(self, name: str) -> str:
        """The display label given at registration, else the name itself."""
        return self._labels.get(name, name)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def unknown_name_message(key: str, name: str, valid: list[str]) -> str:
    """One error text for every 'unknown name' case: the key, the bad value, close matches, all valid names."""
    close = difflib.get_close_matches(str(name), valid, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"Unknown {key} '{name}'.{hint} Valid: {', '.join(valid)}."
