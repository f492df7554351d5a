"""Model inventory: names as Ollama resolves them, and facts read from the GGUF file.

Name resolution follows Ollama: ``demo`` means ``demo:latest`` and matching is
case-insensitive (server ``getExistingName`` uses ``strings.EqualFold``); aliases from config
resolve to the same model.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from gateway.logs import get_logger

log = get_logger("gateway.inventory")


def full_name(name: str) -> str:
    """``demo`` -> ``demo:latest``; a name with a tag is kept. Raises nothing."""
    name = name.strip()
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else name + ":latest"


def _fmt_params(n: int) -> str:
    """Ollama's parameter_size style: ``7.6B``, ``494.03M``, ``215.30K``."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if unit == "B" else f"{v:.2f}{unit}"
    return str(n)


_FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
           10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
           16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 24: "IQ1_S",
           25: "IQ4_NL", 26: "IQ3_S", 28: "IQ4_XS", 32: "BF16"}


@dataclass
class GGUFFacts:
    """Metadata read once from the GGUF header (via the ``gguf`` package's GGUFReader).

    ``kv`` holds scalar and short-array key/values (``general.architecture``,
    ``<arch>.context_length`` …); ``n_params`` counts tensor elements.
    """

    architecture: str = ""
    kv: dict = field(default_factory=dict)
    n_params: int = 0
    file_type: str = ""
    chat_template: str = ""

    @classmethod
    def read(cls, path: Path) -> "GGUFFacts":
        from gguf import GGUFReader
        from gguf.constants import GGUFValueType

        r = GGUFReader(str(path), "r")
        kv: dict = {}
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                t = f.types[0] if f.types else None
                if t == GGUFValueType.ARRAY:
                    if len(f.data) > 5 or name.startswith("tokenizer.ggml."):
                        kv[name] = None  # long arrays are emptied, as Ollama does without verbose
                        continue
                kv[name] = f.contents()
            except Exception:  # an odd field must not stop the gateway
                continue
        n_params = sum(int(t.n_elements) for t in r.tensors)
        ft = kv.get("general.file_type")
        facts = cls(architecture=str(kv.get("general.architecture", "")), kv=kv,
                    n_params=n_params, file_type=_FTYPES.get(ft, str(ft) if ft is not None else ""),
                    chat_template=str(kv.get("tokenizer.chat_template") or ""))
        kv.pop("tokenizer.chat_template", None)
        return facts


@dataclass
class ModelEntry:
    """One served model as the Ollama inventory endpoints show it."""

    name: str                # full name, e.g. demo:latest
    path: Path
    aliases: tuple[str, ...] = ()
    facts: GGUFFacts = field(default_factory=GGUFFacts)
    size: int = 0            # bytes on disk
    modified_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    embeddings: bool = False
    _digest: str | None = None

    @classmethod
    def load(cls, name: str, path: Path, aliases=(), embeddings: bool = False) -> "ModelEntry":
        st = path.stat()
        e = cls(name=full_name(name), path=path, aliases=tuple(full_name(a) for a in aliases),
                facts=GGUFFacts.read(path), size=st.st_size,
                modified_at=datetime.fromtimestamp(st.st_mtime).astimezone(),
                embeddings=embeddings)
        return e

    @property
    def digest(self) -> str:
        """Hex sha256 of the file, computed once (in a background thread at start-up)."""
        if self._digest is None:
            self._digest = _sha256(self.path)
        return self._digest

    def compute_digest_in_background(self) -> None:
        threading.Thread(target=lambda: self.digest, daemon=True,
                         name=f"digest-{self.name}").start()

    def details(self, with_parent: bool = True) -> dict:
        arch = self.facts.architecture or "unknown"
        d = {"format": "gguf", "family": arch, "families": [arch],
             "parameter_size": _fmt_params(self.facts.n_params),
             "quantization_level": self.facts.file_type or "unknown"}
        if with_parent:
            d = {"parent_model": "", **d}
        return d

    @property
    def context_length(self) -> int:
        return int(self.facts.kv.get(f"{self.facts.architecture}.context_length") or 0)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Inventory:
    """All served models by name, case-insensitive, aliases included."""

    def __init__(self, entries: list[ModelEntry]):
        self.entries = entries
        self._by_name: dict[str, ModelEntry] = {}
        for e in entries:
            for n in (e.name, *e.aliases):
                self._by_name[n.lower()] = e

    def resolve(self, name: str | None) -> ModelEntry | None:
        if not name or not isinstance(name, str):
            return None
        return self._by_name.get(full_name(name).lower())


def rfc3339(dt: datetime) -> str:
    """Go's RFC 3339 with nanosecond precision style, e.g. ``2025-05-10T08:06:48.639712-07:00``."""
    return dt.isoformat()


def now_utc_z() -> str:
    """``created_at`` as Ollama writes it: UTC with ``Z``, e.g. ``2023-08-04T19:22:45.499127Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


__all__ = ["Inventory", "ModelEntry", "GGUFFacts", "full_name", "now_utc_z", "rfc3339"]
_ = os
