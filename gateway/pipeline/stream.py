"""The stream stage: the choices' chunks from the LLM as SSE events, in the shape the writer
makes (chat completions, text completions or Responses)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from gateway.openai_api.answer_format import SSE_DONE, ChunkWriter, CompletionChunkWriter
from gateway.pipeline.choices import ABORTED, ChoiceStreams
from gateway.state import GatewayState
from gateway.upstream import UpstreamError
from shared.schemas import GenerateChunk


async def sse_events(
    stream: ChoiceStreams, writer: ChunkWriter | CompletionChunkWriter, state: GatewayState, start: float
) -> AsyncIterator[bytes]:
    """Opening events (chat: the role chunk of each choice), content deltas, a finish chunk per
    choice, the usage chunk (if asked: the prompt once, every choice's completion tokens),
    ``[DONE]``; an upstream failure mid-stream becomes an ``error`` event. Closing the generator
    closes upstream. Chat and text completions alike (``writer`` makes their shapes)."""
    first_token = True
    finished: dict[int, GenerateChunk] = {}
    out: list[bytes] = []  # the events of one batch of chunks (or of the end): one write each
    try:
        for i in range(stream.n):
            for event in writer.opening(i):
                yield event
        async with aclosing(stream.batches()) as batches:
            ended = False
            async for batch in batches:
                for i, chunk in batch:
                    if chunk.error:
                        out.append(writer.error(f"generation failed: {chunk.error}"))
                        ended = True
                        break
                    if chunk.text or chunk.token_logprobs or chunk.reasoning or chunk.tool_calls or chunk.prompt_logprobs:
                        if first_token:
                            state.metrics.ttft.observe(time.monotonic() - start)
                            first_token = False
                        out.append(writer.content(chunk.text, chunk.token_logprobs, chunk.reasoning, chunk.tool_calls,
                                                  index=i, prompt_logprobs=chunk.prompt_logprobs))
                    if chunk.finish_reason == "abort":
                        out.append(writer.error(ABORTED))
                        ended = True
                        break
                    if chunk.finish_reason is not None:
                        out.append(writer.finish(chunk.finish_reason, index=i))
                        finished[i] = chunk
                        if len(finished) == stream.n:
                            ended = True
                            break
                if ended:
                    break
                if out:
                    yield b"".join(out)
                    out.clear()
            if not ended:
                out.append(writer.error("generation ended without a finish reason"))
        if len(finished) == stream.n and writer.include_usage:
            first = finished[0]
            out.append(writer.usage(first.prompt_tokens or 0, sum(c.completion_tokens or 0 for c in finished.values()),
                                    first.cached_tokens or 0))
        out.append(SSE_DONE)
        yield b"".join(out)
    except UpstreamError as e:
        yield b"".join(out) + writer.error(e.message) + SSE_DONE
    finally:
        await stream.aclose()
