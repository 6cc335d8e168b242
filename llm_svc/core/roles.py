"""How the engine core steps its engine for its role (``role`` setting; docs/disagg.md).

* ``both``: the engine as is.
* ``prefill``: a request that names a decode core (``CoreRemote.send_host``) runs to its first
  token through ``PrefillSide``; its hand-over is sent on the ``HandoverLink``'s thread while
  the engine steps on, and the request's one output (that token, ``finish_reason``
  ``remote_decode``) goes to the front once every byte went out; a failed or timed-out send
  fails it with a 503 instead, so the decode replica recomputes (with a shared Redis tier, once
  the prompt's pages are written there: the decode replica's lookup loads them). A first token that ends the
  request is its answer (its own finish reason), with nothing sent.
* ``decode``: the link listens for hand-overs; a request that names one (``first_token``,
  ``transfer_id``) waits, outside the engine, until it has arrived or ``handover_timeout_s``
  passed, then continues through ``DecodeSide`` from its KV (or recomputes, counted by
  reason). Its first output is the first token the prefill replica sampled.

Requests without a ``CoreRemote`` are served as on a ``both`` replica on either role.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from llm_svc.disagg.decode import DecodeSide
from llm_svc.disagg.link import HandoverLink
from llm_svc.disagg.prefill import PrefillConfig, PrefillSide, kv_fingerprint
from llm_svc.disagg.transport import handover_address
from llm_svc.types.messages import REMOTE_DECODE, CoreRemote, CoreToken
from llm_svc.types.request import Request

log = logging.getLogger(__name__)

# the longest a failed hand-over's answer waits for its pages to reach the Redis tier (a wait only
# while writes are queued, so a generous bound costs nothing while Redis keeps up)
L3_FLUSH_S = 3.0


@dataclass
class _Send:
    host: str
    port: int
    transfer_id: str
    future: object = None  # concurrent.futures.Future from HandoverLink.send, once the hand-over is made
    first: CoreToken | None = None  # the engine's output of the first token (its logprobs too)
    aborted: bool = False

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Waiting:
    req: Request
    remote: CoreRemote  # its transfer_id names the hand-over, first_token the token it continues from
    deadline: float


def _first(rid: str, remote: CoreRemote, **kw) -> CoreToken:
    """The decode side's first output: the prefill replica's token, with its logprobs if sent."""
    return CoreToken(rid, token_id=remote.first_token, logprob=remote.first_logprob, top=remote.first_top, **kw)


class RoleDriver:
    """Steps ``engine`` for ``settings.role`` (no settings: ``both``); ``model_id``: the
    checkpoint's identity (part of the KV fingerprint both replicas must agree on)."""

    def __init__(self, engine, settings=None, model_id: str = "") -> None:
        self.engine = engine
        self.role = settings.role if settings is not None else "both"
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.link: HandoverLink | None = None
        self._sends: dict[str, _Send] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._out: list[CoreToken] = []  # outputs made outside the engine, sent with the next step's
        if self.role == "both":
            return
        fp = kv_fingerprint(engine, model_id)
        key = (settings.service_token or "").encode()  # both ends of a hand-over prove they hold it
        if self.role == "prefill":
            self.prefill = PrefillSide(engine, PrefillConfig(settings.kv_l3_page_tokens, fp))
            self.link = HandoverLink(None, settings.handover_timeout_s, settings.handover_ttl_s, key=key,
                                     transport=settings.kv_transport)
        else:
            self.decode = DecodeSide(engine, fp)
            self.link = HandoverLink((handover_address(settings.handover_host)[0], settings.handover_port),
                                     settings.handover_timeout_s, settings.handover_ttl_s, key=key,
                                     transport=settings.kv_transport, pool_bytes=settings.handover_pool_bytes)
        log.info("P/D role %s: KV pages of a hand-over by %s", self.role, self.link.transport)
        self.timeout_s = settings.handover_timeout_s

    @property
    def handover_port(self) -> int:
        return self.link.port if self.link is not None and self.decode is not None else 0

    # ------------------------------------------------------------------ inputs
    def add(self, req: Request, remote: CoreRemote | None) -> None:
        """Start ``req`` (``Engine.add``'s ``InvalidRequest`` propagates, as does ``ValueError``
        for a remote part this role does not play)."""
        if remote is None:
            self.engine.add(req)
        elif remote.send_host:
            if self.prefill is None:
                raise ValueError(f"this replica's role is {self.role}: it does not hand KV over (role prefill does)")
            self.prefill.add(req)
            self._sends[req.req_id] = _Send(remote.send_host, remote.send_port, remote.transfer_id or req.req_id)
        elif remote.first_token is not None:
            if self.decode is None:
                raise ValueError(f"this replica's role is {self.role}: it does not continue hand-overs (role decode does)")
            if remote.finish_reason is not None:  # the first token ended it: nothing to decode
                self._out.append(_first(req.req_id, remote, finish_reason=remote.finish_reason))
            elif not remote.transfer_id:
                self.decode.recompute(req, remote.first_token, "not_sent")
                self._out.append(_first(req.req_id, remote))
            else:
                self._waiting[req.req_id] = _Waiting(req, remote, time.monotonic() + self.timeout_s)
        else:
            raise ValueError("a remote part names neither a decode core to send to nor a first token to continue from")

    def abort(self, req_id: str) -> bool:
        """Abort ``req_id`` where it waits outside the engine; False when the engine holds it."""
        w = self._waiting.pop(req_id, None)
        if w is not None:
            self.link.drop(w.remote.transfer_id)
            self._out.append(CoreToken(req_id, finish_reason="abort"))
            return True
        s = self._sends.get(req_id)
        if s is not None and s.future is not None:  # its first token is out: the send finishes, unreported
            s.aborted = True
            return True
        return False

    # ------------------------------------------------------------------ the loop
    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self._out) or self.busy()

    def busy(self) -> bool:
        """Something is in flight outside the engine: the loop must come back soon."""
        return bool(self._waiting) or any(s.future is not None for s in self._sends.values())

    def step(self) -> list[CoreToken]:
        outs: list[CoreToken] = []
        if self.decode is not None:
            self._claim()
        if self.engine.has_work():
            if self.prefill is not None:
                st = self.prefill.step()
                outs += st.outputs
                for t in st.failed:
                    self._sends.pop(t.request_id, None)
                    outs.append(t)
                for h in st.handovers:
                    self._ship(h, st.finish_reasons.get(h.request_id), st.firsts[h.request_id])
            elif self.decode is not None:
                outs += self.decode.step()
            else:
                outs += self.engine.step()
        if self.prefill is not None:
            outs += self._sent()
        if self.link is not None and self.decode is not None:
            self.link.expire()
        outs, self._out = self._out + outs, []
        return outs

    def _ship(self, h, reason: str | None, first: CoreToken) -> None:
        s = self._sends[h.request_id]
        if h.finished:
            del self._sends[h.request_id]
            self._out.append(msgspec.structs.replace(first, finish_reason=reason or "stop"))
            return
        s.first = first
        s.future = self.link.send(s.host, s.port, msgspec.structs.replace(h, request_id=s.transfer_id))

    def _sent(self) -> list[CoreToken]:
        outs = []
        done = [r for r, s in self._sends.items() if s.future is not None and s.future.done()]
        if any(self._sends[r].future.exception() is not None for r in done):
            # the Redis tier is the fallback path: the prompts' pages, queued for it when their
            # prefill ended, land before the 503 sends the decode replica to recompute (its L3
            # lookup then loads them)
            tiers = getattr(self.engine, "tiers", None)
            if tiers is not None and tiers.l3 is not None:
                tiers.l3.flush(L3_FLUSH_S)
        for rid in done:
            s = self._sends.pop(rid)
            err = s.future.exception()
            if s.aborted:
                outs.append(CoreToken(rid, finish_reason="abort"))
            elif err is not None:
                log.warning("hand-over of %s to %s failed: %s", rid, s.target, err)
                outs.append(CoreToken(rid, error=f"the KV hand-over to the decode replica failed ({type(err).__name__}: "
                                                 f"{err}); prefill again or serve it unified", status=503,
                                      code="handover_failed"))
            else:
                outs.append(msgspec.structs.replace(s.first, finish_reason=REMOTE_DECODE))
        return outs

    def _claim(self) -> None:
        now = time.monotonic()
        for rid in list(self._waiting):
            w = self._waiting[rid]
            h = self.link.take(w.remote.transfer_id)
            if h is None and now < w.deadline:
                continue
            del self._waiting[rid]
            try:
                if h is None:
                    self.decode.recompute(w.req, w.remote.first_token, "timeout")
                    adopted = False
                else:
                    adopted = self.decode.add(w.req, msgspec.structs.replace(h, request_id=rid))
            except Exception as e:  # InvalidRequest, or a hand-over this request cannot take
                self._out.append(CoreToken(rid, error=f"the request could not continue: {getattr(e, 'message', e)}",
                                           status=400))
                continue
            self._out.append(_first(rid, w.remote, num_cached_tokens=len(w.req.prompt_ids) if adopted else 0))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float]:
        """``handover_*`` counters for the core's stats (cumulative)."""
        if self.link is None:
            return {}
        out = {k: float(v) for k, v in self.link.stats.items()}
        out["handover_waiting"] = float(len(self._waiting))
        out["handover_held"] = float(self.link.num_held)
        out["handover_sending"] = float(sum(s.future is not None for s in self._sends.values()))
        if self.decode is not None:
            out["handover_adopted"] = float(self.decode.stats["adopted"])
            out["handover_adopted_tokens"] = float(self.decode.stats["adopted_tokens"])
            for reason, n in self.decode.fallbacks.items():
                out[f"handover_fallback_{reason}"] = float(n)
        return out

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
