"""A decode replica's call to a prefill replica (docs/disagg.md).

A request to a ``role: decode`` replica with ``kv_transfer_params.do_remote_prefill`` is first
sent, as it came (not streamed; media by value or by reference, fetched there), to ``remote_prefill_url``'s ``/v1/generate`` with
``do_remote_decode`` naming this replica's hand-over address. The prefill replica answers with
the first token once the KV is on its way here (``finish_reason`` ``remote_decode``), or with
the first token and its own reason when that token ended the request. Any failure (no answer,
an error, a timeout) and the prompt is prefilled here instead: the client sees at most a later
first token. Outcomes are counted on ``mmserve_llm_remote_prefill{outcome}``.
"""

from __future__ import annotations

import logging

import httpx

from llm_svc.core.media_fetch import SourceAllowList
from llm_svc.disagg.transport import handover_address
from llm_svc.types.errors import InvalidRequest
from llm_svc.types.messages import REMOTE_DECODE, CoreRemote
from llm_svc.types.request import PreparedRequest
from shared.rawwire import SAFETENSORS_MIME, pack_raw, unpack_raw
from shared.schemas import GenerateRequest, GenerateResponse, KVTransferParams
from shared.service_auth import token_headers

log = logging.getLogger(__name__)

PEER_SETTING = "MMSERVE_LLM_KV_PEER_ALLOW"
KV_PEER_NOT_ALLOWED = "kv_peer_not_allowed"


async def check_peer(peers: SourceAllowList, prep: PreparedRequest) -> None:
    """Refuse (``InvalidRequest``, 400 ``kv_peer_not_allowed``) a hand-over that names a replica
    outside ``kv_peer_allow``: a decode replica would send its service token to that URL, a
    prefill replica the prompt's KV to that address. The message does not echo the address."""
    kt = prep.kv_transfer
    if kt is None:
        return
    if kt.do_remote_prefill:
        ok = await peers.permits(kt.remote_prefill_url)
    else:  # do_remote_decode (the schema asks for exactly one)
        host = kt.remote_host if ":" not in kt.remote_host else f"[{kt.remote_host}]"
        ok = await peers.permits(f"http://{host}:{kt.remote_port}")
    if not ok:
        which = "remote_prefill_url" if kt.do_remote_prefill else "remote_host:remote_port"
        raise InvalidRequest(f"kv_transfer_params.{which} names a replica outside this replica's {PEER_SETTING}; "
                             "name one of the replicas it lists, or add the replica there",
                             param="kv_transfer_params", code=KV_PEER_NOT_ALLOWED)


def check_transfer(role: str, prep: PreparedRequest) -> bool:
    """Whether ``prep`` is to be prefilled on a remote replica first (``do_remote_prefill``).
    Refuses (``InvalidRequest``) what this replica's role cannot do with ``prep.kv_transfer``
    and a hand-over it cannot make. A request to continue from a remote prefill that carries what
    does not travel in a hand-over yet is served here alone instead, counted on
    ``mmserve_llm_remote_prefill{outcome="fallback_unsupported"}`` by the caller."""
    kt = prep.kv_transfer
    if kt is None:
        return False
    if kt.do_remote_decode and role != "prefill":
        raise InvalidRequest(f"kv_transfer_params.do_remote_decode needs a prefill replica; this one's role is {role}",
                             param="kv_transfer_params")
    if kt.do_remote_prefill and role != "decode":
        raise InvalidRequest(f"kv_transfer_params.do_remote_prefill needs a decode replica; this one's role is {role}",
                             param="kv_transfer_params")
    # media travels as the request does (by value, or by reference: fetched where it is prefilled)
    why = ("prompt logprobs" if prep.sampling.prompt_logprobs is not None
           else "echo" if prep.echo_text else None)
    if why is not None:
        if kt.do_remote_prefill:
            prep.kv_transfer = None
            return False
        raise InvalidRequest(f"a request with {why} is not handed over between replicas yet; send it without "
                             "kv_transfer_params (a unified replica serves it)", param="kv_transfer_params")
    if kt.do_remote_decode:
        prep.remote = CoreRemote(transfer_id=prep.request_id, send_host=kt.remote_host, send_port=kt.remote_port)
    return kt.do_remote_prefill


def _prefill_body(_lm, body: bytes, host: str, port: int) -> bytes:
    """The request as it came (media tensors sent by value included, items by reference as
    references: the prefill replica fetches those), unstreamed, naming this replica's core."""
    tensors, req = unpack_raw(body, GenerateRequest)
    req = req.model_copy(update={"stream": False, "kv_transfer_params": KVTransferParams(
        do_remote_decode=True, remote_host=host, remote_port=port)})
    return pack_raw(tensors, req)


async def remote_prefill(state, prep: PreparedRequest, body: bytes) -> CoreRemote | None:
    """Have the prefill replica run ``prep``'s prompt; the ``CoreRemote`` this replica continues
    with, or None to prefill here."""
    s = state.settings
    url = prep.kv_transfer.remote_prefill_url.rstrip("/")
    port = state.backend.handover_port()
    outcome = "fallback_no_port"
    try:
        if not port:
            return None
        payload = await state.prep.run(_prefill_body, body, handover_address(s.handover_host)[1], port)
        if state.remote_http is None:
            state.remote_http = httpx.AsyncClient(trust_env=False, headers=token_headers(s.service_token))
        try:
            r = await state.remote_http.post(f"{url}/v1/generate", content=payload,
                                             headers={"content-type": SAFETENSORS_MIME},
                                             timeout=s.remote_prefill_timeout_s)
        except httpx.TimeoutException:
            outcome = "fallback_timeout"
            return None
        except httpx.HTTPError as e:
            outcome = "fallback_unreachable"
            log.warning("prefill replica %s unreachable for %s: %s", url, prep.request_id, type(e).__name__)
            return None
        if r.status_code != 200:
            outcome = f"fallback_http_{r.status_code}"
            log.warning("prefill replica %s answered %s for %s: %s", url, r.status_code, prep.request_id, r.text[:300])
            return None
        try:
            got = GenerateResponse.model_validate_json(r.content)
        except ValueError:
            outcome = "fallback_bad_answer"
            return None
        if len(got.token_ids) != 1:
            outcome = "fallback_bad_answer"
            return None
        lp = {}
        if prep.return_logprobs and got.token_logprobs:  # the first token's, as the prefill replica sampled it
            t = got.token_logprobs[0]
            lp = {"first_logprob": t.logprob, "first_top": [(a.token_id, a.logprob) for a in t.top]}
        if got.finish_reason == REMOTE_DECODE:
            outcome = "handed_over"
            return CoreRemote(transfer_id=prep.request_id, first_token=got.token_ids[0], **lp)
        outcome = "finished"
        return CoreRemote(first_token=got.token_ids[0], finish_reason=got.finish_reason, **lp)
    except Exception:  # whatever went wrong on the way, the prompt is prefilled here
        outcome = "fallback_error"
        log.exception("remote prefill of %s at %s failed", prep.request_id, url)
        return None
    finally:
        state.metrics.remote_prefill.labels(outcome).inc()
