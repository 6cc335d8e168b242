"""Audio bytes -> float32 mono waveform at 16 kHz (or the rate a tower asks for).

soundfile (libsndfile) reads WAV/FLAC/OGG; anything else (MP3, M4A, ...) goes to torchcodec's
FFmpeg-backed ``AudioDecoder``. Channels are averaged; ``torchaudio.functional.resample``
converts the rate.
"""

from __future__ import annotations

import io

import torch
import torchaudio.functional as AF

from encoder_svc.errors import BadMedia, MediaTooLarge, short_reason

TARGET_SR = 16_000
MAX_AUDIO_SECONDS = 3600.0  # a small compressed file can expand to hours of samples
_OVER_LIMIT_S = 1.0  # decoded past the limit, so "longer than the limit" is seen


def _soundfile(data: bytes) -> tuple[torch.Tensor, int] | None:
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.frames / max(f.samplerate, 1) > MAX_AUDIO_SECONDS:
                raise MediaTooLarge(f"audio is {f.frames / f.samplerate:.0f} s; the limit is {MAX_AUDIO_SECONDS:.0f} s")
            arr = f.read(dtype="float32", always_2d=True)  # [n, C]
            return torch.from_numpy(arr).T.contiguous(), f.samplerate
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None


def _torchcodec(data: bytes) -> tuple[torch.Tensor, int]:
    from torchcodec.decoders import AudioDecoder

    try:
        dec = AudioDecoder(data)
        dur = dec.metadata.duration_seconds_from_header
        if dur is not None and dur > MAX_AUDIO_SECONDS:
            raise MediaTooLarge(f"audio is {dur:.0f} s; the limit is {MAX_AUDIO_SECONDS:.0f} s")
        # the header may lie or be absent (raw streams): never decode past the limit
        s = dec.get_samples_played_in_range(0.0, MAX_AUDIO_SECONDS + _OVER_LIMIT_S)
    except MediaTooLarge:
        raise
    except Exception as e:  # torchcodec raises RuntimeError/ValueError with FFmpeg's message
        raise BadMedia(
            f"cannot decode the audio: send WAV, FLAC, OGG or MP3 bytes of an intact file ({short_reason(e)})"
        ) from e
    return s.data.to(torch.float32), int(s.sample_rate)  # [C, n]


def decode_audio(data: bytes, target_sr: int = TARGET_SR) -> torch.Tensor:
    """float32 [n] mono at ``target_sr``; raises ``BadMedia`` (400) / ``MediaTooLarge`` (413)."""
    got = _soundfile(data)
    wave, sr = got if got is not None else _torchcodec(data)
    if wave.ndim != 2 or wave.shape[1] == 0:
        raise BadMedia("the audio has no samples")
    if wave.shape[1] / sr > MAX_AUDIO_SECONDS:
        raise MediaTooLarge(f"audio is {wave.shape[1] / sr:.0f} s; the limit is {MAX_AUDIO_SECONDS:.0f} s")
    if not torch.isfinite(wave).all():
        raise BadMedia("the audio contains NaN or infinite samples")
    mono = wave.mean(dim=0)
    if sr != target_sr:
        mono = AF.resample(mono, sr, target_sr)
    return mono.contiguous()
