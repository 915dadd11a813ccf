"""What the handlers-do-not-save rule reports: each violation with the chain of calls from the
handler to the save (file and line of every hop), each allowlisted save with its reason, and how
to fix a violation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HOW_TO_FIX = (
    "Handlers must not save: the unit of work that dispatches them commits their effects with "
    "the delivery record. Mutate state, raise events, enqueue integration events or schedule an "
    "internal command (uow.schedule) instead; or allowlist the name with the reason it is safe."
)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Hop:
    """One step of a chain: what was reached, how, and the file:line where it happens."""

    name: str
    path: Path
    line: int
    how: str

    @property
    def location(self) -> str:
        return f"{_shown(self.path)}:{self.line}"

    def describe(self) -> str:
        return f"{self.name}  [{self.how} at {self.location}]"


def _chain_text(chain: tuple[Hop, ...], last: str) -> str:
    lines = [f"      {chain[0].describe()}"]
    lines += [f"   -> {hop.describe()}" for hop in chain[1:]]
    return "\n".join([*lines[:-1], f"{lines[-1]}  <- {last}"]) if len(lines) > 1 else lines[0]


@dataclass(frozen=True)
class Violation:
    handler: str
    kind: str
    chain: tuple[Hop, ...]

    @property
    def sink(self) -> str:
        return self.chain[-1].name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(hop.name for hop in self.chain)

    def describe(self) -> str:
        return (
            f"  {self.kind} handler {self.handler} saves ({len(self.chain) - 1} call(s) deep):\n"
            f"{_chain_text(self.chain, 'saves')}"
        )


@dataclass(frozen=True)
class AllowlistHit:
    """The first (shortest) path from a handler to one allowlist entry."""

    handler: str
    kind: str
    entry: str
    name: str
    reason: str
    chain: tuple[Hop, ...]

    def describe(self) -> str:
        return (
            f"  {self.kind} handler {self.handler} reaches {self.name} (allowlisted as {self.entry})\n"
            f"      reason: {self.reason}\n{_chain_text(self.chain, 'allowlisted, not walked')}"
        )


@dataclass
class Report:
    checked: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    allowlisted: list[AllowlistHit] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)

    def violations_of(self, handler: str) -> list[Violation]:
        return [v for v in self.violations if v.handler == handler]

    def allowlisted_for(self, handler: str) -> list[AllowlistHit]:
        return [hit for hit in self.allowlisted if hit.handler == handler]

    def describe(self) -> str:
        parts = [f"{len(self.checked)} handler(s) checked, {len(self.violations)} save(s) found."]
        if self.violations:
            parts += [HOW_TO_FIX, *(v.describe() for v in self.violations)]
        if self.unresolved:
            parts.append("No source found (not checked): " + ", ".join(self.unresolved))
        if self.allowlisted:
            parts += ["Allowlisted:", *(hit.describe() for hit in self.allowlisted)]
        return "\n".join(parts)
