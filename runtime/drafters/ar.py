"""Plain autoregressive decoding: the base drafter proposes nothing; every step verifies the root alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Drafter


@dataclass(frozen=True)
class ArConfig:
    method: ClassVar[str] = "ar"

    @property
    def verify_tokens(self) -> int:
        return 1


def build(export, config: ArConfig) -> Drafter:
    return Drafter()
