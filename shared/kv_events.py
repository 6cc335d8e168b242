"""KV events on the wire: what LLM replicas append to a Redis stream and gateways read.

One stream entry is one change of one replica's held router keys (``shared.prefix_keys``):

* ``i``: the replica's instance id (its ``/readyz`` ``kv_instance``; new on every start),
* ``s``: the change's number, 1, 2, ... per instance with no gaps (a gap: an event was lost
  or trimmed; the reader reloads the replica's ``/kv/snapshot``),
* ``a`` / ``r``: keys stored / removed (decimal, space-separated),
* ``c``: ``1`` when the replica's tree was emptied first (its engine core restarted).
* ``m``: HMAC-SHA256 (hex) under the services' peer key (``shared.peer_auth``) over the stream's
  name and the fields above: a gateway ignores (and counts) an entry whose tag does not check
  out, so an event planted in Redis, or copied from another stream, never steers routing.

A replica's ``/kv/snapshot`` (``KVSnapshot``) is its held keys as of change ``seq``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from shared.peer_auth import PeerKey

SNAPSHOT_PATH = "/kv/snapshot"
DOMAIN = "kv_event"
_SIGNED = ("i", "s", "a", "r", "c")


class KVEventAuthError(ValueError):
    """A stream entry whose tag does not check out under the peer key."""


def _message(f: dict[str, str]) -> bytes:
    return "\n".join(f.get(k, "") for k in _SIGNED).encode()


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

    def fields(self, stream: str, peer: PeerKey | None = None) -> dict[str, str]:
        """The entry to append to ``stream``, tagged under ``peer`` (None: the development key)."""
        out = {"i": self.instance, "s": str(self.seq), "a": " ".join(map(str, self.stored)),
               "r": " ".join(map(str, self.removed))}
        if self.clear:
            out["c"] = "1"
        out["m"] = (peer or PeerKey.development()).tag(DOMAIN, stream, _message(out)).hex()
        return out

    @classmethod
    def parse(cls, fields: dict, stream: str, peer: PeerKey | None = None) -> "KVEvent":
        """From an entry of ``stream`` (bytes or str fields); raises ``KVEventAuthError`` when its
        tag does not check out under ``peer`` (checked first), ``ValueError`` on a malformed one."""
        try:
            f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                 for k, v in fields.items()}
        except UnicodeDecodeError:
            raise KVEventAuthError("a KV event that is not text") from None
        try:
            tag = bytes.fromhex(f.get("m", ""))
        except ValueError:
            tag = b""
        if not (peer or PeerKey.development()).verify(tag, DOMAIN, stream, _message(f)):
            raise KVEventAuthError(f"a KV event of instance {f.get('i', '')[:32]!r} failed its HMAC check")
        try:
            return cls(f["i"], int(f["s"]), [int(x) for x in f.get("a", "").split()],
                       [int(x) for x in f.get("r", "").split()], f.get("c") == "1")
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV event {f!r}") from e
