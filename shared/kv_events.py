"""KV events on the wire: what LLM replicas append to a Redis stream and gateways read.

One stream entry is one change of one replica's held router keys (``shared.prefix_keys``):

* ``i``: the replica's instance id (its ``/readyz`` ``kv_instance``; new on every start),
* ``s``: the change's number, 1, 2, ... per instance with no gaps (a gap: an event was lost
  or trimmed; the reader reloads the replica's ``/kv/snapshot``),
* ``a`` / ``r``: keys stored / removed (decimal, space-separated),
* ``c``: ``1`` when the replica's tree was emptied first (its engine core restarted).

A replica's ``/kv/snapshot`` (``KVSnapshot``) is its held keys as of change ``seq``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, Field

SNAPSHOT_PATH = "/kv/snapshot"


class KVSnapshot(BaseModel):
    instance: str = Field(min_length=1)
    seq: int = Field(ge=0)
    keys: list[int]


@dataclass
class KVEvent:
    instance: str
    seq: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    clear: bool = False

    def __post_init__(self) -> None:
        if not self.instance or self.seq < 1:
            raise ValueError(f"bad KV event: instance {self.instance!r}, seq {self.seq}")

    def fields(self) -> dict[str, str]:
        out = {"i": self.instance, "s": str(self.seq), "a": " ".join(map(str, self.stored)),
               "r": " ".join(map(str, self.removed))}
        if self.clear:
            out["c"] = "1"
        return out

    @classmethod
    def parse(cls, fields: dict) -> "KVEvent":
        """From a stream entry's fields (bytes or str); raises ``ValueError`` on a malformed one."""
        f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in fields.items()}
        try:
            return cls(f["i"], int(f["s"]), [int(x) for x in f.get("a", "").split()],
                       [int(x) for x in f.get("r", "").split()], f.get("c") == "1")
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV event {f!r}") from e
