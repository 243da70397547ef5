"""What the engines say of a model in their `/v1/models`: the fields of its card the catalog passes on.

vLLM's model card carries `max_model_len`, `root` (the path the weights came
from) and `parent` (a LoRA adapter's base model); SGLang's, `max_model_len` and
`root`; llama.cpp's, none of them. The router's own `/v1/models` answers these
for each model and its aliases. A card not read yet is unknown and its fields
are left out, never made up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.core.config.engines import ENGINES

# What one replica's adapters may be, at most: a /v1/models listing more is
# read up to this many (vLLM's `--max-loras` is a handful; loaded ones on disk, hundreds).
MAX_ADAPTERS = 1024


@dataclass(frozen=True, slots=True)
class Card:
    """The fields of a model's card that some replica of it reported; None: not reported."""

    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None

    def fields(self) -> dict[str, Any]:
        """The fields known, as /v1/models carries them."""
        out: dict[str, Any] = {}
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        if self.root is not None:
            out["root"] = self.root
        if self.parent is not None:
            out["parent"] = self.parent
        return out


# What a card field may hold, at most: a path (`root`) and a model name
# (`parent`), as engines write them. A field past its bound is left out, as
# if unsaid: it would be kept, and served in every client's /v1/models.
MAX_ROOT_CHARS = 4096
MAX_PARENT_CHARS = 256


def _text(value: object, bound: int) -> str | None:
    return value if isinstance(value, str) and len(value) <= bound and value.isprintable() else None


def read_card(doc: object, model: str) -> Card | None:
    """The card of `model` in a replica's /v1/models answer; None when it has none to give.

    The entry whose id is the model's name (the engine is sent that name, so it
    serves under it); failing that, the answer's only entry. Fields of the wrong
    type are left out, as the engine did not say them.
    """
    if not isinstance(doc, dict):
        return None
    data = doc.get("data")
    if not isinstance(data, list):
        return None
    entries = [entry for entry in data if isinstance(entry, dict)]
    chosen = next((entry for entry in entries if entry.get("id") == model), None)
    if chosen is None and len(entries) == 1:
        chosen = entries[0]
    if chosen is None:
        return None
    length = chosen.get("max_model_len")
    root = chosen.get("root")
    parent = chosen.get("parent")
    return Card(
        length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None,
        _text(root, MAX_ROOT_CHARS),
        _text(parent, MAX_PARENT_CHARS),
    )


class Cards:
    """The cards read so far, by model: the last read of any of its replicas wins."""

    __slots__ = ("_by_model",)

    def __init__(self) -> None:
        self._by_model: dict[str, Card] = {}

    def get(self, model: str) -> Card | None:
        return self._by_model.get(model)

    def put(self, model: str, card: Card) -> None:
        self._by_model[model] = card


def engine_of(doc: object, model: str) -> str | None:
    """The engine a /v1/models answer comes from, by its entry's `owned_by` (vLLM, SGLang and llama.cpp
    write their own name there); None: it does not say one whose load the router reads."""
    if not isinstance(doc, dict) or not isinstance(data := doc.get("data"), list):
        return None
    entries = [entry for entry in data if isinstance(entry, dict)]
    chosen = next((entry for entry in entries if entry.get("id") == model), entries[0] if entries else None)
    owner = chosen.get("owned_by") if chosen is not None else None
    return owner if isinstance(owner, str) and owner in ENGINES else None


def adapters_of(doc: object, model: str) -> frozenset[str]:
    """The LoRA adapters a replica of `model` serves, by its /v1/models answer.

    vLLM lists each adapter it has loaded as an entry of its own whose `parent`
    is the base model it runs on (vllm/entrypoints/openai/serving_models.py,
    show_available_models), and loads or unloads adapters at run time. An
    entry counts when its `parent` is `model` and its id is a name a client
    could send (printable, at most MAX_PARENT_CHARS): other bases' adapters
    are not this replica's to serve under `model`.
    """
    if not isinstance(doc, dict) or not isinstance(data := doc.get("data"), list):
        return frozenset()
    names: set[str] = set()
    for entry in data:
        if not isinstance(entry, dict) or entry.get("parent") != model:
            continue
        name = _text(entry.get("id"), MAX_PARENT_CHARS)
        if name and name != model:
            names.add(name)
            if len(names) >= MAX_ADAPTERS:
                break
    return frozenset(names)
