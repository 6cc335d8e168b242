"""What the routes of one LLM service app share: settings, the loaded model, the backend, and
the pool of threads that decode bodies and tokenize prompts off the event loop."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shared.admission import Admission, AdmissionConfig
from shared.gc_tuning import freeze_startup_heap, thaw_heap
from shared.peer_auth import resolve as resolve_peer_key
from shared.service_auth import token_headers
from shared.settings import LLMSettings

from llm_svc.backends import BACKENDS, Backend
from llm_svc.loading.loader import LoadedLM, load_lm
from .kv_publish import KVPublisher
from llm_svc.core.media_fetch import EmbeddingFetcher, SourceAllowList
from llm_svc.engine.spec import SpeculativeConfig
from .metrics import LLMMetrics
from .word_cache import WORD_CACHE_WORDS, bound_word_cache

def mtp_layers_of(lm_dir) -> int:
    """``num_nextn_predict_layers`` of the checkpoint's config.json (0: none, or not a MiMo)."""
    try:
        cfg = json.loads((Path(lm_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    n = cfg.get("num_nextn_predict_layers", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


log = logging.getLogger(__name__)

PREP_THREADS = 2


class PrepPool:
    """Runs ``fn(lm, *args)`` on a worker thread, each thread with its own tokenizer copy (an HF
    fast tokenizer must not be used from two threads at once), so that unpacking a big body
    or tokenizing a long prompt never blocks ``/readyz`` or other requests. Each copy's word
    cache is bounded to ``word_cache`` words (``tokenizer_word_cache``; ``llm_svc.front.word_cache``;
    a fresh copy would keep up to 10,000)."""

    def __init__(self, lm: LoadedLM, workers: int = PREP_THREADS, word_cache: int = WORD_CACHE_WORDS):
        self._lm = lm
        self._word_cache = word_cache
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="llm-prep")

    def _call(self, fn, args):
        lm = getattr(self._local, "lm", None)
        if lm is None:
            tokenizer = copy.deepcopy(self._lm.tokenizer)
            bound_word_cache(tokenizer, self._word_cache)
            lm = self._local.lm = dataclasses.replace(self._lm, tokenizer=tokenizer)
        return fn(lm, *args)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn, args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class ServiceState:
    settings: LLMSettings
    metrics: LLMMetrics = field(default_factory=LLMMetrics)
    lm: LoadedLM | None = None
    backend: Backend | None = None
    prep: PrepPool | None = None
    media: EmbeddingFetcher | None = None  # embeddings sent by reference, fetched from the encoders
    kv_events: KVPublisher | None = None  # with kv_events_url and a backend that reports its tree
    error: str | None = None
    spec: SpeculativeConfig | None = None  # speculative decoding in force (None: off)
    live: dict = field(default_factory=dict)  # request id -> routes._Live (ticket, deadline timer)
    remote_http: object | None = None  # httpx.AsyncClient to prefill replicas (role decode), made on first use
    admission: Admission = field(init=False)
    kv_peers: SourceAllowList = field(init=False)  # the replicas a P/D hand-over may name (kv_peer_allow)

    def __post_init__(self) -> None:
        self.kv_peers = SourceAllowList(self.settings.kv_peer_allow)
        # no queue here: the engine's scheduler is the queue; past the bound the front says 429
        self.admission = Admission(AdmissionConfig(self.settings.max_in_flight), "LLM service")
        self.metrics.watch_admission(self.admission)
        self.metrics.set_role(self.settings.role)

    @property
    def in_flight(self):
        """The ids of the requests in flight (a view of ``live``'s keys)."""
        return self.live.keys()

    @property
    def model_name(self) -> str:
        if self.settings.model_name:
            return self.settings.model_name
        return self.lm.spec.name if self.lm else self.settings.model_dir

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready

    @property
    def not_ready_detail(self) -> str:
        if self.error:
            return self.error
        if self.backend is not None:
            return self.backend.detail or "not serving"
        return "loading"

    async def load(self) -> None:
        """Load the model (the weights only where the backend runs in this process) off the
        event loop, then start the backend; failures land in ``error``."""
        try:
            s = self.settings
            cls = BACKENDS.get(s.backend)
            # every Redis this replica reads back from, checked before anything loads (named if unset)
            peer = resolve_peer_key(s.peer_key, [s.kv_l3_url, s.media_redis_url, s.kv_events_url],
                                    "MMSERVE_LLM_PEER_KEY")
            lm = await asyncio.to_thread(load_lm, s.model_dir, s.device, s.dtype, cls.needs_weights)
            derived = s.max_model_len is None
            if derived:  # the checkpoint's context length, as vLLM; the engine core sizes its pools by it
                s = self.settings = s.model_copy(update={"max_model_len": lm.context_len})
            auto = s.backend != "swa" and s.speculative_config.strip().lower() == "auto"  # the reference: off
            # a bad value fails the start, named
            self.spec = None if auto else SpeculativeConfig.resolve(s.speculative_config, mtp_layers_of(lm.spec.lm_dir))
            if self.spec is not None and s.backend != "swa":
                raise ValueError("speculative_config needs the swa backend (--backend swa)")
            if self.spec is not None and self.spec.method == "mtp":
                self.spec = self.spec.with_mtp_layers(mtp_layers_of(lm.spec.lm_dir))
            backend = await asyncio.to_thread(cls, s, lm)
            self.lm, self.prep = lm, PrepPool(lm, word_cache=s.tokenizer_word_cache)
            self.media = backend.media = EmbeddingFetcher(lm.hidden_size, s.media_fetch_timeout, self.metrics,
                                                          redis_url=s.media_redis_url, redis_prefix=s.media_redis_prefix,
                                                          allow=s.media_fetch_allow,
                                                          headers=token_headers(s.service_token),
                                                          max_bytes=s.media_fetch_max_bytes,
                                                          peer=peer)
            if s.kv_events_url and cls.publishes_kv_events and s.enable_prefix_cache:
                self.kv_events = backend.kv_events = KVPublisher(
                    s.kv_events_url, s.kv_events_stream, s.kv_events_maxlen,
                    peer=peer)
                self.kv_events.start()
            await backend.start()
            held = backend.max_sequence_tokens()
            if derived and held is not None and held < s.max_model_len:  # at most what the KV pool holds
                s = self.settings = s.model_copy(update={"max_model_len": held})
            log.info("max_model_len %d (%s)", s.max_model_len, "the checkpoint's context length, at most the KV "
                     "pool" if derived else "set")
            self.backend = backend
            log.info("llm service ready: %s backend=%s", self.model_name, s.backend)
            freeze_startup_heap("llm front")
        except Exception as e:
            log.exception("llm service failed to load")
            self.error = f"{type(e).__name__}: {e}"

    async def close(self) -> None:
        thaw_heap()
        if self.backend is not None:
            await self.backend.close()
            self.backend = None
        if self.prep is not None:
            self.prep.close()
        if self.media is not None:
            await self.media.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.remote_http is not None:
            await self.remote_http.aclose()
