"""Audio bytes -> float32 mono waveform at 16 kHz (or the rate a tower asks for).

soundfile (libsndfile) reads WAV/FLAC/OGG; anything else (MP3, M4A, ...) goes to torchcodec's
FFmpeg-backed ``AudioDecoder``. Channels are averaged; ``torchaudio.functional.resample``
converts the rate.

Budgets (``AudioLimits``), checked from the stream info before decoding and again on what was
decoded: samples x channels per item, and sample rate x channels. A FLAC of a few hundred KB can
say "1 hour, 655 kHz, 8 channels", 18.9 G float32 samples: it is refused from its header. A
stream without a length in its header is decoded only up to the budget. With a ``DecodeGuard``
the decode stops between blocks once ``decode_timeout_s`` is spent or the encode was cancelled.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
import torchaudio.functional as AF

from encoder_svc.decode_limits import DecodeGuard
from encoder_svc.errors import BadMedia, MediaTooLarge, short_reason
from shared.settings import EncoderSettings

TARGET_SR = 16_000
MAX_AUDIO_SECONDS = 3600.0  # a small compressed file can expand to hours of samples
_OVER_LIMIT_S = 1.0  # decoded past the limit, so "longer than the limit" is seen
_BLOCK_FRAMES = 1 << 20  # soundfile reads this many frames between guard checks (~40 ms of decoding)


def _default(name: str) -> int:
    return EncoderSettings.model_fields[name].default


@dataclass(frozen=True)
class AudioLimits:
    """``max_audio_samples`` / ``max_audio_samples_per_second`` of ``EncoderSettings``."""

    max_samples: int = _default("max_audio_samples")
    max_samples_per_second: int = _default("max_audio_samples_per_second")

    @classmethod
    def of(cls, settings: EncoderSettings) -> AudioLimits:
        return cls(settings.max_audio_samples, settings.max_audio_samples_per_second)

    def check_rate(self, rate: int, channels: int) -> None:
        if rate * channels > self.max_samples_per_second:
            raise MediaTooLarge(
                f"audio is {rate} Hz x {channels} channels = {rate * channels} samples per second; the limit is "
                f"max_audio_samples_per_second={self.max_samples_per_second}: resample it (the model uses 16 kHz mono)"
            )

    def check_samples(self, samples: int, channels: int, known: bool = True) -> None:
        if samples * channels > self.max_samples:
            what = f"{samples} samples x {channels} channels" if known else f"over {samples} samples x {channels} channels"
            raise MediaTooLarge(
                f"audio is {what}; the limit is max_audio_samples={self.max_samples} per item: send a shorter clip, "
                "or 16 kHz mono (what the model uses)"
            )

    def seconds(self, rate: int, channels: int) -> float:
        """The longest audio at this rate that fits both budgets."""
        return min(MAX_AUDIO_SECONDS, self.max_samples / max(1, rate * channels))


def _soundfile(data: bytes, limits: AudioLimits, guard: DecodeGuard | None) -> tuple[torch.Tensor, int] | None:
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.frames / max(f.samplerate, 1) > MAX_AUDIO_SECONDS:
                raise MediaTooLarge(f"audio is {f.frames / f.samplerate:.0f} s; the limit is {MAX_AUDIO_SECONDS:.0f} s")
            limits.check_rate(f.samplerate, f.channels)
            limits.check_samples(f.frames, f.channels)
            # in blocks: between them the guard is checked, and a header that undercounts is caught
            blocks, got = [], 0
            while True:
                if guard is not None:
                    guard.check()
                block = f.read(_BLOCK_FRAMES, dtype="float32", always_2d=True)  # [n, C]
                if not len(block):
                    break
                got += len(block)
                limits.check_samples(got, f.channels, known=False)
                blocks.append(block)
            arr = blocks[0] if len(blocks) == 1 else np.concatenate(blocks) if blocks else np.zeros((0, f.channels), np.float32)
            del blocks
            return torch.from_numpy(arr).T.contiguous(), f.samplerate
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None


def _torchcodec(data: bytes, limits: AudioLimits) -> tuple[torch.Tensor, int]:
    from torchcodec.decoders import AudioDecoder

    try:
        dec = AudioDecoder(data)
        m = dec.metadata
        rate, channels = int(m.sample_rate or 0), int(m.num_channels or 0)
        if rate > 0 and channels > 0:
            limits.check_rate(rate, channels)
        dur = m.duration_seconds_from_header
        if dur is not None and dur > MAX_AUDIO_SECONDS:
            raise MediaTooLarge(f"audio is {dur:.0f} s; the limit is {MAX_AUDIO_SECONDS:.0f} s")
        if dur is not None and rate > 0 and channels > 0:
            limits.check_samples(int(dur * rate), channels)
        # the header may lie or be absent (raw streams): never decode past the limits
        stop = (limits.seconds(rate, channels) if rate > 0 and channels > 0 else MAX_AUDIO_SECONDS) + _OVER_LIMIT_S
        s = dec.get_samples_played_in_range(0.0, stop)
        limits.check_samples(s.data.shape[1], s.data.shape[0], known=dur is not None)  # "over": it was cut
    except MediaTooLarge:
        raise
    except Exception as e:  # torchcodec raises RuntimeError/ValueError with FFmpeg's message
        raise BadMedia(
            f"cannot decode the audio: send WAV, FLAC, OGG or MP3 bytes of an intact file ({short_reason(e)})"
        ) from e
    return s.data.to(torch.float32), int(s.sample_rate)  # [C, n]


def decode_audio(data: bytes, target_sr: int = TARGET_SR, limits: AudioLimits | None = None,
                 guard: DecodeGuard | None = None) -> torch.Tensor:
    """float32 [n] mono at ``target_sr``; raises ``BadMedia`` (400) / ``MediaTooLarge`` (413, a
    budget of ``limits`` or ``guard``'s ``decode_timeout_s`` passed)."""
    limits = limits or AudioLimits()
    got = _soundfile(data, limits, guard)
    wave, sr = got if got is not None else _torchcodec(data, limits)
    if wave.ndim != 2 or wave.shape[1] == 0:
        raise BadMedia("the audio has no samples")
    if wave.shape[1] / sr > MAX_AUDIO_SECONDS:
        raise MediaTooLarge(f"audio is {wave.shape[1] / sr:.0f} s; the limit is {MAX_AUDIO_SECONDS:.0f} s")
    limits.check_rate(sr, wave.shape[0])
    limits.check_samples(wave.shape[1], wave.shape[0])
    if guard is not None:
        guard.check()  # before the resample, which costs as much again
    if not torch.isfinite(wave).all():
        raise BadMedia("the audio contains NaN or infinite samples")
    mono = wave.mean(dim=0)
    if sr != target_sr:
        mono = AF.resample(mono, sr, target_sr)
    return mono.contiguous()
