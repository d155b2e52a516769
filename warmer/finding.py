"""What a check finds about a restored cache, with the fix: the one shape fetch, serve and doctor show."""

from __future__ import annotations

from dataclasses import asdict, dataclass

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass(frozen=True)
class Finding:
    severity: str  # ERROR: vLLM will compile from cold; WARNING: some of it will; INFO: said, harmless
    check: str  # what looked: artifact, vllm-key, path-contract, fit, recipe, a component's name, ...
    subject: str
    what: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)
